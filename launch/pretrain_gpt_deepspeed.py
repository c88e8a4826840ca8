"""Train Megatron-core's GPTModel (TP 1, PP 1) with DeepSpeed ZeRO-1/2/3 and save DeepSpeed checkpoints that
``launch/pretrain_gpt.py --load DIR`` loads into any hetu_ext plan. Megatron-LM's flag names plus
``--zero-stage`` and ``--deepspeed-config``; on a machine without CUDA it runs on CPU (gloo, DS_ACCELERATOR=cpu).

    torchrun --nproc-per-node 2 launch/pretrain_gpt_deepspeed.py --zero-stage 2 --num-layers 4 \
        --hidden-size 64 --num-attention-heads 4 --seq-length 128 --micro-batch-size 2 --global-batch-size 8 \
        --train-iters 20 --lr 1e-3 --mock-data --save /tmp/ds_ckpt
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 launch/pretrain_gpt_deepspeed.py ...   # the same flags, on CPU
    python launch/pretrain_gpt_deepspeed.py ...                                      # one rank, no launcher

Rank 0 prints Megatron-LM's log lines (every ``--log-interval`` steps), as launch/pretrain_gpt.py does.
"""

import json
import logging
import os
import socket
import sys
from pathlib import Path

from hetu_ext.config import build_parser, from_namespace, parse_namespace
from hetu_ext.deepspeed.engine import (
    ZeroConfig,
    add_deepspeed_args,
    build,
    deepspeed_config,
)
from hetu_ext.hostlog import quiet_host_frameworks
from hetu_ext.megatron.args import validate_args


def main(argv: list[str] | None = None) -> int:
    parser = add_deepspeed_args(build_parser("pretrain_gpt_deepspeed.py"))
    try:
        args = parse_namespace(argv, parser)
        validate_args(args)
        extra = json.loads(Path(args.deepspeed_config).read_text()) if args.deepspeed_config else {}
        zero = ZeroConfig(stage=args.zero_stage, extra=extra)
        config = from_namespace(args)
        deepspeed_config(config, zero, int(os.environ.get("WORLD_SIZE", "1")))  # contradictions fail before launch
    except (ValueError, OSError) as exc:
        parser.error(str(exc))  # one line, exit code 2
    if "RANK" not in os.environ:  # python launch/pretrain_gpt_deepspeed.py: one rank, in this process
        _single_rank_env()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[%(asctime)s] [rank {rank}] %(name)s: %(message)s")
    quiet_host_frameworks()
    from hetu_ext.megatron import host

    if rank == 0:
        print(f"DeepSpeed ZeRO-{zero.stage} on {world} rank(s): importing Megatron-core and DeepSpeed, building the "
              "model and the engine ...", flush=True)
    try:
        run = build(config, zero)
    except ValueError as exc:
        if rank == 0:
            print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        host.shutdown()
        return 2
    try:
        run.train(log=lambda line: print(line, flush=True))
        if args.save:
            tag = run.save(args.save)
            if rank == 0:
                print(f"saved DeepSpeed ZeRO-{zero.stage} checkpoint {args.save}/{tag}", flush=True)
    finally:
        host.shutdown()
    return 0


def _single_rank_env() -> None:
    """The environment torchrun would give one rank."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})


if __name__ == "__main__":
    sys.exit(main())
