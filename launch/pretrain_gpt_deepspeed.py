"""Train Megatron-core's GPTModel (TP 1, PP 1) with DeepSpeed ZeRO-1/2/3: resume at any world size, straggler-weighted
microbatches and length-aware packing (ZeRO-1), DeepSpeed or hetu checkpoints (docs/deepspeed.md). Megatron-LM's
flag names plus ``--zero-stage``, ``--deepspeed-config`` and ``--hetu-microbatches``; on a machine without CUDA it
runs on CPU (gloo, DS_ACCELERATOR=cpu).

    torchrun --nproc-per-node 4 launch/pretrain_gpt_deepspeed.py --zero-stage 2 --num-layers 4 \
        --hidden-size 64 --num-attention-heads 4 --seq-length 128 --micro-batch-size 1 --global-batch-size 12 \
        --train-iters 20 --lr 1e-3 --mock-data --save /tmp/ds_ckpt --save-interval 5
    torchrun --nproc-per-node 3 launch/pretrain_gpt_deepspeed.py ... --load /tmp/ds_ckpt   # the same flags, 3 ranks
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 launch/pretrain_gpt_deepspeed.py ...        # DeepSpeed's launcher
    python launch/pretrain_gpt_deepspeed.py ...                                           # one rank, no launcher

``--load DIR`` takes a DeepSpeed ZeRO checkpoint (``DIR/latest``) or a hetu one, saved on any number of ranks, in
process; ``--save DIR`` writes DeepSpeed's format (``--hetu-ckpt-format auto``) or hetu's (``hetu``: asynchronous,
atomic, ``--hetu-ckpt-keep`` retention), every ``--save-interval`` steps and at the end. ``--load DIR --save DIR``
continues in place, so a supervisor that restarts the job on the ranks left (launch/elastic.py) resumes from the
newest checkpoint at the new world size. Bad input is one line and exit code 2. Rank 0 prints Megatron-LM's log
lines (every ``--log-interval`` steps), as launch/pretrain_gpt.py does.
"""

import json
import logging
import os
import socket
import sys
from pathlib import Path

from hetu_ext.config import build_parser, from_namespace, parse_namespace
from hetu_ext.config.parse import report_error
from hetu_ext.deepspeed.engine import (
    ZeroConfig,
    add_deepspeed_args,
    build,
    check_supported,
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
        config = from_namespace(args)
        check_supported(config)
        zero = ZeroConfig(stage=args.zero_stage, extra=extra, microbatches=args.hetu_microbatches,
                          straggler_interval=config.straggler.interval, packing=config.packing.method)
        deepspeed_config(config, zero, int(os.environ.get("WORLD_SIZE", "1")))  # contradictions fail before launch
        if args.load and not Path(args.load).is_dir():
            raise ValueError(f"--load {args.load}: no such directory; give the --save directory of the run to resume")
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
        loaded = run.load(args.load) if args.load else None
        saver = _saver(run, args, loaded)
    except ValueError as exc:  # bad input found with the process group up (CheckpointError: the same on all)
        report_error(parser.prog, str(exc))  # rank 0 prints; the others wait so that torchrun lets it
        host.shutdown()
        return 2
    try:
        if loaded is not None and rank == 0:
            print(f"resumed from {loaded.source} checkpoint {loaded.path} (saved on {loaded.saved_world_size} "
                  f"rank(s)) at iteration {loaded.iteration} on {world} rank(s) in {loaded.seconds:.2f} s", flush=True)
        interval = config.checkpoint.save_interval
        end = config.training.train_iters

        def periodic(iteration: int) -> None:
            if saver is not None and interval and iteration % interval == 0 and iteration < end:
                saver(blocking=False)

        run.train(log=lambda line: print(line, flush=True), after_step=periodic)
        if saver is not None:
            saver(blocking=True)
    finally:
        host.shutdown()
    return 0


def _saver(run, args, loaded):
    """A function saving in the format of --hetu-ckpt-format (``blocking``: the last save), or None."""
    if not args.save:
        return None
    if run.config.checkpoint.format == "hetu":
        from hetu_ext.deepspeed.engine_save import HetuSaver

        resumed_here = bool(args.load) and os.path.abspath(args.load) == os.path.abspath(args.save)
        hetu = HetuSaver(run, args.save, loaded_run_id=loaded.run_id if loaded else None, resumed_here=resumed_here)

        def save_hetu(blocking: bool) -> None:
            hetu.save(blocking=blocking)
            if blocking:
                hetu.wait()
                _say(f"saved hetu checkpoint {args.save} iteration {run.iteration}")

        return save_hetu

    def save_deepspeed(blocking: bool) -> None:
        tag = run.save(args.save)
        _say(f"saved DeepSpeed ZeRO-{run.engine.zero_optimization_stage()} checkpoint {args.save}/{tag}")

    return save_deepspeed


def _say(line: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(line, flush=True)


def _single_rank_env() -> None:
    """The environment torchrun would give one rank."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})


if __name__ == "__main__":
    sys.exit(main())
