"""Hydraulis's dynamic program (pure): the pool of replica shapes, the length histogram, and the least time in
which at most n GPUs train the sequences of the first j buckets (the package docstring, steps 1-3)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from hetu_ext.data.cost import CostTable
from hetu_ext.data.lengths import split_long
from hetu_ext.model import inventory
from hetu_ext.model.spec import ModelSpec
from hetu_ext.plan.core.plan import uniform_plan
from hetu_ext.plan.core.replicas import ReplicaShape, replica_specs


MAX_PP = 16
"""Deepest pipeline a pool shape may have."""


def _coefficients(shape: ReplicaShape) -> tuple[float, float, float]:
    """(a, b, c) of the shape's slowest stage (each the largest over its stages)."""
    stages = shape.replica.stage_costs
    return max(c.a for c in stages), max(c.b for c in stages), max(c.c for c in stages)


def shape_pool(model: ModelSpec, cost: CostTable, *, world_size: int, max_len: int, gpus_per_node: int = 8,
               slowdowns: Mapping[int, float] | None = None, prune: bool = True,
               cp_degrees: tuple[int, ...] = (1,)) -> list[ReplicaShape]:
    """Every replica shape TP x PP (or TP x CP, CP of ``cp_degrees`` without PP, the sequence split in 2 cp
    chunks; default: no CP, which the plan runtime does not run yet) of at most ``world_size`` GPUs whose memory holds a token (module docstring, step 1), its capacity at
    most ``max_len``; with ``prune``, shapes another one dominates are dropped.
    ``slowdowns``: a straggler's factor scales the time of every shape (the pool prices a replica as if it
    included the slowest rank named, so the candidates stay conservative)."""
    slow = max(dict(slowdowns or {}).values(), default=1.0)
    out = []
    for tp in sorted(cost.per_tp):
        if tp > gpus_per_node or tp > world_size or inventory.tp_problems(model, tp):
            continue
        for pp, cp in [(pp, 1) for pp in range(1, min(MAX_PP, model.num_layers) + 1)] + [
                (1, cp) for cp in cp_degrees if cp > 1 and model.seq_length % (2 * cp) == 0]:
            if model.num_layers % pp or tp * cp * pp > world_size:
                continue
            plan = uniform_plan(world_size=tp * cp * pp, tp=tp, pp=pp, cp=cp, num_layers=model.num_layers)
            try:
                (replica,) = replica_specs(plan, model, cost, max_pack_tokens=max_len,
                                           slowdowns=dict.fromkeys(range(tp * cp * pp), slow))
            except ValueError:
                continue  # not one token fits
            out.append(ReplicaShape(tp=tp, pp=pp, capacity=replica.token_capacity, replica=replica, cp=cp))
    if not prune:
        return out
    keys = [(s.gpus, s.pp, -s.capacity, *_coefficients(s)) for s in out]
    # a CP shape never prunes a CP-free one: those are the only homes (the switching layer does not run CP)
    return [s for k, s in enumerate(out) if not any(
        j != k and all(x <= y for x, y in zip(keys[j], keys[k])) and (keys[j] != keys[k] or j < k)
        and (out[j].cp > 1) <= (s.cp > 1) for j in range(len(out)))]


@dataclass(frozen=True)
class Histogram:
    """Lengths in buckets (ascending, none empty): per bucket the count, tokens, squared tokens and longest."""

    count: np.ndarray
    tokens: np.ndarray
    squares: np.ndarray
    longest: np.ndarray

    def __len__(self) -> int:
        return int(self.count.size)


def length_histogram(lengths: Sequence[int] | np.ndarray, *, max_len: int, edges: Sequence[int] = (),
                     buckets: int = 32, batch_tokens: int | None = None) -> Histogram:
    """The lengths (pieces of at most ``max_len``, :func:`hetu_ext.data.lengths.split_long`) in buckets whose
    upper edges are ``edges`` (below ``max_len``), ``max_len`` and ``buckets`` quantiles (half by count, half by
    tokens); empty buckets dropped. ``batch_tokens``: counts scaled so that the whole is one global batch of that
    many tokens (else the lengths are one batch)."""
    s = split_long(np.asarray(lengths, dtype=np.int64).reshape(-1), max_len).length.astype(np.int64)
    if s.size == 0:
        raise ValueError("Hydraulis: no lengths given; pass a length file with one token count per line")
    s = np.sort(s)
    cut = {int(e) for e in edges if 0 < e < max_len} | {max_len}
    half = max(1, buckets // 2)
    cut |= {int(x) for x in np.quantile(s, np.arange(1, half) / half, method="higher")}
    cum = np.cumsum(s)
    cut |= {int(s[min(s.size - 1, int(np.searchsorted(cum, cum[-1] * q / half)))]) for q in range(1, half)}
    upper = np.array(sorted(cut), dtype=np.int64)
    which = np.searchsorted(upper, s, side="left")  # bucket b holds (upper[b-1], upper[b]]
    scale = 1.0 if batch_tokens is None else batch_tokens / float(cum[-1])
    f = s.astype(np.float64)
    count = np.bincount(which, minlength=upper.size).astype(np.float64)
    tokens = np.bincount(which, weights=f, minlength=upper.size)
    squares = np.bincount(which, weights=f * f, minlength=upper.size)
    longest = np.zeros(upper.size)
    np.maximum.at(longest, which, f)
    keep = count > 0
    return Histogram(count=count[keep] * scale, tokens=tokens[keep] * scale, squares=squares[keep] * scale,
                     longest=longest[keep])


def group_cost(shape: ReplicaShape, squares, tokens, longest, replicas):
    """Predicted seconds of ``replicas`` replicas of ``shape`` training a group of sequences with these squared
    and plain token sums and this longest sequence (module docstring, step 3; numpy-broadcast)."""
    a, b, c = _coefficients(shape)
    packs = np.maximum(1.0, np.ceil(tokens / (replicas * shape.capacity)))
    return (a * squares + b * tokens) / replicas + c * packs + (shape.pp - 1) * (a * longest * longest
                                                                                  + b * longest + c)


@dataclass(frozen=True)
class Solution:
    """One of the dynamic program's answers: its predicted time and groups (shape index into the pool,
    replicas, first bucket, stop bucket), the buckets ``[first, stop)``."""

    time_s: float
    groups: tuple[tuple[int, int, int, int], ...]

    def counts(self, pool: Sequence[ReplicaShape]) -> dict[int, int]:
        """Replicas per shape (index into ``pool``)."""
        out: dict[int, int] = {}
        for k, d, _, _ in self.groups:
            out[k] = out.get(k, 0) + d
        return out


def solve(pool: Sequence[ReplicaShape], hist: Histogram, world_size: int) -> list[Solution | None]:
    """``T[world_size][j]`` of the module docstring for every j = 1..B (list index j - 1), with its groups; None
    where no shape holds bucket j's longest sequence within the GPUs."""
    B, N = len(hist), world_size
    cq = np.concatenate([[0.0], np.cumsum(hist.squares)])
    cs = np.concatenate([[0.0], np.cumsum(hist.tokens)])
    T = np.full((B + 1, N + 1), np.inf)
    T[0, :] = 0.0
    choice = np.full((B + 1, N + 1, 3), -1, dtype=np.int64)  # (shape, replicas, i); -1: as with n - 1 GPUs
    n_all = np.arange(N + 1)
    for j in range(1, B + 1):
        m = float(hist.longest[j - 1])
        q, s = cq[j] - cq[:j], cs[j] - cs[:j]  # group (i, j] for i = 0..j-1
        best = np.full(N + 1, np.inf)
        for k, shape in enumerate(pool):
            g = shape.gpus
            if shape.capacity < m or g > N:
                continue
            d = np.arange(1, N // g + 1)
            cost = group_cost(shape, q[:, None], s[:, None], m, d[None, :].astype(np.float64))  # (j, D)
            rest = n_all[None, :] - g * d[:, None]  # (D, N+1): GPUs left for the groups before
            ok = rest >= 0
            vals = np.maximum(T[:j][:, np.where(ok, rest, 0)], cost[:, :, None])  # (j, D, N+1)
            vals[:, ~ok] = np.inf
            flat = vals.reshape(-1, N + 1)
            arg = flat.argmin(axis=0)
            v = flat[arg, n_all]
            better = v < best
            best[better] = v[better]
            choice[j, better] = np.stack([np.full(better.sum(), k), d[arg[better] % d.size],
                                          arg[better] // d.size], axis=1)
        for n in range(1, N + 1):  # at most n GPUs
            if T[j, n - 1] <= best[n]:
                best[n] = T[j, n - 1]
                choice[j, n] = -1
        T[j] = best
    out: list[Solution | None] = []
    for j in range(1, B + 1):
        if not np.isfinite(T[j, N]):
            out.append(None)
            continue
        groups, jj, n = [], j, N
        while jj > 0:
            k, d, i = (int(x) for x in choice[jj, n])
            if k < 0:
                n -= 1
                continue
            groups.append((k, d, i, jj))
            n -= d * pool[k].gpus
            jj = i
        out.append(Solution(time_s=float(T[j, N]), groups=tuple(reversed(groups))))
    return out
