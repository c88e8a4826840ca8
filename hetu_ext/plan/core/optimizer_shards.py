"""Sharded optimizer state for any plan (pure): every element's fp32 master and moments on exactly one holder.

Megatron's distributed optimizer (ZeRO-1) cuts one flat buffer over one uniform data-parallel group. Under a
heterogeneous plan the ranks holding an element differ from tensor to tensor and from cell to cell (plan/core/layout.py's
cells), so we do it per **holder set**: all the cells held by exactly the same ranks (every copy: replicas in each
pipeline, TP copies of replicated tensors, the tied output layer) are laid end to end, each cell flattened
row-major in a canonical order, and that flat run of B elements is cut into n = |holders| equal parts of
ceil(B / n) elements, part j owned by the j-th holder (Megatron's padding to a multiple of n, at most n - 1
elements). A part is a range of the flat run; :func:`flat_boxes` turns it back into boxes of global tensors, so
the reshard engine and checkpoints see sharded optimizer state as ordinary shards.

Per step, for each holder set in one global order: the gradients are reduce-scattered over exactly its holders
(only when they span two or more stages; a stage's TP copies of a replicated element carry identical gradients,
so one copy per stage contributes, the others send zeros), the owner steps, and the updated weights are
all-gathered back over the holders in the model's dtype. With a ring, each holder sends (n-1) x ceil(B/n)
elements per collective: :meth:`OptimizerShards.exchange_bytes`, the minimum for reduce-scatter + all-gather
over each holder set. Each element is owned once, so the global grad norm counts it once.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from hetu_ext.plan.core.layout import Box, Cell, ShardInfo, contains, split_box


def flat_boxes(box: Box, start: int, stop: int) -> list[Box]:
    """The elements ``[start, stop)`` of ``box`` flattened row-major, as boxes (global coordinates) in flat order.

    At most 2 d - 1 boxes for a d-dimensional box: a partial row, whole rows, a partial row, recursively.
    """
    if start >= stop:
        return []
    lo, rest = box[0][0], box[1:]
    if not rest:
        return [((lo + start, lo + stop),)]
    inner = math.prod(b - a for a, b in rest)
    r0, o0 = divmod(start, inner)
    r1, o1 = divmod(stop, inner)
    if r0 == r1:
        return [((lo + r0, lo + r0 + 1), *sub) for sub in flat_boxes(rest, o0, o1)]
    out = []
    if o0:
        out += [((lo + r0, lo + r0 + 1), *sub) for sub in flat_boxes(rest, o0, inner)]
        r0 += 1
    if r1 > r0:
        out.append(((lo + r0, lo + r1), *rest))
    if o1:
        out += [((lo + r1, lo + r1 + 1), *sub) for sub in flat_boxes(rest, 0, o1)]
    return out


@dataclass(frozen=True)
class HolderSet:
    """Cells held by exactly the same ranks, laid end to end (the unit of reduce-scatter and all-gather)."""

    ranks: tuple[int, ...]
    """Every rank holding these cells, sorted; part j of the flat run belongs to ``ranks[j]``."""
    cells: tuple[Cell, ...]
    """In canonical order; flattened row-major and concatenated they form the set's flat run."""
    contributors: tuple[frozenset[int], ...]
    """Per cell, the ranks whose gradient is added: one per holding contributor (a stage, or a CP rank of one;
    its lowest TP copy)."""
    reduce: bool
    """The holders span two or more contributors, so gradients are reduce-scattered (else only gathered)."""

    @property
    def numel(self) -> int:
        return sum(c.numel for c in self.cells)

    @property
    def part(self) -> int:
        """Elements per holder (the last part may be short: padding)."""
        return -(-self.numel // len(self.ranks))

    def part_range(self, rank: int) -> tuple[int, int]:
        """The flat range ``rank`` owns."""
        j = self.ranks.index(rank)
        return min(j * self.part, self.numel), min((j + 1) * self.part, self.numel)

    def owned(self, rank: int) -> list[tuple[Cell, Box]]:
        """The boxes ``rank`` owns, each with its cell, in flat order."""
        start, stop = self.part_range(rank)
        out, offset = [], 0
        for cell in self.cells:
            a, b = max(start - offset, 0), min(stop - offset, cell.numel)
            out += [(cell, box) for box in flat_boxes(cell.box, a, b)]
            offset += cell.numel
        return out


@dataclass(frozen=True)
class OptimizerShards:
    """The sharded optimizer's layout of a plan: holder sets, in one global order (every rank runs them so)."""

    sets: tuple[HolderSet, ...]

    def sets_of(self, rank: int) -> list[HolderSet]:
        return [s for s in self.sets if rank in s.ranks]

    def owned(self, rank: int) -> list[tuple[Cell, Box]]:
        """Every box whose optimizer state ``rank`` keeps (each element of the model is in one rank's list)."""
        return [o for s in self.sets_of(rank) for o in s.owned(rank)]

    def owned_numel(self, rank: int) -> int:
        return sum(b - a for s in self.sets_of(rank) for a, b in [s.part_range(rank)])

    def fair_numel(self, rank: int) -> float:
        """Each element the rank holds, divided by its number of holders: the perfectly even share."""
        return sum(s.numel / len(s.ranks) for s in self.sets_of(rank))

    def exchange_bytes(self, rank: int, grad_bytes: int = 4, weight_bytes: int = 4) -> int:
        """Bytes ``rank`` sends per step with ring collectives: (n-1) x part for the reduce-scatter of gradients
        (holder sets spanning stages) and for the all-gather of weights (every set of 2+ holders)."""
        total = 0
        for s in self.sets_of(rank):
            n = len(s.ranks)
            total += (n - 1) * s.part * ((grad_bytes if s.reduce else 0) + weight_bytes)
        return total

    def holder_sets(self) -> list[tuple[int, ...]]:
        """Rank tuples that need a process group (sets of two or more holders)."""
        return [s.ranks for s in self.sets if len(s.ranks) > 1]


def optimizer_shards(shards: list[ShardInfo]) -> OptimizerShards:
    """The sharded optimizer's layout from every rank's shards (the same answer on every rank)."""
    by_tensor: dict[tuple[str, tuple[int, ...]], list[ShardInfo]] = defaultdict(list)
    for s in shards:
        by_tensor[(s.key, s.index)].append(s)
    cells: dict[tuple[int, ...], list[tuple[Cell, frozenset[int], bool]]] = defaultdict(list)
    for (key, index), holders in sorted(by_tensor.items()):
        boxes = [h.box for h in holders]
        extent = tuple((min(b[d][0] for b in boxes), max(b[d][1] for b in boxes)) for d in range(len(boxes[0])))
        for box in split_box(extent, boxes):
            inside = [h for h in holders if contains(h.box, box)]
            if not inside:
                raise ValueError(f"{key}{list(index)}: elements {box} are held by no rank")
            first: dict[tuple[tuple[int, int], int], ShardInfo] = {}
            for h in sorted(inside, key=lambda h: (h.tp_index, h.rank)):
                first.setdefault(h.contributor, h)
            ranks = tuple(sorted({h.rank for h in inside}))
            cells[ranks].append((Cell(key, index, box), frozenset(h.rank for h in first.values()), len(first) > 1))
    sets = []
    for ranks, items in sorted(cells.items()):
        sets.append(HolderSet(ranks=ranks, cells=tuple(c for c, _, _ in items),
                              contributors=tuple(k for _, k, _ in items), reduce=any(r for _, _, r in items)))
    return OptimizerShards(sets=tuple(sets))
