"""The DeepSpeed scenario of benchmarks/elastic.py: a rank lost from a ZeRO-3 bf16 job under
``launch/elastic.py --launcher deepspeed``.

One node launcher starts 4 CPU ranks of launch/pretrain_gpt_deepspeed.py (ZeRO-3, --bf16, a DeepSpeed checkpoint
every 4 steps); as soon as the first checkpoint is complete (``latest`` written) rank 3's process is killed
(SIGKILL, as a lost GPU's would be); the launcher restarts the job on the 3 ranks left with ``--load`` of the
``--save`` directory, and it trains to the end. What a row reports, from the launcher's events and rank 0's log:
detect (the kill to the launcher's failure event), plan (to its plan of 3 ranks), start (to the ranks started),
load (the in-process load at the new world size, as rank 0 prints it), total (the kill to the first step logged
on 3 ranks: its log line's time, to the second). The recovered steps' losses are compared with a fresh 3-rank job
resuming the same checkpoint (``--ckpt-step``): the same ranks, state and samples, so the printed losses must be
equal; ``samples_lost`` counts global batches of the final history that no round trained.

    python -m benchmarks.elastic --scenarios deepspeed   # or python -m benchmarks.deepspeed_elastic
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import ROOT

STEPS, SAVE_INTERVAL, GLOBAL_BATCH, RANKS = 12, 4, 12, 4

FLAGS = ["--zero-stage", "3", "--bf16", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "64", "--micro-batch-size", "1", "--global-batch-size", str(GLOBAL_BATCH), "--lr", "1e-3",
         "--lr-decay-iters", str(STEPS), "--mock-data", "--train-iters", str(STEPS), "--log-interval", "1",
         "--distributed-timeout-minutes", "0.5"]

_LINE = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\] iteration +(\d+)/ +\d+ .*?lm loss: (\S+)")


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONWARNINGS="ignore")


def _log_steps(text: str) -> list[tuple[float, int, str]]:
    """(time, iteration, printed loss) of every Megatron-LM log line, in order."""
    out = []
    for m in _LINE.finditer(text):
        stamp = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S"))
        out.append((stamp, int(m.group(2)), m.group(3)))
    return out


def _reference(workdir: Path, save: Path, resumed_at: int, timeout: float) -> dict[int, str]:
    """The printed losses of a fresh 3-rank job resuming step ``resumed_at``'s checkpoint."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS - 1),
           str(ROOT / "launch" / "pretrain_gpt_deepspeed.py"), *FLAGS, "--load", str(save), "--ckpt-step",
           str(resumed_at)]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout, cwd=workdir)
    if proc.returncode:
        raise RuntimeError(f"the reference job failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return {it: loss for _, it, loss in _log_steps(proc.stdout)}


def run(workdir: Path, *, timeout: float = 300) -> dict:
    """The scenario's row (the columns of benchmarks/elastic.py)."""
    workdir.mkdir(parents=True, exist_ok=True)
    save, events, log = workdir / "ckpt", workdir / "events.jsonl", workdir / "job.log"
    cmd = [sys.executable, str(ROOT / "launch" / "elastic.py"), "--launcher", "deepspeed", "--nproc-per-node",
           str(RANKS), "--max-restarts", "1", "--events", str(events), "--", *FLAGS, "--save", str(save),
           "--save-interval", str(SAVE_INTERVAL)]
    with open(log, "w") as out:
        job = subprocess.Popen(cmd, env=_env(), stdout=out, stderr=subprocess.STDOUT, cwd=workdir)
        deadline = time.time() + timeout
        while not (save / "latest").exists() and job.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        started = [json.loads(line) for line in events.read_text().splitlines() if '"workers_started"' in line]
        killed_at = time.time()
        os.kill(started[-1]["pids"][RANKS - 1], signal.SIGKILL)
        code = job.wait(timeout=max(1.0, deadline - time.time()))
    text = log.read_text()
    records = [json.loads(line) for line in events.read_text().splitlines()]
    failure = next((r for r in records if r["event"] == "failure"), None)
    plan = next((r for r in records if r["event"] == "plan" and r.get("world") == RANKS - 1), None)
    restarted = [r for r in records if r["event"] == "workers_started"][1:]
    resumed = re.search(r"resumed from deepspeed checkpoint \S+global_step(\d+) .* in ([\d.]+) s", text)
    cut = resumed.start() if resumed else len(text)
    steps, second = _log_steps(text[:cut]), _log_steps(text[cut:])  # the rounds before and after the restart
    row = {"name": "deepspeed", "exit_codes": {"node0": code}, "ranks_after": plan["world"] if plan else None,
           "detect_s": failure["time"] - killed_at if failure else None,
           "plan_s": plan["time"] - failure["time"] if plan and failure else None,
           "start_s": restarted[0]["time"] - plan["time"] if restarted and plan else None,
           "load_s": float(resumed.group(2)) if resumed else None, "rendezvous_s": None}
    if not resumed:
        return {**row, "recovered": False}
    resumed_at = int(resumed.group(1))
    history = {it: loss for _, it, loss in steps if it <= resumed_at} | {it: loss for _, it, loss in second}
    row["total_s"] = second[0][0] - killed_at if second else None  # the log's clock: to the second
    row["samples_lost"] = GLOBAL_BATCH * sum(1 for it in range(1, STEPS + 1) if it not in history)
    reference = _reference(workdir, save, resumed_at, timeout)
    diffs = [abs(float(history[it]) - float(v)) / abs(float(v)) for it, v in reference.items() if it in history]
    row["loss_max_rel_diff"] = max(diffs) if diffs else None
    row["recovered"] = bool(code == 0 and diffs and max(diffs) == 0.0 and row["samples_lost"] == 0
                            and sorted(reference) == list(range(resumed_at + 1, STEPS + 1)))
    return row


def main() -> None:
    """``python -m benchmarks.deepspeed_elastic``: the scenario alone, as benchmarks/elastic.py prints it."""
    import tempfile

    from benchmarks.common import print_result
    from benchmarks.elastic import table

    with tempfile.TemporaryDirectory(prefix="ds_elastic_") as tmp:
        row = run(Path(tmp) / "deepspeed")
    print(f"# DeepSpeed ZeRO-3 bf16, {RANKS} CPU ranks, rank {RANKS - 1} killed after the first checkpoint; load "
          f"average {os.getloadavg()[0]:.1f}")
    print(table([row]))
    print_result(row)


if __name__ == "__main__":
    main()
