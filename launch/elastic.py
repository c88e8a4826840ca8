"""Elastic restart after partial GPU loss (Elastor): run pretrain_gpt.py under torchrun; when the job fails, plan
over the GPUs that are left and resume from the newest complete checkpoint.

    python launch/elastic.py --nproc-per-node 8 --gpus-per-node 8 --max-restarts 3 -- \\
        --num-layers 32 ... --save ckpt --save-interval 100      # pretrain_gpt.py's flags after "--"

Each attempt runs ``torchrun --standalone --nproc-per-node N launch/pretrain_gpt.py ...``. A rank that dies (or
hangs past ``--distributed-timeout-minutes``) fails its collectives, torchrun stops the job, and this launcher:

1. counts the healthy devices: the output of ``--healthy-devices-cmd`` (an integer), else, with CUDA, the devices
   on which a fresh process can allocate memory, else (CPU emulation) one fewer than before;
2. makes a Malleus plan for them (``gpus_per_node`` per node, the last node short: a node may lose only some
   GPUs), written next to the checkpoints;
3. relaunches with ``--hetu-plan`` that plan and ``--load`` the ``--save`` directory. The checkpoint loads into
   any plan, and the data position is the iteration, so no sample is skipped or repeated (the global batch stays
   the same: the plan's microbatch counts add up to it).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_DROP = {"--hetu-plan": 1, "--load": 1, "--tensor-model-parallel-size": 1, "--pipeline-model-parallel-size": 1}


def restart_argv(argv: list[str], *, plan_path: str) -> list[str]:
    """pretrain_gpt.py's flags for a restart: the new plan instead of any plan or TP/PP flags, --load = --save."""
    out, skip, save = [], 0, None
    for i, arg in enumerate(argv):
        if skip:
            skip -= 1
            continue
        if arg in _DROP:
            skip = _DROP[arg]
            continue
        if arg == "--save":
            save = argv[i + 1]
        out.append(arg)
    if save is None:
        raise ValueError("elastic restarts need --save DIR (the checkpoints to resume from); add it with "
                         "--save-interval N")
    return out + ["--hetu-plan", plan_path, "--load", save]


def plan_for(argv: list[str], world_size: int, gpus_per_node: int) -> str:
    """A Malleus plan (YAML) of the model in ``argv`` over ``world_size`` healthy ranks."""
    from hetu_ext.megatron.args import build_parser
    from hetu_ext.megatron.data import make_tokenizer
    from hetu_ext.megatron.trainer import model_spec_from_args
    from hetu_ext.plan import dump_plan
    from hetu_ext.plan.cluster import Cluster
    from hetu_ext.plan.malleus import plan_malleus

    args = build_parser().parse_args(argv)
    if not args.global_batch_size or args.global_batch_size % args.micro_batch_size:
        raise ValueError(f"elastic restarts keep the global batch: give --global-batch-size (a multiple of "
                         f"--micro-batch-size {args.micro_batch_size}), got {args.global_batch_size}")
    spec = model_spec_from_args(args, make_tokenizer(args.tokenizer_type, args.vocab_size).vocab_size)
    cluster = Cluster(world_size=world_size, gpus_per_node=gpus_per_node, gpu_memory_bytes=80 * 2**30)
    planned = plan_malleus(cluster, spec, micro_batch=args.micro_batch_size,
                           num_microbatches=args.global_batch_size // args.micro_batch_size)
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


def main(argv: list[str] | None = None) -> int:
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
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
               str(ROOT / "launch" / "pretrain_gpt.py"), *train]
        print(f"elastic: attempt {attempt} on {world} ranks", file=sys.stderr, flush=True)
        if subprocess.call(cmd) == 0:
            return 0
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
