"""``launch/pretrain_gpt_deepspeed.py``'s entry (and each rank's under ``launch/elastic.py --launcher deepspeed``):
flags checked, the engine built, ``--load`` resumed at this world size, trained, saved. Bad input is one line and
exit code 2, before the process group where the flags suffice."""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
from pathlib import Path

from hetu_ext.config import RunConfig, build_parser, from_namespace, parse_namespace
from hetu_ext.config.parse import report_error
from hetu_ext.deepspeed.config import (
    ZeroConfig,
    add_deepspeed_args,
    check_supported,
    deepspeed_config,
)

PROG = "pretrain_gpt_deepspeed.py"


def flag_parser() -> argparse.ArgumentParser:
    """Megatron-LM's flag names, hetu_ext's, and the DeepSpeed path's (``--zero-stage`` ...)."""
    return add_deepspeed_args(build_parser(PROG))


def check_flags(argv: list[str] | None, world_size: int,
                parser: argparse.ArgumentParser | None = None) -> tuple[argparse.Namespace, RunConfig, ZeroConfig]:
    """The flags parsed and checked against ``world_size`` ranks with no process group: (flags, settings, ZeRO
    settings); ValueError / OSError with the one-line message (a bad flag exits 2 in the parser itself)."""
    from hetu_ext.cli.args import validate_args

    args = parse_namespace(argv, parser or flag_parser())
    validate_args(args)
    extra = json.loads(Path(args.deepspeed_config).read_text()) if args.deepspeed_config else {}
    config = from_namespace(args)
    check_supported(config)
    zero = ZeroConfig(stage=args.zero_stage, extra=extra, microbatches=args.hetu_microbatches,
                      straggler_interval=config.straggler.interval, packing=config.packing.method)
    deepspeed_config(config, zero, world_size)  # contradictions fail before launch
    if args.ckpt_step is not None and not args.load:
        raise ValueError(f"--ckpt-step {args.ckpt_step} names a checkpoint to resume from: add --load DIR (the --save "
                         "directory of the run that saved it) or drop --ckpt-step")
    if args.load and not Path(args.load).is_dir():
        raise ValueError(f"--load {args.load}: no such directory; give the --save directory of the run to resume")
    return args, config, zero


def main(argv: list[str] | None = None) -> int:
    parser = flag_parser()
    try:
        args, config, zero = check_flags(argv, int(os.environ.get("WORLD_SIZE", "1")), parser)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))  # one line, exit code 2
    if "RANK" not in os.environ:  # python launch/pretrain_gpt_deepspeed.py: one rank, in this process
        _single_rank_env()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[%(asctime)s] [rank {rank}] %(name)s: %(message)s")
    from hetu_ext.hostlog import quiet_host_frameworks

    quiet_host_frameworks()
    from hetu_ext.deepspeed.engine import build
    from hetu_ext.megatron import host

    if rank == 0:
        print(f"DeepSpeed ZeRO-{zero.stage} on {world} rank(s): importing Megatron-core and DeepSpeed, building the "
              "model and the engine ...", flush=True)
    try:
        run = build(config, zero)
        loaded = run.load(args.load, args.ckpt_step) if args.load else None
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
        if args.exit_interval:  # Megatron-LM's --exit-interval: the first multiple of N after the resumed step
            end = min(end, (run.iteration // args.exit_interval + 1) * args.exit_interval)

        def periodic(iteration: int) -> None:
            if saver is not None and interval and iteration % interval == 0 and iteration < end:
                saver(blocking=False)

        run.train(log=lambda line: print(line, flush=True), after_step=periodic, stop_at=end)
        if end < config.training.train_iters:
            _say(f"exiting after iteration {end} (--exit-interval {args.exit_interval})")
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
