"""``python -m hetu_ext.plan show FILE``: print a plan as a table, after validating it.
``python -m hetu_ext.plan malleus ...``: plan around stragglers (Malleus) and write the plan as YAML."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .cluster import Cluster
from .io import dump_plan, format_plan, load_plan
from .malleus import plan_malleus
from .model_spec import ModelSpec
from .plan import PlanError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hetu_ext.plan", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show", help="print a plan file as a table of stages and of each rank's layers")
    show.add_argument("file")
    show.add_argument("--world-size", type=int, default=None, help="also check the plan covers exactly these ranks")
    show.add_argument("--num-layers", type=int, default=None, help="also check against this model shape")
    show.add_argument("--hidden-size", type=int, default=None)
    show.add_argument("--num-attention-heads", type=int, default=None)
    show.add_argument("--ffn-hidden-size", type=int, default=None)
    mal = sub.add_parser("malleus", help="plan around stragglers and write the plan (YAML) for --hetu-plan")
    mal.add_argument("--world-size", type=int, required=True)
    mal.add_argument("--gpus-per-node", type=int, default=8)
    mal.add_argument("--gpu-memory-gib", type=float, default=80.0)
    mal.add_argument("--slowdown", action="append", default=[], metavar="RANK=X",
                     help="a straggler's slowdown (repeatable), e.g. --slowdown 3=5.0")
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length", "--micro-batch-size",
                 "--global-batch-size"):
        mal.add_argument(flag, type=int, required=True)
    mal.add_argument("--ffn-hidden-size", type=int, default=None)
    mal.add_argument("--vocab-size", type=int, default=50257)
    mal.add_argument("--output", "-o", default=None, help="write the plan here (default: print only)")
    args = parser.parse_args(argv)
    if args.command == "malleus":
        return _malleus(args, parser)
    try:
        plan = load_plan(args.file)
        model = None
        if args.num_layers is not None:
            heads = args.num_attention_heads or 1
            model = ModelSpec(num_layers=args.num_layers, hidden_size=args.hidden_size or heads,
                              num_attention_heads=heads, ffn_hidden_size=args.ffn_hidden_size)
        plan.validate(model, args.world_size)
    except (PlanError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_plan(plan))
    return 0


def _malleus(args, parser) -> int:
    try:
        slowdowns = {}
        for item in args.slowdown:
            rank, _, x = item.partition("=")
            if not rank.isdigit() or not x:
                raise ValueError(f"--slowdown {item!r}: expected RANK=X, e.g. 3=5.0")
            slowdowns[int(rank)] = float(x)
        spec = ModelSpec(num_layers=args.num_layers, hidden_size=args.hidden_size,
                         num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
                         vocab_size=args.vocab_size, seq_length=args.seq_length)
        cluster = Cluster(world_size=args.world_size, gpus_per_node=args.gpus_per_node,
                          gpu_memory_bytes=int(args.gpu_memory_gib * 2**30), slowdowns=slowdowns)
        if args.global_batch_size % args.micro_batch_size:
            raise ValueError(f"--global-batch-size {args.global_batch_size} must be a multiple of "
                             f"--micro-batch-size {args.micro_batch_size}")
        planned = plan_malleus(cluster, spec, micro_batch=args.micro_batch_size,
                               num_microbatches=args.global_batch_size // args.micro_batch_size)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_plan(planned.plan))
    print(f"\npredicted step time {planned.predicted_step_s:.4g} s ({planned.template})")
    if args.output:
        Path(args.output).write_text(dump_plan(planned.plan))
        print(f"wrote {args.output} (train with --hetu-plan {args.output})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
