"""Who holds which element of each global tensor, and how gradients are reduced across them (pure).

A **shard** is one rank's slice of one global tensor (a key such as ``decoder.layers.mlp.linear_fc1.weight`` and
a global layer index). Under a heterogeneous plan the same element may be held by several stages: a replica in
each pipeline (at any stage index and TP degree), the tied output layer of a pipeline's last stage, and, inside a
stage, every TP rank for tensors TP does not split (layernorms, row-parallel biases).

Each stage computes one gradient contribution for each element it holds (its TP ranks hold identical copies of
replicated elements); under context parallelism each CP rank of a stage computes its own (the gradient of its
chunks of every sequence), so a **contributor** is a (stage, CP rank). The update needs the sum over the
contributors holding it, delivered to every holder. We cut
each tensor into **cells**, maximal boxes with one set of holders, and reduce each cell in ``d`` **lanes**, d the
largest number of TP copies any holding stage has: lane i takes copy ``i mod n_s`` of each stage s. For a uniform
TP x DP grid the lanes are exactly Megatron's data-parallel groups (one per TP rank); a cell held by one stage
only needs no reduction. Every element is reduced once per lane and by no rank that does not hold it.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass

Box = tuple[tuple[int, int], ...]
"""Per dimension ``(start, stop)`` in global coordinates."""


@dataclass(frozen=True)
class ShardInfo:
    """One rank's slice of one global tensor."""

    rank: int
    stage: tuple[int, int]
    """(pipeline, stage) holding it; two stages of one pipeline are distinct contributors (tied embeddings)."""
    tp_index: int
    """The rank's position in its stage's TP group (orders the copies of replicated elements)."""
    key: str
    index: tuple[int, ...]
    """Global layer index (prepended axes), () for tensors outside the layer stack."""
    box: Box
    offset: int = -1
    """Where the rank keeps this gradient in its flat gradient buffer (element offset), -1 if unknown."""
    cp_index: int = 0
    """The rank's CP rank in its stage (context parallelism: each CP rank computes the gradient of its own chunks
    of every sequence, so CP ranks are distinct contributors)."""

    @property
    def contributor(self) -> tuple[tuple[int, int], int]:
        """Whose gradient this copy carries: (stage, CP rank); the TP copies of one contributor are identical."""
        return self.stage, self.cp_index


def in_place_lanes(layout: "ReductionLayout", shards: list[ShardInfo]) -> set[tuple[int, ...]]:
    """Lanes whose members can all-reduce their flat gradient buffers as they are, without packing.

    True of a lane when each member sits in no other lane, the lane reduces every element the member holds,
    and all members keep the same tensors at the same offsets (any uniform data-parallel group).
    """
    by_rank: dict[int, list[ShardInfo]] = defaultdict(list)
    for s in shards:
        by_rank[s.rank].append(s)
    lanes_per_rank: dict[int, list[tuple[int, ...]]] = defaultdict(list)
    for lane in layout.lanes:
        for r in lane:
            lanes_per_rank[r].append(lane)
    result = set()
    for lane, cells in layout.lanes.items():
        signatures = set()
        for r in lane:
            mine = by_rank[r]
            held = sum(Cell(s.key, s.index, s.box).numel for s in mine)
            if lanes_per_rank[r] != [lane] or held != sum(c.numel for c in cells) or min(s.offset for s in mine) < 0:
                break
            signatures.add(tuple(sorted((s.offset, s.key, s.index, s.box) for s in mine)))
        else:
            if len(signatures) == 1:
                result.add(lane)
    return result


@dataclass(frozen=True)
class Cell:
    """A box of one global tensor whose holders are the same ranks."""

    key: str
    index: tuple[int, ...]
    box: Box

    @property
    def numel(self) -> int:
        n = 1
        for a, b in self.box:
            n *= b - a
        return n


@dataclass(frozen=True)
class ReductionLayout:
    """The gradient reduction of a plan: lanes (rank sets) with their cells, and each cell's owner."""

    lanes: dict[tuple[int, ...], tuple[Cell, ...]]
    """Sorted rank tuple -> cells all-reduced over exactly those ranks, in a canonical order."""
    owners: dict[Cell, int]
    """Every cell (reduced or not) -> the one rank that counts it in global statistics (the grad norm)."""

    def lanes_of(self, rank: int) -> list[tuple[tuple[int, ...], tuple[Cell, ...]]]:
        return [(ranks, cells) for ranks, cells in self.lanes.items() if rank in ranks]

    def send_bytes(self, rank: int, bytes_per_element: int = 4) -> int:
        """Bytes ``rank`` sends per step with ring all-reduces: 2 (n-1)/n x the lane's bytes for each lane."""
        total = 0.0
        for ranks, cells in self.lanes_of(rank):
            n = len(ranks)
            total += 2 * (n - 1) / n * sum(c.numel for c in cells) * bytes_per_element
        return round(total)


def split_box(box: Box, boxes: list[Box]) -> list[Box]:
    """``box`` cut along every boundary of ``boxes`` that falls inside it (the grid of their overlaps)."""
    cuts = []
    for d, (lo, hi) in enumerate(box):
        points = sorted({lo, hi} | {b[d][k] for b in boxes for k in (0, 1) if lo < b[d][k] < hi})
        cuts.append(list(zip(points[:-1], points[1:])))
    return [tuple(cell) for cell in itertools.product(*cuts)]


def contains(box: Box, cell: Box) -> bool:
    """Whether ``cell`` lies inside ``box`` on every axis."""
    return all(a <= c0 and c1 <= b for (a, b), (c0, c1) in zip(box, cell))


def reduction_layout(shards: list[ShardInfo]) -> ReductionLayout:
    """Cells, lanes and owners for every tensor described by ``shards`` (all ranks' shards)."""
    by_tensor: dict[tuple[str, tuple[int, ...]], list[ShardInfo]] = defaultdict(list)
    for s in shards:
        by_tensor[(s.key, s.index)].append(s)
    lanes: dict[tuple[int, ...], list[Cell]] = defaultdict(list)
    owners: dict[Cell, int] = {}
    for (key, index), holders in sorted(by_tensor.items()):
        boxes = [h.box for h in holders]
        extent = tuple((min(b[d][0] for b in boxes), max(b[d][1] for b in boxes)) for d in range(len(boxes[0])))
        for box in split_box(extent, boxes):
            inside = [h for h in holders if contains(h.box, box)]
            if not inside:
                raise ValueError(f"{key}{list(index)}: elements {box} are held by no rank")
            cell = Cell(key, index, box)
            owners[cell] = min(h.rank for h in inside)
            copies: dict[tuple[tuple[int, int], int], list[int]] = defaultdict(list)
            for h in sorted(inside, key=lambda h: (h.contributor, h.tp_index, h.rank)):
                copies[h.contributor].append(h.rank)
            if len(copies) < 2:
                continue  # one contributor holds it: its TP copies are already identical
            width = max(len(r) for r in copies.values())
            for i in range(width):
                lane = tuple(sorted({ranks[i % len(ranks)] for ranks in copies.values()}))
                lanes[lane].append(cell)
    return ReductionLayout(lanes={k: tuple(v) for k, v in sorted(lanes.items())}, owners=owners)
