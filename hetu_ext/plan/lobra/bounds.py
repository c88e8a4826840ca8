"""Lower bounds on a step over LobRA's replica shapes (pure): the least step time of divisible work, the
GPU-seconds no deployment beats, and the capacity-aware bound that ranks enumerated deployments."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hetu_ext.plan.core.replicas import ReplicaShape


def least_step_s(work: np.ndarray, solo: np.ndarray, world_size: int) -> float:
    """The least T with ``world_size x T >= sum over sequences of the least work[i, s] over the shapes s with
    solo[i, s] <= T`` (``work``, ``solo``: sequences x shapes, GPU-seconds and seconds alone, inf where a shape
    cannot hold the sequence): a step time bound when every sequence runs on a replica of some shape whose time is
    at least that sequence's alone and the GPUs' summed time covers every sequence's GPU-seconds.
    The allowed work only falls as T grows and the left side rises, so T is where they cross: over the sorted
    solo times ``ts``, ``W_k`` the work allowed at ``ts[k]``, the first k with ``ts[k] >= W_k / G`` gives
    ``min(ts[k], W_{k-1} / G)``."""
    ts = np.unique(solo[np.isfinite(solo)])

    def allowed(t: float) -> float:
        return float(np.where(solo <= t, work, np.inf).min(axis=1).sum())

    lo, hi = 0, ts.size - 1
    if ts[hi] < allowed(ts[hi]) / world_size:
        return allowed(ts[hi]) / world_size
    while lo < hi:  # the first k with ts[k] * G >= W_k
        mid = (lo + hi) // 2
        if ts[mid] * world_size >= allowed(ts[mid]):
            hi = mid
        else:
            lo = mid + 1
    return float(ts[lo]) if lo == 0 else min(float(ts[lo]), allowed(ts[lo - 1]) / world_size)


def work_bound_gpu_s(pool: list[ReplicaShape], batches: list[list[np.ndarray]], *, world_size: int | None = None
                     ) -> float:
    """A certified lower bound on the mean GPU-seconds per step of ANY deployment and dispatch under this cost
    model: every whole sequence priced at the cheapest GPU-seconds any pool strategy gives it (``tp x pp x
    (a s^2 + b s)`` over its stages), with no per-microbatch constant, no pipeline bubble, no idle replica and no
    imbalance. Pass the unpruned pool (``strategy_pool(..., prune=False)``). ``1 - bound / homogeneous`` is the
    largest saving over homogeneous replicas that this cost model allows, whatever the planner does (a bound for
    dispatches of whole sequences, as LobRA's; Megatron-style packs cut sequences and are not covered).

    With ``world_size`` (the deployment's GPUs) it is tighter: a replica runs each of its sequences through every
    stage, so its time is at least that sequence alone (``pp (a s^2 + b s + c)``); a step of T seconds can only
    put a sequence on strategies holding it within T, and G x T must cover their least GPU-seconds
    (:func:`least_step_s`); the bound is G x that T per step."""
    totals = []
    for step in batches:
        x = np.concatenate(step).astype(np.float64)
        if world_size is None:
            per_gpu = [(s.gpus * s.replica.stage_costs[0].a, s.gpus * s.replica.stage_costs[0].b) for s in pool]
            totals.append(float(np.min([a * x * x + b * x for a, b in per_gpu], axis=0).sum()))
            continue
        work = np.full((x.size, len(pool)), np.inf)
        solo = np.full((x.size, len(pool)), np.inf)
        for k, s in enumerate(pool):
            held = x <= s.capacity
            stage = s.replica.stage_costs[0]
            work[:, k] = np.where(held, s.gpus * (stage.a * x * x + stage.b * x), np.inf)
            solo[:, k] = np.where(held, sum(c.a * x * x + c.b * x + c.c for c in s.replica.stage_costs), np.inf)
        totals.append(world_size * least_step_s(work, solo, world_size))
    return float(np.mean(totals))


def fillings(pool: list[ReplicaShape], world_size: int):
    """Counts per pool strategy using the GPUs with fewer idle than the smallest strategy needs."""
    smallest = min(s.gpus for s in pool)

    def rec(i: int, left: int):
        if i == len(pool):
            if left < smallest:
                yield ()
            return
        for n in range(left // pool[i].gpus, -1, -1):
            for rest in rec(i + 1, left - n * pool[i].gpus):
                yield (n, *rest)

    yield from rec(0, world_size)


def capacity_bound_s(lengths: np.ndarray, chosen: Sequence[tuple[ReplicaShape, int]]) -> float:
    """A fast capacity-aware lower bound on a deployment's step time for ``lengths``: for every capacity level
    theta of the deployment, the sequences longer than theta can only run on replicas holding more than theta,
    and even perfectly divided over those replicas' speeds their work takes at least this long; also the longest
    sequence alone on the best replica that holds it. (hetu_ext.data.packing_bound prices all work on every
    replica, which is loose when only a few replicas hold the long sequences.)"""
    return sorted_capacity_bound_s(SortedLengths.of(lengths), chosen)


@dataclass(frozen=True)
class SortedLengths:
    """A step's lengths sorted, with the suffix sums of their squares and of their tokens from each position (what
    :func:`sorted_capacity_bound_s` reads; computed once per step, not once per deployment)."""

    s: np.ndarray
    sq: np.ndarray
    tokens: np.ndarray

    @classmethod
    def of(cls, lengths: np.ndarray) -> SortedLengths:
        s = np.sort(lengths.astype(np.float64))
        return cls(s, np.cumsum((s * s)[::-1])[::-1], np.cumsum(s[::-1])[::-1])


def sorted_capacity_bound_s(step: SortedLengths, chosen: Sequence[tuple[ReplicaShape, int]]) -> float:
    """:func:`capacity_bound_s` of a step's :class:`SortedLengths` (the same operations in the same order, so the
    same float)."""
    s, sq, tokens = step.s, step.sq, step.tokens
    stages = {id(st): st.replica.stage_costs[0] for st, _ in chosen}
    bound = min(stages[id(st)].a * s[-1] ** 2 + stages[id(st)].b * s[-1] + stages[id(st)].c
                for st, _ in chosen if st.capacity >= s[-1]) if s.size else 0.0
    for theta in [0] + sorted({st.capacity for st, _ in chosen}):
        first = int(np.searchsorted(s, theta, side="right"))
        if first >= s.size:
            break
        holders = [(st, n) for st, n in chosen if st.capacity > theta]
        if not holders:
            return float("inf")
        # price the work on a reference cost; replica r needs at least m_r = min(a_r / a_ref, b_r / b_ref) seconds
        # per reference second of any part of it, so T >= W_ref / sum_r (1 / m_r) however the work is divided
        ref = stages[id(holders[0][0])]
        work = ref.a * sq[first] + ref.b * tokens[first]
        speed = sum(n / min(stages[id(st)].a / ref.a, stages[id(st)].b / ref.b) for st, n in holders)
        bound = max(bound, work / speed)
    return bound
