"""What the training loop needs from the runtime that placed a rank (Megatron's uniform path or the plan's)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from hetu_ext.runtime.grad_sync import GradSync


@dataclass
class Placement:
    """What the training loop needs from the runtime that placed this rank."""

    active: bool
    """False on ranks the plan leaves unused: they hold nothing and wait."""
    pipeline_index: int | None = None
    model: torch.nn.Module | None = None
    optimizer: object = None
    config: object = None
    is_last_stage: bool = False
    tp_rank: int = 0
    """The rank's TP rank in its stage (under context parallelism: in its CP rank's TP group)."""
    cp_rank: int = 0
    cp_size: int = 1
    """Context parallelism: the stage splits every sequence over ``cp_size`` TP groups; this rank's is ``cp_rank``
    (its microbatches are cut to its chunks: megatron/context_parallel.py's ``cp_batches``)."""
    report_group: object = None
    """Group over which per-pipeline loss sums are added (None: the default world group)."""
    schedule_kwargs: dict = dataclasses.field(default_factory=dict)
    forward_backward: object = None
    grad_sync: GradSync | None = None
    probe_layer: torch.nn.Module | None = None
    """On an idle rank: one transformer layer the straggler monitor times to measure this rank's speed."""
    shard_kwargs: dict = dataclasses.field(default_factory=dict)
    """How to read this stage's tensors' global identity (weights.local_shards)."""
    normaliser: dict = dataclasses.field(default_factory=dict)
    """Plan runtime: ``{"tokens": N}`` makes the gradient finalisation divide by N instead of the schedule's
    token count (HotSPa: a step of several schedules is normalised once, by all its tokens)."""
