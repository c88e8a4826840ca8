"""Train Megatron-core's GPTModel (TP 1, PP 1) with DeepSpeed ZeRO-1/2/3 and save DeepSpeed checkpoints that
``launch/pretrain_gpt.py --load DIR`` loads into any hetu_ext plan. Megatron-LM's flag names plus
``--zero-stage`` and ``--deepspeed-config``; on a machine without CUDA it runs on CPU (gloo, DS_ACCELERATOR=cpu).

    torchrun --nproc-per-node 2 launch/pretrain_gpt_deepspeed.py --zero-stage 2 --num-layers 4 \
        --hidden-size 64 --num-attention-heads 4 --seq-length 128 --micro-batch-size 2 --global-batch-size 8 \
        --train-iters 20 --lr 1e-3 --mock-data --save /tmp/ds_ckpt
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 launch/pretrain_gpt_deepspeed.py ...   # the same flags, on CPU
"""

import json
import logging
import os
import sys
import warnings
from pathlib import Path

from hetu_ext.deepspeed.engine import (
    ZeroConfig,
    add_deepspeed_args,
    build,
    deepspeed_config,
)
from hetu_ext.megatron.args import build_parser, validate_args


def main(argv: list[str] | None = None) -> int:
    parser = add_deepspeed_args(build_parser("pretrain_gpt_deepspeed.py"))
    args = parser.parse_args(argv)
    try:
        validate_args(args)
        extra = json.loads(Path(args.deepspeed_config).read_text()) if args.deepspeed_config else {}
        zero = ZeroConfig(stage=args.zero_stage, extra=extra)
        deepspeed_config(args, zero, int(os.environ.get("WORLD_SIZE", "1")))  # contradictions fail before launch
    except (ValueError, OSError) as exc:
        parser.error(str(exc))  # one line, exit code 2
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[%(asctime)s] [rank {rank}] %(name)s: %(message)s")
    for name in ("megatron", "DeepSpeed", "deepspeed"):
        logging.getLogger(name).setLevel(logging.WARNING)
    for category in (UserWarning, DeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category)
    from hetu_ext.megatron import host

    try:
        run = build(args, zero)
    except ValueError as exc:
        if rank == 0:
            print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        host.shutdown()
        return 2
    try:
        run.train()
        if args.save:
            tag = run.save(args.save)
            if rank == 0:
                print(f"saved DeepSpeed ZeRO-{zero.stage} checkpoint {args.save}/{tag}", flush=True)
    finally:
        host.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
