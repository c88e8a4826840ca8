"""The sharded optimizer's communication for any plan: reduce-scatter gradients to owners, all-gather weights.

Executes plan/core/optimizer_shards.py's layout for one rank, on the ``main_grad`` buffers of Megatron's
DistributedDataParallel (after its own single-rank reduction) and on the model's parameters (after the owners'
optimizer step). Holder sets run in one global order on every rank, so blocking collectives over overlapping
groups cannot deadlock. Duck-types :class:`~hetu_ext.runtime.grad_sync.GradSync` (``reduce``, ``owned_grads``,
``bytes_sent``) so the plan runtime's gradient hook calls either.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hetu_ext.plan.core.layout import Box, Cell
from hetu_ext.plan.core.optimizer_shards import HolderSet, OptimizerShards

from .grad_sync import LocalTensor
from .groups import PlanGroups


def _slices(box: Box, within: Box) -> tuple[slice, ...]:
    return tuple(slice(c0 - b0, c1 - b0) for (c0, c1), (b0, _) in zip(box, within))


@dataclass(frozen=True)
class OwnedBox:
    """A box of one local parameter whose optimizer state this rank keeps."""

    cell: Cell
    box: Box
    local: LocalTensor
    slices: tuple[slice, ...]
    """Of ``local.param`` (and of its ``main_grad``)."""

    def param_view(self) -> torch.Tensor:
        return self.local.weights()[self.slices]

    def grad_view(self) -> torch.Tensor:
        return self.local.grad()[self.slices]


@dataclass
class _SetPlan:
    spec: HolderSet
    group: object
    cells: list[tuple[LocalTensor, tuple[slice, ...], bool]]
    """(local tensor, slices of the cell, whether this rank's gradient is added) in the set's flat order."""
    owned: list[OwnedBox]


@dataclass
class ShardedGradSync:
    """Reduce-scatter of gradients and all-gather of weights over each holder set, for one rank."""

    shards: OptimizerShards
    groups: PlanGroups
    """With a group for every holder set of 2+ ranks in ``groups.lanes`` (keyed by the sorted rank tuple)."""
    local: dict[tuple[str, tuple[int, ...]], LocalTensor]
    bytes_sent: int = 0
    """Bytes this rank handed to collectives in the last step (reduce-scatter, then all-gather), counted as a
    ring moves them: (n-1) x part each."""
    _sets: list[_SetPlan] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        rank = self.groups.rank
        for spec in self.shards.sets_of(rank):
            cells = []
            for cell, contributors in zip(spec.cells, spec.contributors):
                local = self.local[(cell.key, cell.index)]
                cells.append((local, _slices(cell.box, local.box), rank in contributors))
            owned = []
            for cell, box in spec.owned(rank):
                local = self.local[(cell.key, cell.index)]
                owned.append(OwnedBox(cell, box, local, _slices(box, local.box)))
            group = self.groups.lanes[spec.ranks] if len(spec.ranks) > 1 else None
            self._sets.append(_SetPlan(spec, group, cells, owned))

    @property
    def owned(self) -> list[OwnedBox]:
        """Every box this rank keeps optimizer state for, in the global order of holder sets."""
        return [o for s in self._sets for o in s.owned]

    def owned_grads(self) -> list[torch.Tensor]:
        """The gradient of every element of the model exactly once over all ranks (for the global norm)."""
        return [o.grad_view() for o in self.owned]

    def reduce(self) -> None:
        """Sum each owned element's gradient over the stages holding it, into the owner's ``main_grad``."""
        self.bytes_sent = 0
        for s in self._sets:
            if not s.spec.reduce:
                continue  # one stage holds these cells: its copies already have the whole gradient
            n, part = len(s.spec.ranks), s.spec.part
            flat = torch.zeros(n * part, dtype=torch.float32, device=self._device(s))
            offset = 0
            for local, slices, adds in s.cells:
                grad = local.grad()[slices]
                if adds:
                    flat[offset:offset + grad.numel()].view_as(grad).copy_(grad)
                offset += grad.numel()
            mine = torch.empty(part, dtype=torch.float32, device=flat.device)
            dist.reduce_scatter_tensor(mine, flat, group=s.group)
            self._unpack(mine, [o.grad_view() for o in s.owned])
            self.bytes_sent += (n - 1) * part * flat.element_size()

    def gather(self) -> None:
        """After the owners' step: every holder receives the updated weights of its cells (model dtype)."""
        for s in self._sets:
            n, part = len(s.spec.ranks), s.spec.part
            if n == 1:
                continue
            first = s.cells[0][0].param
            mine = torch.zeros(part, dtype=first.dtype, device=first.device)
            offset = 0
            for o in s.owned:
                view = o.param_view()
                mine[offset:offset + view.numel()].view_as(view).copy_(view)
                offset += view.numel()
            flat = torch.empty(n * part, dtype=first.dtype, device=first.device)
            dist.all_gather_into_tensor(flat, mine, group=s.group)
            self._unpack(flat, [local.weights()[slices] for local, slices, _ in s.cells])
            self.bytes_sent += (n - 1) * part * flat.element_size()

    @staticmethod
    def _unpack(flat: torch.Tensor, views: list[torch.Tensor]) -> None:
        offset = 0
        for view in views:
            view.copy_(flat[offset:offset + view.numel()].view_as(view))
            offset += view.numel()

    @staticmethod
    def _device(s: _SetPlan) -> torch.device:
        return s.cells[0][0].param.device
