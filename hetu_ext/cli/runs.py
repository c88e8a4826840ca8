"""Rank bodies for :func:`hetu_ext.testing.multiproc.run_ranks` that train through pretrain_gpt.py's code path."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any


def train(rank: int, world_size: int, argv: list[str], gather: bool = True,
          hotspa_per_group_normalisation: bool = False) -> dict[str, Any] | None:
    """Parse ``argv`` as pretrain_gpt.py does, train; the plan's lowest used rank returns losses, log lines and
    the full gathered weights, every other rank None. ``hotspa_per_group_normalisation``: a negative control
    (HotSPa groups each divided by their own tokens)."""
    from hetu_ext.cli.args import parse_run_config
    from hetu_ext.cli.train import build_run
    from hetu_ext.megatron.migrate import master_weights
    from hetu_ext.megatron.weights import gather_weights

    config = parse_run_config(argv)
    trainer = build_run(config)
    if hotspa_per_group_normalisation:
        trainer.switching.per_group_normalisation = True
    lines: list[str] = []
    start = time.perf_counter()
    losses = trainer.train(log=lines.append)
    elapsed = time.perf_counter() - start
    weights = masters = None
    if gather:
        weights = gather_weights(trainer.model, **trainer.placement.shard_kwargs)
        if config.training.bf16:  # the optimizer's fp32 master weights, gathered the same way
            masters = gather_weights(trainer.model, values=master_weights(trainer.optimizer) if trainer.model
                                     else None, **trainer.placement.shard_kwargs)
    if rank != trainer.log_rank:  # the plan's lowest used rank reports
        return None
    return {"losses": losses, "weights": weights, "masters": masters, "elapsed_s": elapsed, "log_lines": lines}


class SampleRecorder:
    """Wraps a training dataset: appends ``step sample-id`` of every sample read to ``path``, ``step`` being the
    step being run (``run.iteration + 1``). Tests compare the files of a recovered run with the uninterrupted
    one's: no sample skipped or repeated."""

    def __init__(self, dataset, run, path: Path) -> None:
        self.dataset, self.run, self.path = dataset, run, path

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        with open(self.path, "a") as f:
            f.write(f"{self.run.iteration + 1} {int(index)}\n")
        return self.dataset[index]


def recorded_samples(directory: Path, world: int) -> dict[int, list[int]]:
    """Step -> the sorted sample ids the ``ids_{world}_*.txt`` files of :class:`SampleRecorder` hold."""
    by_step: dict[int, list[int]] = {}
    for path in Path(directory).glob(f"ids_{world}_*.txt"):
        for line in path.read_text().split("\n"):
            if line:
                step, sample = map(int, line.split())
                by_step.setdefault(step, []).append(sample)
    return {s: sorted(v) for s, v in by_step.items()}
