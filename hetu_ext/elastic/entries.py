"""What ``launch/elastic.py`` runs on each rank (``--launcher``), and what it asks that program each round.

* ``hetu``: hetu_ext's trainer (``launch/pretrain_gpt.py``). A Malleus plan is agreed over the healthy devices
  (``agreement.agree``), written to a file and given with ``--hetu-plan``; the checkpoint loads into any plan.
* ``deepspeed``: DeepSpeed's engine (``launch/pretrain_gpt_deepspeed.py``). No planner: every healthy device is a
  data-parallel rank, as many as divide the global batch (``agreement.data_parallel``), and ``--load`` reads the
  engine's own ZeRO (or hetu) checkpoint at the new world size in process (hetu_ext/deepspeed/engine_load.py).

Each entry checks the flags once before anything starts (:meth:`check_flags`), agrees a layout over the nodes'
reports (:meth:`agree`, on the rendezvous' group rank 0), writes a round's flags (:meth:`round_argv`: ``--load``
the ``--save`` directory once it holds a checkpoint) and checks them against the round's world size
(:meth:`check_round`); errors are ValueError / OSError with the program's one-line message. Flags are read by the
program's own parser. Importing this module imports no host framework; the checks import their program's flag
modules.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from pathlib import Path

from . import argv as hetu_argv
from .agreement import Agreement, NodeReport, agree, data_parallel
from .worker import PRELOAD, run_deepspeed_worker, run_worker

logger = logging.getLogger(__name__)

SAVE_REQUIRED = ("elastic restarts need --save DIR (the checkpoints to resume from); add it with "
                 "--save-interval N")


class HetuEntry:
    """``launch/pretrain_gpt.py`` under a Malleus plan agreed per round."""

    name = "hetu"
    prog = "pretrain_gpt.py"
    preload: tuple[str, ...] = PRELOAD
    worker: Callable[[str, str, str], None] = staticmethod(run_worker)

    def check_flags(self, train: list[str]) -> tuple[str, float]:
        """The flags as the program's launcher checks them, plus what restarts need: (--save, --hetu-hang-timeout)."""
        from hetu_ext.config import build_parser, from_namespace, parse_namespace
        from hetu_ext.cli.args import validate_args

        parsed = parse_namespace(train, build_parser())
        validate_args(parsed)
        config = from_namespace(parsed)
        if config.checkpoint.save is None:
            raise ValueError(SAVE_REQUIRED)
        hetu_argv.plan_inputs(train)
        import hetu_ext.checkpoint.reader  # noqa: F401 - warm: every round's argv looks for the newest checkpoint

        return config.checkpoint.save, config.parallel.hang_timeout

    def agree(self, train: list[str], nodes: list[NodeReport]) -> Agreement:
        spec, micro_batch, num_microbatches = hetu_argv.plan_inputs(train)
        return agree(nodes, spec, micro_batch=micro_batch, num_microbatches=num_microbatches)

    def round_argv(self, train: list[str], plan_path: str) -> list[str]:
        return hetu_argv.round_argv(train, plan_path=plan_path)

    def check_round(self, argv: list[str], world_size: int) -> None:
        hetu_argv.check_round(argv, world_size)


class DeepSpeedEntry:
    """``launch/pretrain_gpt_deepspeed.py``: data parallel over the healthy devices, its own checkpoint loaded at
    each round's world size."""

    name = "deepspeed"
    prog = "pretrain_gpt_deepspeed.py"
    preload: tuple[str, ...] = ("torch", "deepspeed", "hetu_ext.train.trainer", "hetu_ext.deepspeed.engine",
                                "hetu_ext.deepspeed.engine_load", "hetu_ext.cli.deepspeed")
    """The node's forkserver imports DeepSpeed too (set ``DS_ACCELERATOR`` before it starts, without CUDA)."""
    worker: Callable[[str, str, str], None] = staticmethod(run_deepspeed_worker)

    def _parse(self, argv: list[str]) -> argparse.Namespace:
        from hetu_ext.config import parse_namespace
        from hetu_ext.cli.deepspeed import flag_parser

        return parse_namespace(argv, flag_parser())

    def check_flags(self, train: list[str]) -> tuple[str, float]:
        from hetu_ext.config import from_namespace

        args = self._parse(train)
        if args.hetu_microbatches:
            raise ValueError(f"--hetu-microbatches {','.join(map(str, args.hetu_microbatches))} fixes the counts of "
                             f"{len(args.hetu_microbatches)} ranks, and an elastic job changes its number of ranks: "
                             "drop it (equal shares), or give --zero-stage 1 --hetu-straggler-interval N to follow "
                             "the measured speeds")
        config = from_namespace(args)
        if config.checkpoint.save is None:
            raise ValueError(SAVE_REQUIRED)
        training = config.training
        if not training.global_batch_size or training.global_batch_size % training.micro_batch_size:
            raise ValueError(f"elastic restarts keep the global batch: give --global-batch-size (a multiple of "
                             f"--micro-batch-size {training.micro_batch_size}), got {training.global_batch_size}")
        self.check_round(train, 1)  # everything but the world size, which each round checks
        import hetu_ext.deepspeed.engine_load  # noqa: F401 - warm: every round's argv looks for a checkpoint

        return config.checkpoint.save, config.parallel.hang_timeout

    def agree(self, train: list[str], nodes: list[NodeReport]) -> Agreement:
        from hetu_ext.config import from_namespace

        config = from_namespace(self._parse(train))
        training = config.training
        microbatches = training.global_batch_size // training.micro_batch_size
        agreement = data_parallel(nodes, num_layers=config.model.num_layers, num_microbatches=microbatches)
        healthy = sum(len(n.devices) for n in nodes)
        if agreement.plan.world_size < healthy:
            logger.warning("elastic: %d of %d healthy devices train this round: %d ranks do not divide the global "
                           "batch's %d microbatches", agreement.plan.world_size, healthy, healthy, microbatches)
        return agreement

    def round_argv(self, train: list[str], plan_path: str) -> list[str]:
        """``train`` with ``--load`` the ``--save`` directory once that holds a checkpoint (DeepSpeed's ``latest``
        or a hetu checkpoint), else ``train`` itself (a fresh job, or the user's own ``--load``). The plan is not
        passed: the world size is the layout."""
        from hetu_ext.deepspeed.engine_load import checkpoint_kind

        save = self._parse(train).save
        if save is None:
            raise ValueError(SAVE_REQUIRED)
        try:
            found = Path(save).is_dir() and checkpoint_kind(save) is not None
        except ValueError:  # a 'latest' naming a missing tag: the ranks' load reports it in one line
            found = True
        if not found:
            return list(train)
        return hetu_argv.without(train, ("--load",)) + ["--load", save]

    def check_round(self, argv: list[str], world_size: int) -> None:
        from hetu_ext.cli.deepspeed import check_flags

        check_flags(argv, world_size)


ENTRIES = {entry.name: entry for entry in (HetuEntry(), DeepSpeedEntry())}
"""``--launcher`` name -> entry."""
