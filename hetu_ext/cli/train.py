"""Entry point behind ``launch/pretrain_gpt.py``: check every flag, launch the ranks, train; bad input is one
``error:`` line and exit code 2.

Two ways in:

* ``python launch/pretrain_gpt.py --nproc-per-node 4 <flags>`` (the README's): this process checks the flags, the
  files they name and the plan against the world size first, then starts torchrun's agent in-process with
  ``--nproc-per-node`` ranks, forked from one forkserver that imported the trainer once (each rank of torchrun
  is a fresh interpreter that imports it again). A bad flag never starts a rank; a rank that fails on bad input prints
  its one line and the launcher exits 2 quietly (torchrun itself would print a 40-line ChildFailedError
  traceback). One rank (no ``--nproc-per-node``) runs in this process.
* ``torchrun --nproc-per-node 4 launch/pretrain_gpt.py <flags>``: as Megatron-LM users launch; each rank checks
  the flags, rank 0 prints any error once.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import sys

from hetu_ext.config import (
    LaunchConfig,
    RunConfig,
    build_parser,
    from_namespace,
    parse_namespace,
    report_error,
    to_yaml,
)
from hetu_ext.plan import PlanError

from .args import take_megatron_lm_flags, validate_args

PROG = "pretrain_gpt.py"
LAUNCHER_FLAGS = tuple(f.name for f in dataclasses.fields(LaunchConfig))
"""torchrun's flags, which this script takes when it is its own launcher."""


def _under_launcher() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(PROG)
    launched = _under_launcher()
    try:
        argv, accepted = take_megatron_lm_flags(argv, parser)  # Megatron-LM's kernel and perf knobs
        args = parse_namespace(argv, parser)
        validate_args(args)
        config = from_namespace(args)
    except ValueError as exc:
        report_error(PROG, str(exc))
        return 2
    if args.hetu_print_config:
        if accepted:  # the file holds no such flag: say so (stderr, so the YAML stays clean)
            print(f"{PROG}: {accepted}", file=sys.stderr)
        print(to_yaml(config), end="")
        return 0
    launch = config.launch
    if launched and any(token.split("=", 1)[0] == "--nproc-per-node" for token in argv):
        report_error(PROG, "--nproc-per-node is the launcher's flag: give it to torchrun, or run python "
                           f"launch/{PROG} --nproc-per-node N without torchrun")
        return 2
    world_size = int(os.environ["WORLD_SIZE"]) if launched else (launch.nproc_per_node or 1) * launch.nnodes
    try:
        from hetu_ext.hostlog import quiet_host_frameworks

        quiet_host_frameworks()
        from hetu_ext.megatron.launch_plan import check_launch

        launch_check = check_launch(config, world_size)  # the plan against the model and world size, no group
        _check_exit_duration(config, launch_check)
        from hetu_ext.train.eval import check_evaluation

        check_evaluation(config)  # --eval-iters / --skip-train refusals (LoRA's trainer too), before any rank
        from hetu_ext.plan.core.batches import batch_ramp, check_ramp

        check_ramp(launch_check.plan, batch_ramp(config.training), config.training.micro_batch_size)
    except (PlanError, ValueError, OSError) as exc:
        report_error(PROG, str(exc))
        return 2
    for notice in launch_check.notices if os.environ.get("RANK", "0") == "0" else ():  # once per job
        print(f"{PROG}: {notice}", file=sys.stderr)
    if accepted and os.environ.get("RANK", "0") == "0":  # the ranks it launches get argv without these flags
        print(f"{PROG}: {accepted}", file=sys.stderr)
    if not launched:
        if world_size > 1:
            return _launch(argv, config)
        _single_rank_env(config)
    return _train(config)


def _check_exit_duration(config: RunConfig, launch_check) -> None:
    """--exit-duration-in-mins is decided by the used ranks together after a step; ranks a plan leaves idle (now,
    or after a migration) do not run steps, so they could not follow."""
    if not config.training.exit_duration_in_mins:
        return
    if launch_check.plan.unused_ranks or launch_check.migrations or config.straggler.replan == "online":
        raise ValueError(f"--exit-duration-in-mins {config.training.exit_duration_in_mins} needs every rank in "
                         "every step: the plan leaves ranks unused, or --hetu-migrate / --hetu-straggler-replan "
                         "online may; drop one")


def _single_rank_env(config: RunConfig) -> None:
    """One rank in this process: the environment torchrun would give it."""
    port = config.launch.master_port or _free_port()
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": config.launch.master_addr, "MASTER_PORT": str(port)})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RANK_PRELOAD = ("torch", "torch._dynamo", "hetu_ext.megatron", "megatron.core", "hetu_ext.train.trainer",
                "hetu_ext.cli.train")
"""What the launcher's forkserver imports once for all its ranks (a fresh interpreter per rank paid them each:
5-8 CPU-s per rank; ``torch._dynamo`` is what the optimizer's first step imports)."""


def _launch(argv: list[str], config: RunConfig) -> int:
    """torchrun's agent, in this process, running ``nproc_per_node`` ranks of this entry point with the same flags
    (less the launcher's), each forked from one forkserver that imported the trainer once (torchrun would start a
    fresh interpreter per rank). Returns 2 when a rank exited 2 (it printed its one error line), else the job's
    code."""
    import multiprocessing

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    for name in ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)  # its failure report repeats the rank's error
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # what torchrun sets (and warns about setting)
    rest, launch = _strip_launcher_flags(argv), config.launch
    torchrun = ["--nproc-per-node", str(launch.nproc_per_node), "--nnodes", str(launch.nnodes),
                "--start-method", "forkserver"]
    if launch.nnodes == 1:
        torchrun += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{launch.master_port or 0}"]
    else:
        torchrun += ["--node-rank", str(launch.node_rank), "--master-addr", launch.master_addr,
                     "--master-port", str(launch.master_port or 29500)]
    torch_config, _, _ = config_from_args(parse_args([*torchrun, PROG, *rest]))
    multiprocessing.set_forkserver_preload(list(RANK_PRELOAD))  # the environment above is the ranks'
    try:
        elastic_launch(torch_config, _rank)(rest)
    except ChildFailedError as exc:
        codes = {failure.exitcode for failure in exc.failures.values()}
        if 2 in codes:
            return 2
        rank, failure = exc.get_first_failure()  # (local rank, ProcessFailure)
        report_error(PROG, f"local rank {rank} exited with code {failure.exitcode}; its output is above")
        return 1
    return 0


def _rank(argv: list[str]) -> None:
    """One rank of :func:`_launch`: this entry point with the ranks' flags; its exit code is the process's."""
    code = main(argv)
    if code:
        sys.exit(code)


def _strip_launcher_flags(argv: list[str]) -> list[str]:
    """``argv`` without the launcher's flags (both ``--flag value`` and ``--flag=value``)."""
    flags = {"--" + name.replace("_", "-") for name in LAUNCHER_FLAGS}
    out, skip = [], False
    for token in argv:
        if skip:
            skip = False
        elif token in flags:
            skip = True
        elif token.split("=", 1)[0] not in flags:
            out.append(token)
    return out


def build_run(config: RunConfig):
    """The trainer the command line asks for (collective): the tenants' (hetu_ext.lora, a plug-in of the trainer,
    chosen here rather than inside it) with --hetu-lora-tenants, else the plain one, whose ``--load`` also reads
    DeepSpeed ZeRO checkpoints (the format is handed to it here, so megatron/ imports no deepspeed/)."""
    if config.lora.tenants:
        from hetu_ext.lora.train import build_lora_trainer

        return build_lora_trainer(config)
    from hetu_ext.deepspeed.zero_checkpoint import (
        ZERO_CHECKPOINTS,  # imports DeepSpeed only when it reads one
    )
    from hetu_ext.train.trainer import build_trainer

    return build_trainer(config, checkpoint_formats=(ZERO_CHECKPOINTS,))


def _train(config: RunConfig) -> int:
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="[%(asctime)s] [rank %(rank)s] %(name)s: %(message)s".replace("%(rank)s", str(rank)))
    logging.getLogger("megatron").setLevel(logging.WARNING)  # its INFO lists every parameter and config field

    from hetu_ext.megatron import host

    try:
        trainer = build_run(config)
    except (PlanError, ValueError) as exc:
        report_error(PROG, str(exc))
        host.shutdown()
        return 2
    try:
        trainer.train(log=lambda line: print(line, flush=True))
    finally:
        host.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
