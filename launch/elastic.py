"""Elastic restart after partial GPU loss (Elastor): run pretrain_gpt.py (or, ``--launcher deepspeed``,
pretrain_gpt_deepspeed.py); when the job fails, lay it out over the GPUs that are left and resume from the newest
complete checkpoint.

Across nodes (one launcher per node, membership by torch's c10d rendezvous; hetu_ext/elastic/agent.py, docs/elastic.md):

    python launch/elastic.py --nnodes 1:4 --nproc-per-node 8 --rdzv-endpoint HOST:PORT --rdzv-id job1 -- \\
        --num-layers 32 ... --save ckpt --save-interval 100 --hetu-hang-timeout 120

    python launch/elastic.py --serve-store --rdzv-endpoint HOST:PORT   # the store on a node that trains nothing

A DeepSpeed job (launch/pretrain_gpt_deepspeed.py's flags after "--"; every healthy device a data-parallel rank,
the engine's own checkpoint loaded at the new world size; docs/deepspeed.md). Without --nnodes it runs on this
node alone, the rendezvous store inside this launcher on a free loopback port:

    python launch/elastic.py --launcher deepspeed --nproc-per-node 8 -- \\
        --zero-stage 2 --num-layers 32 ... --save ckpt --save-interval 100

Single node, hetu_ext's trainer (no --nnodes, no --launcher):

    python launch/elastic.py --nproc-per-node 8 --gpus-per-node 8 --max-restarts 3 -- \\
        --num-layers 32 ... --save ckpt --save-interval 100      # pretrain_gpt.py's flags after "--"

Each attempt runs ``python launch/pretrain_gpt.py --nproc-per-node N ...`` (torchrun's agent, in that launcher).
A rank that dies (or hangs past ``--distributed-timeout-minutes``) fails its collectives, torchrun stops the job,
and this launcher:

1. counts the healthy devices: the output of ``--healthy-devices-cmd`` (an integer), else, with CUDA, the devices
   on which a fresh process can allocate memory, else (CPU emulation) one fewer than before;
2. makes a Malleus plan for them (``gpus_per_node`` per node, the last node short: a node may lose only some
   GPUs), written next to the checkpoints;
3. relaunches with ``--hetu-plan`` that plan and ``--load`` the ``--save`` directory. The checkpoint loads into
   any plan, and the data position is the iteration, so no sample is skipped or repeated (the global batch stays
   the same: the plan's microbatch counts add up to it).

Not every failure is a lost device. A configuration error (exit code 2: a bad flag, value, file or plan, reported
in one line by pretrain_gpt.py's launcher or a rank) and a failure identical on every rank before the first step
(the same exception line from each rank, no step logged) would fail again on any number of ranks: the launcher
stops with that error and its exit code, writes no plan and does not restart (:func:`failure_cause`).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import NamedTuple

from hetu_ext.elastic.argv import REPLACED, plan_inputs, restart_argv  # noqa: F401 (tests and callers use them from here)

ROOT = Path(__file__).resolve().parents[1]
def plan_for(argv: list[str], world_size: int, gpus_per_node: int) -> str:
    """A Malleus plan (YAML) of the model in ``argv`` over ``world_size`` healthy ranks."""
    from hetu_ext.plan import dump_plan
    from hetu_ext.plan.core.cluster import Cluster
    from hetu_ext.plan.malleus import plan_malleus

    spec, micro_batch, num_microbatches = plan_inputs(argv)  # the across-nodes agreement plans from the same
    cluster = Cluster(world_size=world_size, gpus_per_node=gpus_per_node, gpu_memory_bytes=80 * 2**30)
    planned = plan_malleus(cluster, spec, micro_batch=micro_batch, num_microbatches=num_microbatches)
    return dump_plan(planned.plan)


def healthy_devices(command: str | None, previous: int) -> int:
    if command:
        return int(subprocess.run(command, shell=True, check=True, capture_output=True, text=True).stdout.strip())
    import torch

    if not torch.cuda.is_available():
        return previous - 1  # CPU emulation: the rank that died is gone
    probe = "import torch,sys; torch.zeros(1, device=f'cuda:{sys.argv[1]}'); torch.cuda.synchronize()"
    return sum(subprocess.run([sys.executable, "-c", probe, str(d)], capture_output=True).returncode == 0
               for d in range(torch.cuda.device_count()))


CONFIG_ERROR = 2
"""pretrain_gpt.py's exit code for bad input (flags, files, plan): the same input fails on any ranks."""
STEP_LINE = re.compile(r"\biteration +\d+/ *\d+ \|")
EXCEPTION_LINE = re.compile(r"^(?:\[rank\d+\]: )?([A-Za-z_][\w.]*(?:Error|Exception|Interrupt)\b.*)$")
"""A traceback's last line, with or without torch.distributed's ``[rankN]: `` prefix."""


class Attempt(NamedTuple):
    """One run of the job: its exit code and what it printed (each stream's lines, as printed)."""

    returncode: int
    stdout: list[str]
    stderr: list[str]


def failure_cause(attempt: Attempt, world: int) -> str | None:
    """Why a failed attempt must not be restarted on fewer ranks, or None when it may be a lost device.

    Not a device loss: exit code 2 (a configuration error), or no step logged and one and the same exception
    line printed by each of the ``world`` ranks (every distinct exception line as often as every other, at
    least ``world`` times: chained exceptions repeat per rank too). A lost device kills one rank without a
    traceback, and the others fail in their collectives, so never every rank alike."""
    if attempt.returncode == CONFIG_ERROR:
        return "a configuration error (exit code 2)"
    if any(STEP_LINE.search(line) for line in attempt.stdout):
        return None
    counts = Counter(m.group(1) for line in attempt.stderr if (m := EXCEPTION_LINE.match(line)))
    if counts and min(counts.values()) >= world and len(set(counts.values())) == 1:
        last = [m.group(1) for line in attempt.stderr if (m := EXCEPTION_LINE.match(line))][-1]
        return f"every rank failed before its first step with the same error ({last})"
    return None


def run_attempt(cmd: list[str]) -> Attempt:
    """Run ``cmd``, passing its stdout and stderr through line by line, and keep both."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
    kept: dict[str, list[str]] = {"stdout": [], "stderr": []}

    def relay(stream, out, lines: list[str]) -> None:
        for line in stream:
            out.write(line)
            out.flush()
            lines.append(line.rstrip("\n"))

    threads = [threading.Thread(target=relay, args=(proc.stdout, sys.stdout, kept["stdout"]), daemon=True),
               threading.Thread(target=relay, args=(proc.stderr, sys.stderr, kept["stderr"]), daemon=True)]
    for t in threads:
        t.start()
    returncode = proc.wait()
    for t in threads:
        t.join()
    return Attempt(returncode, kept["stdout"], kept["stderr"])


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own = [token.split("=", 1)[0] for token in (argv[:argv.index("--")] if "--" in argv else argv)]
    if any(flag in ("--nnodes", "--rdzv-endpoint", "--serve-store", "--launcher") for flag in own):
        from hetu_ext.elastic.launcher import main as multinode_main  # across nodes: torch's rendezvous

        if "--rdzv-endpoint" not in own and "--serve-store" not in own:  # one node: a private loopback store
            argv = ["--nnodes", "1", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", *argv]
        return multinode_main(argv)
    from hetu_ext.hostlog import quiet_host_frameworks

    quiet_host_frameworks()  # planning imports Megatron-core (its Apex/TE warnings are no news on a restart)
    parser = argparse.ArgumentParser(prog="launch/elastic.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, default=8, help="for planning: GPUs per node")
    parser.add_argument("--max-restarts", type=int, default=3)
    parser.add_argument("--healthy-devices-cmd", default=None, help="prints how many devices are usable")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then pretrain_gpt.py's flags")
    args = parser.parse_args(argv)
    original = [a for a in args.train_args if a != "--"]
    train, world = original, args.nproc_per_node
    for attempt in range(args.max_restarts + 1):
        # pretrain_gpt.py as its own launcher: flags, files and plan are checked before any rank starts (exit 2,
        # one line), and a rank's exit 2 is the launcher's exit 2
        cmd = [sys.executable, str(ROOT / "launch" / "pretrain_gpt.py"), "--nproc-per-node", str(world), *train]
        print(f"elastic: attempt {attempt} on {world} ranks", file=sys.stderr, flush=True)
        result = run_attempt(cmd)
        if result.returncode == 0:
            return 0
        cause = failure_cause(result, world)
        if cause is not None:
            if result.returncode != CONFIG_ERROR:  # exit 2: the job printed its one error line; nothing to add
                print(f"elastic: not restarting: {cause}; not a lost device", file=sys.stderr)
            return result.returncode
        if attempt == args.max_restarts:
            break
        world = healthy_devices(args.healthy_devices_cmd, world)
        if world < 1:
            print("elastic: no healthy device left", file=sys.stderr)
            return 1
        try:
            train = restart_argv(original, plan_path="")
            plan = Path(train[-1]) / f"elastic_plan_{world}.yaml"  # next to the checkpoints (--load DIR)
            plan.parent.mkdir(parents=True, exist_ok=True)
            plan.write_text(plan_for(original, world, args.gpus_per_node))
            train = restart_argv(original, plan_path=str(plan))
        except ValueError as exc:
            parser.error(str(exc))
    print(f"elastic: giving up after {args.max_restarts} restarts", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
