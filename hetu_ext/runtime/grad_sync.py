"""Gradient synchronisation for any plan: each cell all-reduced over its lane (see plan/core/layout.py).

Works on the ``main_grad`` buffers of Megatron's DistributedDataParallel, after its own (single-rank) reduction
and before the optimizer. All lane buffers are packed before any reduction so that a rank sitting in several
lanes (a stage with fewer TP copies than another) contributes its own gradient to each, never a partial sum.
Lanes run in one global order on every rank, so blocking collectives over overlapping groups cannot deadlock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hetu_ext.plan.core.layout import Box, Cell, ReductionLayout

from .groups import PlanGroups


@dataclass(frozen=True)
class LocalTensor:
    """A parameter of this rank and the global box its local data covers."""

    param: torch.nn.Parameter
    box: Box
    shape: tuple[int, ...] | None = None
    """The box's extent where it differs from the parameter's shape (a gated weight's ``(2, f, ...)`` view)."""

    def weights(self) -> torch.Tensor:
        """The parameter's data in the box's shape."""
        return self.param.data if self.shape is None else self.param.data.view(self.shape)

    def grad(self) -> torch.Tensor:
        """The parameter's ``main_grad`` in the box's shape."""
        return self.param.main_grad if self.shape is None else self.param.main_grad.view(self.shape)


def _local_slices(cell: Cell, local: LocalTensor) -> tuple[slice, ...]:
    return tuple(slice(c0 - b0, c1 - b0) for (c0, c1), (b0, _) in zip(cell.box, local.box))


@dataclass
class GradSync:
    """Executes a plan's gradient reduction for one rank."""

    layout: ReductionLayout
    groups: PlanGroups
    local: dict[tuple[str, tuple[int, ...]], LocalTensor]
    flat_buffers: list[torch.Tensor] = field(default_factory=list)
    """The contiguous buffers holding every local gradient (DDP's grad_data)."""
    in_place: set[tuple[int, ...]] = field(default_factory=set)
    """Lanes whose members reduce ``flat_buffers`` as they are (plan.core.layout.in_place_lanes): no packing."""
    bytes_sent: int = 0
    """Bytes this rank handed to all-reduces in the last step, counted as a ring moves them: 2 (n-1)/n each."""
    _lanes: list = field(default_factory=list, init=False)
    _owned: list = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        rank = self.groups.rank
        for ranks, cells in self.layout.lanes_of(rank):
            views = [(self.local[(c.key, c.index)], _local_slices(c, self.local[(c.key, c.index)])) for c in cells]
            self._lanes.append((ranks, self.groups.lanes[ranks], views))
        self._in_place = bool(self._lanes) and self._lanes[0][0] in self.in_place and bool(self.flat_buffers)
        for cell, owner in self.layout.owners.items():
            if owner == rank:
                local = self.local[(cell.key, cell.index)]
                self._owned.append((local, _local_slices(cell, local)))

    @staticmethod
    def _grad(local: LocalTensor) -> torch.Tensor:
        return local.grad()

    def reduce(self) -> None:
        """Sum every cell's gradient over the stages holding it; every holder ends with the sum."""
        if self._in_place:
            ranks, group, _ = self._lanes[0]
            for buffer in self.flat_buffers:
                dist.all_reduce(buffer, group=group)
            n = len(ranks)
            self.bytes_sent = round(sum(2 * (n - 1) / n * b.numel() * b.element_size() for b in self.flat_buffers))
            return
        packed = [torch.cat([self._grad(t)[s].reshape(-1) for t, s in views]) for _, _, views in self._lanes]
        sent = 0.0
        for (ranks, group, _), buffer in zip(self._lanes, packed):
            dist.all_reduce(buffer, group=group)
            sent += 2 * (len(ranks) - 1) / len(ranks) * buffer.numel() * buffer.element_size()
        for (_, _, views), buffer in zip(self._lanes, packed):
            offset = 0
            for local, slices in views:
                target = self._grad(local)[slices]
                target.copy_(buffer[offset:offset + target.numel()].view_as(target))
                offset += target.numel()
        self.bytes_sent = round(sent)

    def owned_grads(self) -> list[torch.Tensor]:
        """The gradient of every element of the model exactly once over all ranks (for the global norm)."""
        return [self._grad(local)[slices] for local, slices in self._owned]
