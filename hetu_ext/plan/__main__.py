"""``python -m hetu_ext.plan show FILE [--num-layers N ...]``: print a plan as a table, after validating it."""

from __future__ import annotations

import argparse
import sys

from .io import format_plan, load_plan
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
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
