"""pretrain_gpt.py's flags for a round of an elastic job (pure: argparse and hetu_ext.config only, no torch)."""

from __future__ import annotations

import argparse
from pathlib import Path

REPLACED = ("--hetu-plan", "--load", "--tensor-model-parallel-size", "--pipeline-model-parallel-size")
"""pretrain_gpt.py's flags a restart replaces (one value each): the new plan sets the layout, --save's checkpoints
are loaded."""


class _ArgvParser(argparse.ArgumentParser):
    """argparse that raises ValueError instead of exiting (a restart's argv was accepted by the first attempt)."""

    def error(self, message: str):
        raise ValueError(f"pretrain_gpt.py's flags: {message}")


def without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """``argv`` less each of ``flags`` with its value, in either spelling (``--load DIR``, ``--load=DIR``), as
    argparse reads them (no abbreviation); every other token kept in order."""
    replaced = _ArgvParser(add_help=False, allow_abbrev=False)
    for flag in flags:
        replaced.add_argument(flag, action="append")
    return replaced.parse_known_args(argv)[1]


def restart_argv(argv: list[str], *, plan_path: str) -> list[str]:
    """pretrain_gpt.py's flags for a restart: the new plan instead of any plan or TP/PP flags, --load = --save.

    The flags are read as pretrain_gpt.py's parser reads them: ``--load DIR`` and ``--load=DIR`` alike, no
    abbreviation (its parser has ``allow_abbrev=False``, so ``--save-interval`` is never ``--save``). The
    replaced flags are taken out by ``parse_known_args``, every other token kept in order; the directory loaded
    is the ``--save`` pretrain_gpt.py would use (the last one typed, else ``checkpoint.save`` of the
    ``--hetu-config`` file), by its own parser."""
    from hetu_ext.config import build_parser, from_namespace, parse_namespace

    replaced = _ArgvParser(add_help=False, allow_abbrev=False)
    for flag in REPLACED:
        replaced.add_argument(flag, action="append")
    _, kept = replaced.parse_known_args(argv)
    save = from_namespace(parse_namespace(argv, build_parser())).checkpoint.save
    if save is None:
        raise ValueError("elastic restarts need --save DIR (the checkpoints to resume from); add it with "
                         "--save-interval N")
    return kept + ["--hetu-plan", plan_path, "--load", save]


def saved_dir(argv: list[str]) -> str | None:
    """The ``--save`` directory pretrain_gpt.py would use with ``argv`` (flag, else the --hetu-config file)."""
    from hetu_ext.config import build_parser, from_namespace, parse_namespace

    return from_namespace(parse_namespace(argv, build_parser())).checkpoint.save


def round_argv(argv: list[str], *, plan_path: str) -> list[str]:
    """The flags of one round: ``argv`` with the agreed plan; ``--load`` the ``--save`` directory once it holds a
    complete checkpoint (:func:`restart_argv`), else the user's own ``--load`` (the first round of a fresh job)."""
    from hetu_ext.checkpoint.reader import candidates
    from hetu_ext.checkpoint.storage import LocalStorage

    save = saved_dir(argv)
    if save is None:
        raise ValueError("elastic restarts need --save DIR (the checkpoints to resume from); add it with "
                         "--save-interval N")
    if Path(save).is_dir() and candidates(LocalStorage(save), fallback=False):
        return restart_argv(argv, plan_path=plan_path)
    replaced = _ArgvParser(add_help=False, allow_abbrev=False)
    for flag in REPLACED:
        if flag != "--load":
            replaced.add_argument(flag, action="append")
    _, kept = replaced.parse_known_args(argv)
    return kept + ["--hetu-plan", plan_path]


def plan_inputs(argv: list[str]):
    """(ModelSpec, micro batch, microbatches per global batch) of ``argv``: what the plan agreement plans for.
    The global batch is kept across rounds, so it must be given and a multiple of the micro batch."""
    from hetu_ext.config import build_parser, from_namespace, parse_namespace
    from hetu_ext.data.tokenizer import tokenizer_vocab_size
    from hetu_ext.megatron.launch_plan import model_spec

    config = from_namespace(parse_namespace(argv, build_parser()))
    training = config.training
    if not training.global_batch_size or training.global_batch_size % training.micro_batch_size:
        raise ValueError(f"elastic restarts keep the global batch: give --global-batch-size (a multiple of "
                         f"--micro-batch-size {training.micro_batch_size}), got {training.global_batch_size}")
    spec = model_spec(config.model, tokenizer_vocab_size(config.data.tokenizer_type, config.data.vocab_size))
    return spec, training.micro_batch_size, training.global_batch_size // training.micro_batch_size


def check_round(argv: list[str], world_size: int) -> None:
    """pretrain_gpt.py's own checks of a round's flags against its plan and world size (no rank started):
    ValueError / OSError with its one-line message."""
    from hetu_ext.config import build_parser, from_namespace, parse_namespace
    from hetu_ext.cli.args import validate_args
    from hetu_ext.megatron.launch_plan import check_launch

    args = parse_namespace(argv, build_parser())
    validate_args(args)
    check_launch(from_namespace(args), world_size)
