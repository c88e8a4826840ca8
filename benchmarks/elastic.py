"""Rehearsal of Elastor across nodes on one machine: 3 node launchers (2 CPU ranks each) on the loopback, a
rendezvous store served by a process that trains nothing, and one failure per scenario:

  rank       one rank of node 1 killed (SIGKILL: a lost GPU)
  node       node 2 killed whole (its launcher, forkserver and ranks)
  hang       a rank of node 1 stopped (SIGSTOP), detected after --hetu-hang-timeout
  spare      a fourth node launcher joins (up to --nnodes 1:4)
  rank0      the node holding global rank 0 killed whole
  deepspeed  one rank lost from a DeepSpeed ZeRO-3 bf16 job of 4 ranks on one node launcher (launch/elastic.py
             --launcher deepspeed; benchmarks/deepspeed_elastic.py): its columns are detect, plan, start, load, total

For each: the job must finish its iterations (every launcher left exits 0); the losses after the last recovery
must equal an uninterrupted run of the same plan from the checkpoint it loaded (a fresh pretrain_gpt.py launch),
and every iteration must have trained one full global batch (``samples_lost`` counts the samples missing from
the final history). Recovery time runs from the failure (hang: from the end of the hang timeout; spare: from the
new launcher's start) to the first step completed after it, split by the launchers' events and the metrics file:
detect (first launcher that noticed), rendezvous (last node through the round), plan (last node holding the plan),
start (ranks started to the checkpoint load's start: process start, process group, model), load (the checkpoint
load), the rest up to total is the first step. Prints a table and one JSON line.

    python -m benchmarks.elastic                      # all five scenarios, about 5 minutes on 2 cores
    python -m benchmarks.elastic --scenarios rank,hang --out benchmarks/results/elastic_cpu_DATE.txt
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import ROOT, Table, result_line

SCENARIOS = ("rank", "node", "hang", "spare", "rank0", "deepspeed")
LOSS_RTOL = 1e-6
"""As tests/test_uniform_equivalence.py: the reference runs the same plan from the same checkpoint, so any
difference beyond float-sum order would be a skipped or repeated sample or a wrong state."""


@dataclass(kw_only=True)
class Job:
    """One rehearsal job: its flags and where it writes."""

    workdir: Path
    train_iters: int = 30
    save_interval: int = 3
    layer_ms: float = 10.0
    """Emulated time of one layer's forward (backward: twice), so that a step lasts long enough to be hit."""
    hang_timeout: float = 5.0
    nproc: int = 2
    nodes: int = 3
    max_nodes: int = 4

    @property
    def save(self) -> Path:
        return self.workdir / "ckpt"

    def train_flags(self) -> list[str]:
        return ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
                "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "24", "--lr", "1e-3",
                "--lr-decay-iters", str(self.train_iters), "--mock-data", "--train-iters", str(self.train_iters),
                "--save", str(self.save), "--save-interval", str(self.save_interval), "--log-interval", "1",
                "--hetu-straggler-interval", "100000", "--hetu-emulate-layer-ms", str(self.layer_ms),
                "--hetu-hang-timeout", str(self.hang_timeout), "--distributed-timeout-minutes", "2",
                "--hetu-ckpt-keep", "100"]  # the reference resumes from the checkpoint a recovery loaded


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(workdir: Path) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", TMPDIR=str(workdir),
               TORCHINDUCTOR_CACHE_DIR=str(workdir / "inductor"), PYTHONUNBUFFERED="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


@dataclass
class Cluster:
    """The store process and the node launchers of one job (each launcher its own process group)."""

    job: Job
    port: int
    rdzv_id: str
    train: list[str] | None = None
    store: subprocess.Popen | None = None
    nodes: dict[str, subprocess.Popen] = field(default_factory=dict)

    def start_store(self) -> None:
        log = open(self.job.workdir / "store.log", "w")
        self.store = subprocess.Popen([sys.executable, str(ROOT / "launch" / "elastic.py"), "--serve-store",
                                       "--rdzv-endpoint", f"127.0.0.1:{self.port}"], stdout=log, stderr=log,
                                      env=_env(self.job.workdir), start_new_session=True)
        deadline = time.time() + 60
        while time.time() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.2)
        raise RuntimeError("the rendezvous store did not start; see store.log")

    def start_node(self, name: str, train: list[str] | None = None, nproc: int | None = None) -> None:
        log = open(self.job.workdir / f"{name}.log", "w")
        cmd = [sys.executable, str(ROOT / "launch" / "elastic.py"), "--nnodes", f"1:{self.job.max_nodes}",
               "--nproc-per-node", str(nproc or self.job.nproc), "--rdzv-endpoint", f"127.0.0.1:{self.port}",
               "--rdzv-id", self.rdzv_id, "--rdzv-conf", "is_host=false", "--max-restarts", "5", "--events", str(self.events_path(name)), "--",
               *(train or self.train or self.job.train_flags())]
        self.nodes[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(self.job.workdir),
                                            start_new_session=True)

    def events_path(self, name: str) -> Path:
        return self.job.workdir / f"events_{name}.jsonl"

    def events(self, name: str | None = None) -> list[dict]:
        names = [name] if name else list(self.nodes)
        out = []
        for n in names:
            path = self.events_path(n)
            if path.exists():
                out += [dict(json.loads(line), launcher=n) for line in path.read_text().splitlines() if line]
        return sorted(out, key=lambda e: e["time"])

    def kill_node(self, name: str) -> None:
        os.killpg(self.nodes[name].pid, signal.SIGKILL)
        self.nodes[name].wait()

    def wait(self, timeout: float) -> dict[str, int | None]:
        deadline = time.time() + timeout
        for proc in self.nodes.values():
            try:
                proc.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
        return {name: proc.poll() for name, proc in self.nodes.items()}

    def close(self) -> None:
        for proc in [*self.nodes.values(), self.store]:
            if proc is not None and proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()


def metrics(save: Path) -> list[dict]:
    path = save / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def wait_for_iteration(save: Path, iteration: int, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if any(r.get("kind") == "step" and r["iteration"] >= iteration for r in metrics(save)):
            return
        time.sleep(0.05)
    raise RuntimeError(f"the job did not reach iteration {iteration} in {timeout} s")


def rank_pid(cluster: Cluster, node: str, local_rank: int) -> int:
    started = [e for e in cluster.events(node) if e["event"] == "workers_started"]
    return started[-1]["pids"][local_rank]


def inject(cluster: Cluster, scenario: str) -> tuple[float, float]:
    """Cause the scenario's failure now; (time of the failure, time recovery is measured from)."""
    now = time.time()
    if scenario == "rank":
        os.kill(rank_pid(cluster, "node1", 1), signal.SIGKILL)
    elif scenario == "node":
        cluster.kill_node("node2")
    elif scenario == "hang":
        os.kill(rank_pid(cluster, "node1", 0), signal.SIGSTOP)
        return now, now + cluster.job.hang_timeout
    elif scenario == "spare":  # measured from when the new node is ready to join (its launcher's start-up aside)
        cluster.start_node("node3")
        deadline = time.time() + 120
        while not (ready := [e for e in cluster.events("node3") if e["event"] == "rendezvous_start"]):
            if time.time() > deadline:
                raise RuntimeError("the spare node's launcher did not reach the rendezvous in 120 s")
            time.sleep(0.05)
        return ready[0]["time"], ready[0]["time"]
    elif scenario == "rank0":
        rounds = [e for e in cluster.events() if e["event"] == "rendezvous" and e["group_rank"] == 0]
        cluster.kill_node(rounds[-1]["launcher"])
    else:
        raise ValueError(f"unknown scenario {scenario!r}; choose from {', '.join(SCENARIOS)}")
    return now, now


def final_history(records: list[dict]) -> dict[int, dict]:
    """Iteration -> the last step record written for it (a recovery retrains the steps after its checkpoint)."""
    history: dict[int, dict] = {}
    for r in records:
        if r.get("kind") == "step":
            history[r["iteration"]] = r
    return history


def recovery_split(cluster: Cluster, records: list[dict], failed_at: float, t0: float) -> dict:
    """The recovery's phases (seconds) from the launchers' events and the metrics records after ``failed_at``."""
    after = [e for e in cluster.events() if e["time"] >= failed_at]
    noticed = [e["time"] for e in after if e["event"] in ("failure", "rendezvous_start")
               and e["launcher"] != "node3"]  # the spare's own arrival is not the others noticing it
    loads = [r for r in records if r.get("event") == "checkpoint_load" and r["time"] >= failed_at]
    if not noticed or not loads:
        return {"recovered": False}
    load = loads[-1]
    load_start = load["time"] - load["blocking_s"]
    joined = [e["time"] for e in after if e["event"] == "rendezvous" and e["time"] <= load_start]
    planned = [e["time"] for e in after if e["event"] == "plan" and e["time"] <= load_start]
    first_step = next(r for r in records if r.get("kind") == "step" and r["time"] > load["time"])
    detect = min(noticed)
    return {"recovered": True, "detect_s": detect - t0, "rendezvous_s": max(joined) - detect,
            "plan_s": max(planned) - max(joined), "start_s": load_start - max(planned),
            "load_s": load["blocking_s"], "total_s": first_step["time"] - t0,
            "resumed_at": load["iteration"], "ranks_after": first_step["ranks"]}


def reference_losses(job: Job, cluster: Cluster, resumed_at: int, out: Path) -> dict[int, float]:
    """An uninterrupted run of the last round's plan from the checkpoint it loaded (a fresh launch)."""
    plans = [e for e in cluster.events() if e["event"] == "plan"]
    out.mkdir(parents=True, exist_ok=True)
    plan = out / "plan.yaml"
    from hetu_ext.plan import dump_plan, plan_from_dict

    plan.write_text(dump_plan(plan_from_dict(plans[-1]["plan"])))
    ckpt = out / "ckpt"
    shutil.copytree(job.save / f"iter_{resumed_at:07d}", ckpt / f"iter_{resumed_at:07d}")
    (ckpt / "latest_checkpointed_iteration.txt").write_text(str(resumed_at))
    flags = job.train_flags()
    keep = []
    skip = False
    for token in flags:  # no --save / --save-interval: the reference only trains
        if skip:
            skip = False
        elif token in ("--save", "--save-interval"):
            skip = True
        else:
            keep.append(token)
    world = plan_from_dict(plans[-1]["plan"]).world_size
    cmd = [sys.executable, str(ROOT / "launch" / "pretrain_gpt.py"), "--nproc-per-node", str(world), *keep,
           "--hetu-plan", str(plan), "--load", str(ckpt), "--hetu-metrics-file", str(out / "metrics.jsonl")]
    with open(out / "reference.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(job.workdir), timeout=600).returncode
    if rc != 0:
        raise RuntimeError(f"the reference run failed (exit {rc}); see {out / 'reference.log'}")
    return {i: r["loss"] for i, r in final_history(metrics(out)).items()}


def run_scenario(scenario: str, workdir: Path, *, inject_at: int = 7, timeout: float = 300,
                 train_iters: int = 30) -> dict:
    """One job of 3 nodes x 2 ranks with the scenario's failure at ``inject_at``; its row of the table."""
    job = Job(workdir=workdir, train_iters=train_iters * (2 if scenario == "spare" else 1))  # the spare's launcher
    # starts (imports) while the job trains on: a longer job is still running when it joins
    workdir.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(job=job, port=free_port(), rdzv_id=f"rehearsal-{scenario}")
    try:
        cluster.start_store()
        for n in range(job.nodes):
            cluster.start_node(f"node{n}")
        wait_for_iteration(job.save, 2 if scenario == "spare" else inject_at, timeout)
        failed_at, t0 = inject(cluster, scenario)
        codes = cluster.wait(timeout)
        survivors = {n: c for n, c in codes.items() if not (scenario in ("node", "rank0") and c == -9)}
        records = metrics(job.save)
        row = {"name": scenario, "exit_codes": survivors}
        row |= recovery_split(cluster, records, failed_at, t0)
        history = final_history(records)
        gbs = 24  # --global-batch-size
        row["samples_lost"] = sum(gbs - history[i]["samples"] if i in history else gbs
                                  for i in range(1, job.train_iters + 1))
        row["finished"] = all(c == 0 for c in survivors.values()) and max(history, default=0) == job.train_iters
        if row.get("recovered"):
            reference = reference_losses(job, cluster, row["resumed_at"], workdir / "reference")
            diffs = [abs(history[i]["loss"] - reference[i]) / abs(reference[i]) for i in reference]
            row["loss_max_rel_diff"] = max(diffs) if diffs else None
            row["losses_equal"] = bool(diffs) and max(diffs) <= LOSS_RTOL and \
                sorted(reference) == list(range(row["resumed_at"] + 1, job.train_iters + 1))
        row["recovered"] = bool(row.get("recovered") and row["finished"] and row.get("losses_equal")
                                and row["samples_lost"] == 0)
        return row
    finally:
        cluster.close()


COLUMNS = ("name", "recovered", "ranks_after", "detect_s", "rendezvous_s", "plan_s", "start_s", "load_s", "total_s",
           "samples_lost")


def table(rows: list[dict]) -> str:
    def cell(value) -> str:
        return f"{value:.2f}" if isinstance(value, float) else str(value)

    scenarios = Table.of(*((c, ">12") for c in COLUMNS + ("loss_rel_diff",)), sep="  ")
    cells = [[cell(row.get(c)) for c in COLUMNS + ("loss_max_rel_diff",)] for row in rows]
    return "\n".join([scenarios.header(), *map(scenarios.row, cells)])


def _torch_version() -> str:
    from importlib.metadata import version

    return version("torch")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--out", default=None, help="also write the report to this file")
    parser.add_argument("--keep", default=None, help="keep the jobs' files in this directory")
    args = parser.parse_args()
    scenarios = [s for s in args.scenarios.split(",") if s]
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        print(f"benchmarks.elastic: error: unknown scenario(s) {unknown}; choose from {', '.join(SCENARIOS)}",
              file=sys.stderr)
        return 2
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="elastic_rehearsal_"))
    job = Job(workdir=base)
    header = (f"# Elastor rehearsal: {job.nodes} node launchers x {job.nproc} CPU ranks on the loopback, store on "
              f"its own process; {job.train_iters} iterations, save every {job.save_interval}, layer "
              f"{job.layer_ms} ms emulated, --hetu-hang-timeout {job.hang_timeout} s; {os.cpu_count()} cores, "
              f"python {sys.version.split()[0]}, torch {_torch_version()}, load average at start "
              f"{' '.join(Path('/proc/loadavg').read_text().split()[:3])}, "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(header, flush=True)
    rows = []
    for scenario in scenarios:
        start = time.time()
        if scenario == "deepspeed":
            from benchmarks import deepspeed_elastic

            rows.append(deepspeed_elastic.run(base / scenario))
        else:
            rows.append(run_scenario(scenario, base / scenario))
        print(f"# {scenario}: {time.time() - start:.0f} s wall, {json.dumps(rows[-1])}", flush=True)
    report = "\n".join([header, table(rows), result_line({"scenarios": [{c: r.get(c) for c in COLUMNS}
                                                                           for r in rows]})])
    print(table(rows))
    print(report.splitlines()[-1])
    if args.out:
        Path(args.out).write_text(report + "\n")
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    return 0 if all(r["recovered"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
