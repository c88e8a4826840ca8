"""The process groups of a plan, created once, the same way on every rank (torch.distributed).

``torch.distributed.new_group`` must be called by every rank, for every group, in the same order; this module is
the one place that does it, so a plan's groups are one object passed explicitly (no module globals).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from hetu_ext.plan import Plan


@dataclass
class PlanGroups:
    """Groups of one plan, as seen from one rank."""

    rank: int
    world_size: int
    plan: Plan
    tp: dist.ProcessGroup | None
    """This rank's stage TP group (None on unused ranks); under context parallelism, its CP rank's TP group."""
    single: dist.ProcessGroup
    """A group of this rank alone (for the data/context-parallel groups a stage model does not use)."""
    used: dist.ProcessGroup | None
    """All ranks the plan uses (loss, token count and grad-norm reductions); None on unused ranks."""
    cp: dist.ProcessGroup | None = None
    """The ranks that split each sequence with this rank (its stage's CP rank groups at its TP rank); ``single``
    without context parallelism, None on unused ranks."""
    lanes: dict[tuple[int, ...], dist.ProcessGroup] = field(default_factory=dict)
    """Gradient-reduction lanes this rank belongs to, by their sorted rank tuple."""


def _new_group(ranks: list[int], rank: int):
    group = dist.new_group(sorted(ranks))
    return group if rank in ranks else None


def build_groups(plan: Plan) -> PlanGroups:
    """Create the plan's TP, CP, single-rank and used-rank groups (collective: every rank, same arguments)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tp_group = cp_group = None
    for pipeline in plan.pipelines:
        for stage in pipeline.stages:
            for c in range(stage.cp):
                group = _new_group(list(stage.tp_group(c)), rank)
                tp_group = group if group is not None else tp_group
            for t in range(stage.tp if stage.cp > 1 else 0):
                group = _new_group(list(stage.cp_group(t)), rank)
                cp_group = group if group is not None else cp_group
    single = None
    for r in range(world):
        group = _new_group([r], rank)
        single = group if group is not None else single
    used = _new_group(sorted(plan.used_ranks), rank)
    if cp_group is None and tp_group is not None:
        cp_group = single
    return PlanGroups(rank=rank, world_size=world, plan=plan, tp=tp_group, single=single, used=used, cp=cp_group)


def add_lane_groups(groups: PlanGroups, lanes: list[tuple[int, ...]]) -> None:
    """Create the gradient-reduction lanes' groups (collective: every rank, the same lanes in the same order)."""
    for lane in lanes:
        group = _new_group(list(lane), groups.rank)
        if group is not None:
            groups.lanes[lane] = group
