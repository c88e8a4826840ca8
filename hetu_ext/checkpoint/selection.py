"""Who writes and who reads which shard (pure: no torch, no process group).

* :func:`assign_writes`: every rank holds boxes of global tensors, replicas overlap. Each tensor is cut into
  cells (the grid of all holders' box boundaries, ``plan.core.layout.split_box``); every cell is given to exactly one
  holder, the one with the fewest bytes to write so far, so each unique element is written once and the writing
  is spread over the replicas.
* :func:`assign_reads`: every stored shard is read by exactly one rank, one that needs the most of it (ties: the
  least bytes to read so far, then the lowest rank); the reshard engine then sends each rank what it needs. So
  ranks that need the same shard do not all read it, and no shard is read twice.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping

from hetu_ext.plan.core.layout import Box, split_box

TensorId = tuple[str, tuple[int, ...]]
"""(name, layer index) of a global tensor."""


def intersect(a: Box, b: Box) -> Box | None:
    box = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return box if all(lo < hi for lo, hi in box) else None


def numel(box: Box) -> int:
    return math.prod(hi - lo for lo, hi in box)


def extent(boxes: Iterable[Box]) -> Box:
    """The smallest box holding every given box (a tensor's global extent when its holders cover it)."""
    boxes = list(boxes)
    return tuple((min(b[d][0] for b in boxes), max(b[d][1] for b in boxes)) for d in range(len(boxes[0])))


def assign_writes(holdings: Mapping[int, Iterable[tuple[TensorId, Box, int]]]) -> dict[int, list[tuple[TensorId, Box]]]:
    """``rank -> [(tensor, box, bytes per element)]`` held; returns ``rank -> [(tensor, cell)]`` to write.

    Deterministic (same answer on every rank given the same input). Each element of each tensor lands in
    exactly one cell of exactly one rank.
    """
    by_tensor: dict[TensorId, list[tuple[int, Box, int]]] = defaultdict(list)
    for rank in sorted(holdings):
        for tensor, box, itemsize in holdings[rank]:
            by_tensor[tensor].append((rank, tuple(tuple(b) for b in box), itemsize))
    load: dict[int, int] = defaultdict(int)
    out: dict[int, list[tuple[TensorId, Box]]] = {rank: [] for rank in holdings}
    for tensor in sorted(by_tensor):
        holders = by_tensor[tensor]
        boxes = [b for _, b, _ in holders]
        if len(set(boxes)) == 1:  # every holder has the same box (pure replication): one cell
            cells = [boxes[0]]
        else:
            cells = split_box(extent(boxes), boxes)
        for cell in cells:
            candidates = [(r, size) for r, b, size in holders if intersect(b, cell) == cell]
            if not candidates:
                raise ValueError(f"{tensor[0]}{list(tensor[1])}: elements {cell} are held by no rank")
            rank, size = min(candidates, key=lambda c: (load[c[0]], c[0]))
            load[rank] += numel(cell) * size
            out[rank].append((tensor, cell))
    return out


def assign_reads(shards: Iterable[tuple[int, TensorId, Box, int]],
                 wants: Mapping[int, Iterable[tuple[TensorId, Box]]]) -> dict[int, int]:
    """``shards``: ``(shard id, tensor, box, bytes per element)``; ``wants``: ``rank -> [(tensor, box)]``.

    Returns ``shard id -> reading rank`` for every shard some rank needs (shards nobody needs are absent).
    """
    wanted: dict[TensorId, list[tuple[int, Box]]] = defaultdict(list)
    for rank in sorted(wants):
        for tensor, box in wants[rank]:
            wanted[tensor].append((rank, tuple(tuple(b) for b in box)))
    load: dict[int, int] = defaultdict(int)
    out: dict[int, int] = {}
    for shard_id, tensor, box, itemsize in shards:
        need: dict[int, int] = defaultdict(int)
        for rank, want in wanted.get(tensor, ()):
            common = intersect(box, want)
            if common is not None:
                need[rank] += numel(common)
        if not need:
            continue
        reader = min(need, key=lambda r: (-need[r], load[r], r))
        load[reader] += numel(box) * itemsize
        out[shard_id] = reader
    return out
