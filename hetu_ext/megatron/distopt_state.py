"""Megatron-core's DistributedOptimizer (``--use-distributed-optimizer``, ZeRO-1) as pieces of the global tensors.

Megatron-core 0.16.1 keeps the optimizer state of a data-parallel (DP) group in flat buffers: every parameter
of the model chunk has a place in a contiguous grad/param buffer, each bucket of the buffer is cut into DP equal
ranges, and DP rank d owns the d-th range of every bucket. So a DP rank owns, of each parameter's local tensor
(its TP shard), one contiguous *flat* range ``[start, stop)`` of its row-major elements, possibly empty, possibly
all of it (``DistributedOptimizer._get_model_param_range_map(p)["param"]``); for that range it keeps the fp32
master (``shard_fp32_from_float16_groups``, under --bf16 / --fp16) and Adam's ``exp_avg`` and ``exp_avg_sq``, all
1-D tensors of ``stop - start`` elements (the inner torch optimizer's parameters and their state).

A flat range of a row-major tensor is a union of at most ``2 (ndim - 1) + 1`` boxes, each contiguous in memory
(:func:`flat_boxes`; a 2-D weight: the rest of a partial first row, the full rows between, the start of a partial
last row). Each box, moved by the TP shard's global offset (:class:`~hetu_ext.megatron.weights.LocalShard`), is a
box of the global tensor, and the flat state's elements of it are a view of that box's shape: one
:class:`~hetu_ext.runtime.reshard.Piece` per (kind, box) with the names every checkpoint uses (``master/KEY``,
``exp_avg/KEY``, ``exp_avg_sq/KEY``; ``param/KEY`` is the model's own replicated tensor). The gated
``linear_fc1`` (``[gate_r; up_r]`` on each TP rank) is the ``(2, f, h)`` view of its LocalShard, whose row-major
order is the parameter's, so its flat range maps to boxes of the ``(2, F, h)`` global tensor the same way.

The model's bf16 parameters are whole on every DP rank only after the updated ranges are all-gathered; with
``--overlap-param-gather`` that happens in the next forward pass, so Megatron-LM gathers them before every save
(``save_checkpoint_and_time``'s ``force_param_sync``), and ``param/KEY`` is read after it.

Saving and loading are the same pieces: loading creates the torch optimizer's state of every shard first
(:func:`hetu_ext.megatron.state.state_pieces`) and the reshard engine writes through the views. Every call checks
over the DP group that the ranks' flat ranges tile each parameter's local tensor exactly once
(:func:`check_ranges`), so a save never silently misses or doubles an element of the optimizer state;
:func:`params_match_masters` checks after a load that each model parameter is its fp32 master rounded, as
Megatron keeps them (it copies masters into the model after each step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hetu_ext.errors import HetuExtError
from hetu_ext.plan.core.layout import Box
from hetu_ext.runtime.reshard import Piece

from .weights import LocalShard

MOMENTS = ("exp_avg", "exp_avg_sq")
"""The moments Megatron's DistributedOptimizer keeps (it takes Adam only)."""


def flat_boxes(start: int, stop: int, shape: tuple[int, ...]) -> list[tuple[int, int, Box]]:
    """The elements ``[start, stop)`` of a row-major tensor of ``shape`` as boxes: ``[(a, b, box)]``, in order,
    where elements ``[a, b)`` are exactly the box (so a flat buffer's ``[a - start, b - start)`` views it).

    At most ``2 (ndim - 1) + 1`` boxes: a partial first row (itself split over the inner axes), the full rows
    between, a partial last row. ``shape (3, 4)``, ``[2, 11)``: ``(0:1, 2:4)``, ``(1:2, 0:4)``, ``(2:3, 0:3)``.
    """
    numel = math.prod(shape)
    if not 0 <= start <= stop <= numel:
        raise ValueError(f"flat range [{start}, {stop}) is not within a tensor of shape {list(shape)} "
                         f"({numel} elements)")
    if start == stop:
        return []
    if len(shape) <= 1:
        return [(start, stop, ((start, stop),) if shape else ())]
    row, inner = math.prod(shape[1:]), shape[1:]

    def in_row(r: int, a: int, b: int) -> list[tuple[int, int, Box]]:
        return [(r * row + x, r * row + y, ((r, r + 1), *box)) for x, y, box in flat_boxes(a, b, inner)]

    first_full, end_full = -(-start // row), stop // row  # the full rows are [first_full, end_full)
    if first_full > end_full:  # within one row
        return in_row(start // row, start % row, stop % row)
    out = in_row(start // row, start % row, row) if start % row else []
    if end_full > first_full:
        out.append((first_full * row, end_full * row, ((first_full, end_full), *((0, n) for n in inner))))
    if stop % row:
        out += in_row(end_full, 0, stop % row)
    return out


def distributed_optimizers(optimizer) -> list:
    """Megatron's DistributedOptimizers inside ``optimizer`` (chained or not); [] for any other optimizer."""
    if optimizer is None:
        return []
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return [o for o in getattr(optimizer, "chained_optimizers", [optimizer]) if isinstance(o, DistributedOptimizer)]


@dataclass(frozen=True)
class OwnedRange:
    """What one DP rank keeps of one parameter: the flat range of its local tensor, and the 1-D tensors of that
    range (``master`` under --bf16 / --fp16, else None; ``state``: the torch optimizer's state, moments and step)."""

    shard: LocalShard
    start: int
    stop: int
    master: torch.Tensor | None
    state: dict

    def pieces(self) -> list[Piece]:
        """The owned range of the master and of every moment present, as pieces of the global tensors."""
        flats = {"master": self.master} if self.master is not None else {}
        flats.update({m: self.state[m] for m in MOMENTS if m in self.state})
        s, out = self.shard, []
        for a, b, box in flat_boxes(self.start, self.stop, tuple(s.data.shape)):
            shape = tuple(hi - lo for lo, hi in box)
            where = tuple((sl.start + lo, sl.start + hi) for sl, (lo, hi) in zip(s.slices, box))
            out.extend(Piece(f"{kind}/{s.key}", s.index, where, flat[a - self.start:b - self.start].view(shape))
                       for kind, flat in flats.items())
        return out


def owned_ranges(optimizer, shards: list[LocalShard]) -> list[OwnedRange]:
    """This DP rank's :class:`OwnedRange` of every parameter of ``shards`` that it owns a part of, after
    checking over each DistributedOptimizer's DP group that the ranges tile every parameter exactly once."""
    out = []
    for dopt in distributed_optimizers(optimizer):
        if getattr(dopt, "is_stub_optimizer", False):
            continue
        if dopt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            raise HetuExtError("--use-precision-aware-optimizer keeps the distributed optimizer's masters and "
                               "moments inside its fused optimizer, which hetu checkpoints have no rule for; drop it "
                               "or use --hetu-ckpt-format auto")
        held = {id(p) for buffer in dopt.buffers for p in buffer.param_index_map}
        mine = [s for s in shards if id(s.param) in held]
        ranges = []
        for s in mine:
            if s.param in dopt.model_param_gbuf_map:  # this rank owns part of it
                rng = dopt._get_model_param_range_map(s.param)["param"]
                ranges.append((rng.start, rng.end))
            else:
                ranges.append((0, 0))
        check_ranges(mine, ranges, dopt.data_parallel_group)
        for s, (start, stop) in zip(mine, ranges):
            if start == stop:
                continue
            group, order = dopt.model_param_group_index_map[s.param]
            main = dopt.optimizer.param_groups[group]["params"][order]
            if main.numel() != stop - start:
                raise AssertionError(f"{s.key}: the optimizer's shard has {main.numel()} elements, its range "
                                     f"[{start}, {stop})")
            master = main if s.param.dtype in (torch.float16, torch.bfloat16) else None
            out.append(OwnedRange(s, start, stop, master, dopt.optimizer.state.get(main, {})))
    return out


def check_ranges(shards: list[LocalShard], ranges: list[tuple[int, int]], group) -> None:
    """Every element of every parameter's local tensor is owned by exactly one rank of ``group`` (collective:
    every rank passes the same parameters in the same order); raises naming the parameters that are not."""
    local = torch.tensor(ranges, dtype=torch.int64).reshape(len(ranges), 2)
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local, group=group)
    bad = []
    for i, s in enumerate(shards):
        spans = sorted((int(g[i, 0]), int(g[i, 1])) for g in gathered if g[i, 1] > g[i, 0])
        ends = [0] + [b for _, b in spans]
        if any(a != end for (a, _), end in zip(spans, ends)) or ends[-1] != s.param.numel():
            bad.append(f"{s.key}{list(s.index)} (ranges {spans} of {s.param.numel()} elements)")
    if bad:
        raise HetuExtError(f"the distributed optimizer's ranges do not cover {len(bad)} parameter(s) exactly once: "
                           f"{', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''}; hetu_ext refuses to save or load "
                           "a partial optimizer state")


def distopt_pieces(placement, shards: list[LocalShard]) -> list[Piece]:
    """The model's parameters (``param/KEY``, each rank's whole local tensor) and this DP rank's masters and
    moments (``master/KEY``, ``exp_avg/KEY``, ``exp_avg_sq/KEY``: boxes of its flat ranges)."""
    pieces = [Piece(f"param/{s.key}", s.index, tuple((sl.start, sl.stop) for sl in s.slices), s.data.data)
              for s in shards]
    for owned in owned_ranges(placement.optimizer, shards):
        pieces.extend(owned.pieces())
    return pieces


@torch.no_grad()
def params_match_masters(placement, shards: list[LocalShard]) -> str | None:
    """Every model parameter must equal its fp32 master rounded to the model's dtype on the range this rank owns
    (Megatron keeps them so: after each step it copies the masters into the model, then gathers the ranges), at a
    save and after a load. Returns the first that does not, or None (collective over the DP groups, as
    :func:`owned_ranges`)."""
    for owned in owned_ranges(placement.optimizer, shards):
        if owned.master is None:
            continue
        model = owned.shard.param.detach().reshape(-1)[owned.start:owned.stop]
        rounded = owned.master.to(model.dtype)
        if not torch.equal(model, rounded):
            worst = float((model.float() - rounded.float()).abs().max())
            return (f"{owned.shard.key}{list(owned.shard.index)}: the {model.dtype} parameters are not the fp32 "
                    f"masters rounded (max difference {worst:.3e})")
    return None
