"""Entry point behind ``launch/pretrain_gpt.py``: parse flags, train, turn bad input into exit code 2."""

from __future__ import annotations

import logging
import os
import sys
import warnings

from hetu_ext.plan import PlanError

from .args import build_parser, validate_args
from .config import apply_hetu_config


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        apply_hetu_config(args)
        validate_args(args)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))  # one line, exit code 2
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="[%(asctime)s] [rank %(rank)s] %(name)s: %(message)s".replace("%(rank)s", str(rank)))
    logging.getLogger("megatron").setLevel(logging.WARNING)  # its INFO lists every parameter and config field
    # Megatron-core warns at import about optional CUDA packages (Apex, Transformer Engine) and deprecations
    for category in (UserWarning, DeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category, module=r"megatron\..*")

    from . import host
    from .trainer import build_trainer

    try:
        trainer = build_trainer(args)
    except (PlanError, ValueError) as exc:
        if rank == 0:
            print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        host.shutdown()
        return 2
    try:
        trainer.train(log=lambda line: print(line, flush=True))
    finally:
        host.shutdown()
    return 0
