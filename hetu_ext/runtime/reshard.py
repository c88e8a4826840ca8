"""Reshard: move tensors from any layout to any layout by point-to-point transfers (torch.distributed only).

A layout is, per rank, a list of :class:`Piece` (a global tensor's key and layer index, the box of it the rank
holds, and the local tensor). Given every rank's source pieces (old layout, with data) and destination pieces
(new layout, tensors to fill), each destination box is cut into its intersections with source boxes; each
intersection is copied locally when the destination rank itself holds it, else sent by one holder, the one
that has sent the fewest bytes so far (spreading the load over replicas). One batched exchange moves
everything; nothing is lost: every destination element must be covered by some source, or the reshard fails
before sending anything.

The engine knows nothing of models: parameters, fp32 master weights and optimizer moments are resharded the
same way, and checkpoint loading can feed it a file layout as the source. With ``op="add"`` destinations are
added to instead of overwritten (HotSPa pulls a strategy's gradients into the home layout's buffer this way);
``op`` may map key prefixes (the part before ``:``) to operations, so that one exchange both copies weights
and adds gradients.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hetu_ext.errors import HetuExtError
from hetu_ext.plan.core.layout import Box, split_box


@dataclass(frozen=True)
class Piece:
    key: str
    index: tuple[int, ...]
    box: Box
    tensor: torch.Tensor | None = None
    """Local data (shape = the box's extent); dropped from the metadata that is exchanged."""

    def meta(self) -> "Piece":
        return Piece(self.key, self.index, self.box)


def _intersect(a: Box, b: Box) -> Box | None:
    box = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return box if all(lo < hi for lo, hi in box) else None


def _local(box: Box, within: Box) -> tuple[slice, ...]:
    return tuple(slice(lo - w0, hi - w0) for (lo, hi), (w0, _) in zip(box, within))


def _numel(box: Box) -> int:
    n = 1
    for lo, hi in box:
        n *= hi - lo
    return n


@dataclass
class ReshardReport:
    bytes_sent: int
    """Bytes this rank sent to other ranks."""
    bytes_copied_locally: int
    """Bytes this rank kept (source and destination on the same rank)."""


OPS = ("copy", "add")


def _op_of(op: str | dict[str, str], key: str) -> str:
    chosen = op if isinstance(op, str) else op.get(key.split(":", 1)[0], "copy")
    if chosen not in OPS:
        raise ValueError(f"reshard: op {chosen!r} for {key!r} is not one of {list(OPS)}")
    return chosen


def reshard(sources: list[Piece], destinations: list[Piece], group=None,
            op: str | dict[str, str] = "copy", ranks_per_node: int | None = None) -> ReshardReport:
    """Fill every destination piece on every rank from the source pieces (collective over ``group``): copy into
    it, or add to it where ``op`` (one operation, or key prefix -> operation) says ``"add"``. With
    ``ranks_per_node``, a holder on the destination's node is preferred to a remote one (then the least loaded)."""
    for p in destinations:
        _op_of(op, p.key)
    rank = dist.get_rank()
    world = dist.get_world_size(group)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (rank, [p.meta() for p in sources], [p.meta() for p in destinations]),
                           group=group)
    holders: dict[tuple, list[tuple[int, Box]]] = defaultdict(list)
    for r, srcs, _ in everyone:
        for p in srcs:
            holders[(p.key, p.index)].append((r, p.box))
    load: dict[int, int] = defaultdict(int)
    transfers = []  # (src rank, dst rank, key, index, box), in one global order on every rank
    for dst_rank, _, dsts in sorted(everyone, key=lambda e: e[0]):
        for p in dsts:
            sources_here = [(r, b) for r, b in holders.get((p.key, p.index), []) if _intersect(p.box, b)]
            for cell in split_box(p.box, [b for _, b in sources_here]):
                candidates = sorted(r for r, b in sources_here if _intersect(cell, b) == cell)
                if not candidates:
                    raise HetuExtError(f"reshard: {p.key}{list(p.index)} elements {cell} wanted by rank "
                                       f"{dst_rank} are held by no rank; nothing was moved")
                def rank_of(h, dst_rank=dst_rank):
                    remote = ranks_per_node is not None and h // ranks_per_node != dst_rank // ranks_per_node
                    return (remote, load[h], h)

                chosen = dst_rank if dst_rank in candidates else min(candidates, key=rank_of)
                if chosen != dst_rank:
                    load[chosen] += _numel(cell)
                transfers.append((chosen, dst_rank, p.key, p.index, cell))
    mine_src = defaultdict(list)
    for p in sources:
        mine_src[(p.key, p.index)].append(p)
    mine_dst = defaultdict(list)
    for p in destinations:
        mine_dst[(p.key, p.index)].append(p)

    def source_view(key, index, box):
        for p in mine_src[(key, index)]:
            if _intersect(p.box, box) == box:
                return p.tensor[_local(box, p.box)]
        raise AssertionError(f"{key}: rank {rank} chosen to send {box} it does not hold")

    def dest_view(key, index, box):
        for p in mine_dst[(key, index)]:
            if _intersect(p.box, box) == box:
                return p.tensor[_local(box, p.box)]
        raise AssertionError(f"{key}: rank {rank} receives {box} it did not ask for")

    p2p, receives, sent, local = [], [], 0, 0
    for src, dst, key, index, box in transfers:
        if src == rank and dst == rank:
            view = source_view(key, index, box)
            target = dest_view(key, index, box)
            target.add_(view) if _op_of(op, key) == "add" else target.copy_(view)
            local += view.numel() * view.element_size()
        elif src == rank:
            view = source_view(key, index, box).contiguous()
            p2p.append(dist.P2POp(dist.isend, view, dst))
            sent += view.numel() * view.element_size()
        elif dst == rank:
            target = dest_view(key, index, box)
            buffer = torch.empty(target.shape, dtype=target.dtype, device=target.device)
            p2p.append(dist.P2POp(dist.irecv, buffer, src))
            receives.append((target, buffer, _op_of(op, key)))
    if p2p:
        for req in dist.batch_isend_irecv(p2p):
            req.wait()
    for target, buffer, how in receives:
        target.add_(buffer) if how == "add" else target.copy_(buffer)
    return ReshardReport(bytes_sent=sent, bytes_copied_locally=local)
