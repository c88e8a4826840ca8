"""Packing documents into microbatches and assigning them to replicas (pure: numpy only, no clocks).

A replica (pipeline) of ``pp`` stages runs its microbatches under 1F1B; its predicted time is::

    T_r = sum_m t(m) + (pp - 1) max_m t(m),      t(m) = max_j (a_j Q_m + b_j S_m + c_j)   seconds

with ``Q_m`` / ``S_m`` the sum of squared / plain document lengths of microbatch m and ``(a_j, b_j, c_j)`` stage j's
:class:`~hetu_ext.data.cost.LengthCost` (already times its layers and slowdown). The fill and drain of the
pipeline cost ``pp - 1`` times the longest microbatch; a stage slower than the others sets the pace.

Methods (all keep every document index exactly once and every microbatch within its replica's token capacity):

* ``megatron``: documents in order, a new microbatch whenever the next one does not fit; packs dealt to replicas
  in contiguous equal runs. Given the pieces of :func:`hetu_ext.data.lengths.concat_split` (concatenate, cut
  every ``max_len`` tokens) this is Megatron's packing with per-document attention.
* ``ffd``: first-fit-decreasing by tokens into the fewest packs, dealt round-robin (equal microbatch counts).
* ``greedy``: DeepSpeed-style: documents, longest first, to the replica with the fewest tokens; each replica's
  share packed first-fit in that order.
* ``hetu``: ours, two stages (Hydraulis, :mod:`hetu_ext.data.two_stage`). Stage 1 spreads documents, most
  expensive first, to the replica whose estimated time after taking it is lowest (speed, depth and capacity
  aware; O(classes + log R) per document); with pipelines it also tries level-based first-fit-decreasing, which
  keeps long documents together so fewer replicas pay a long fill and drain (O(N R) numpy per level grid).
  Stage 2 packs each share into the microbatch count that minimises ``sum + (pp - 1) max`` (first-fit-decreasing
  for pp = 1; capacity-aware longest-processing-time for counts near the best estimate when pp > 1). Then
  documents are moved or swapped from the slowest replica while stage 2 confirms it helps.

:func:`~hetu_ext.data.packing_bound.lower_bound_s` certifies each result: no assignment of the same documents can
make the slowest replica faster than it (relaxations, see its docstring).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .cost import LengthCost
from .two_stage import assign_hetu
from .packing_bound import lower_bound_s

logger = logging.getLogger(__name__)

METHODS = ("megatron", "ffd", "greedy", "hetu")


@dataclass(frozen=True, kw_only=True)
class ReplicaSpec:
    """One pipeline (data-parallel replica) of the running Plan, as the packer sees it."""

    stage_costs: tuple[LengthCost, ...]
    """One per pipeline stage, in order, already multiplied by that stage's layer count and slowdown."""
    token_capacity: int
    """Most tokens one microbatch may hold (memory bound); also the longest document this replica takes."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "stage_costs", tuple(self.stage_costs))
        if not self.stage_costs or not all(isinstance(c, LengthCost) for c in self.stage_costs):
            raise ValueError(f"ReplicaSpec: stage_costs must be a non-empty sequence of LengthCost, got "
                             f"{self.stage_costs!r}")
        if isinstance(self.token_capacity, bool) or not isinstance(self.token_capacity, int) \
                or self.token_capacity < 1:
            raise ValueError(f"ReplicaSpec: token_capacity must be an integer >= 1, got {self.token_capacity!r}")

    @property
    def pp(self) -> int:
        return len(self.stage_costs)

    def microbatch_s(self, sum_sq: float, sum_tokens: float) -> float:
        """Seconds of one microbatch on the slowest stage (``t(m)`` of the module docstring)."""
        return max(c.moments_s(sum_sq, sum_tokens) for c in self.stage_costs)

    def time_s(self, packs: Sequence[Sequence[int]], lengths: Sequence[int]) -> float:
        """Predicted 1F1B seconds of running ``packs`` (indices into ``lengths``); 0 for no packs."""
        times = []
        for p in packs:
            pack = [lengths[i] for i in p]
            times.append(self.microbatch_s(sum([n ** 2 for n in pack]), sum(pack)))
        return sum(times) + (self.pp - 1) * max(times) if times else 0.0


@dataclass(frozen=True)
class Assignment:
    """Which documents each replica's microbatches hold, and the predicted time of each replica."""

    microbatches: tuple[tuple[tuple[int, ...], ...], ...]
    """[replica][microbatch] -> indices into the input lengths, in pack order."""
    predicted_s: tuple[float, ...]
    """Predicted seconds of each replica (module docstring's ``T_r``)."""
    lower_bound_s: float
    """No assignment of these documents to these replicas has a slowest replica faster than this (seconds)."""

    @property
    def gap(self) -> float:
        """Certified optimality gap: ``max(predicted_s) / lower_bound_s - 1`` (0 for an empty batch)."""
        return max(self.predicted_s) / self.lower_bound_s - 1 if self.lower_bound_s > 0 else 0.0

    @property
    def max_over_mean(self) -> float:
        """Slowest replica over the mean replica (1.0 is perfect balance)."""
        mean = sum(self.predicted_s) / len(self.predicted_s)
        return max(self.predicted_s) / mean if mean > 0 else 1.0


def assign(lengths: Sequence[int], replicas: Sequence[ReplicaSpec], *, method: str = "hetu",
           bound_s: float | None = None) -> Assignment:
    """Assign documents of ``lengths`` tokens to ``replicas`` and pack them into microbatches.

    Contract: every index of ``lengths`` appears exactly once; each microbatch's token sum is at most its
    replica's ``token_capacity``; the same input gives the same output. Documents longer than every replica's
    capacity (the baselines: than the smallest capacity) raise ValueError: split them first
    (:func:`hetu_ext.data.lengths.split_long`). A replica may get no microbatch when documents are fewer.
    ``bound_s``: ``lower_bound_s(lengths, replicas)`` when the caller has already computed it (the same value: it
    is not recomputed)."""
    if method not in METHODS:
        raise ValueError(f"assign: unknown method {method!r}; choose one of {list(METHODS)}")
    if not replicas:
        raise ValueError("assign: no replicas given; pass one ReplicaSpec per pipeline of the plan")
    s = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if s.size and s.min() < 1:
        raise ValueError(f"assign: document lengths must be >= 1 token, got {int(s.min())} at index "
                         f"{int(s.argmin())}")
    caps = [r.token_capacity for r in replicas]
    limit = max(caps) if method == "hetu" else min(caps)
    if s.size and s.max() > limit:
        raise ValueError(f"assign({method}): document {int(s.argmax())} has {int(s.max())} tokens, more than the "
                         f"token capacity {limit}; split documents longer than the capacity first "
                         "(hetu_ext.data.lengths.split_long)")
    bound = lower_bound_s(s, replicas) if bound_s is None else bound_s
    if method == "megatron":
        packs = _in_order(s, limit)
        per = _deal_contiguous(packs, len(replicas))
    elif method == "ffd":
        per = _deal_round_robin(_first_fit_decreasing(s, np.arange(s.size), limit), len(replicas))
    elif method == "greedy":
        per = _greedy_tokens(s, replicas)
    else:
        per = assign_hetu(s, replicas, bound_s=bound)
    lengths_list = s.tolist()
    times = tuple(r.time_s(p, lengths_list) for r, p in zip(replicas, per))
    out = Assignment(microbatches=tuple(tuple(tuple(int(i) for i in p) for p in rep) for rep in per),
                     predicted_s=times, lower_bound_s=bound)
    _check(out, s, replicas)
    logger.debug("assign(%s): %d documents, %d replicas, max %.4g s, bound %.4g s, gap %.3f", method, s.size,
                 len(replicas), max(times), out.lower_bound_s, out.gap)
    return out


def _check(out: Assignment, s: np.ndarray, replicas: Sequence[ReplicaSpec]) -> None:
    """Internal invariants (every index once, capacities); a failure is a bug of this module."""
    flat = [i for rep in out.microbatches for p in rep for i in p]
    assert len(flat) == s.size and len(set(flat)) == s.size, "packing lost or repeated a document"
    lengths = s.tolist()
    for rep, spec in zip(out.microbatches, replicas):
        for p in rep:
            assert p and sum([lengths[i] for i in p]) <= spec.token_capacity, "packing overfilled a microbatch"


def _in_order(s: np.ndarray, capacity: int) -> list[list[int]]:
    """Documents in order; a new pack whenever the next one does not fit."""
    packs: list[list[int]] = []
    used = capacity + 1
    for i, n in enumerate(s.tolist()):
        if used + n > capacity:
            packs.append([])
            used = 0
        packs[-1].append(i)
        used += n
    return packs


def _first_fit_decreasing(s: np.ndarray, idx: np.ndarray, capacity: int) -> list[list[int]]:
    """First-fit-decreasing by tokens of documents ``idx`` (ties: lower index first)."""
    from .two_stage_microbatches import first_fit

    order = idx[np.lexsort((idx, -s[idx]))]
    return first_fit(order.tolist(), s[order].tolist(), capacity)


def _deal_contiguous(packs: list[list[int]], r: int) -> list[list[list[int]]]:
    base, extra = divmod(len(packs), r)
    out, start = [], 0
    for k in range(r):
        stop = start + base + (k < extra)
        out.append(packs[start:stop])
        start = stop
    return out


def _deal_round_robin(packs: list[list[int]], r: int) -> list[list[list[int]]]:
    return [packs[k::r] for k in range(r)]


def _greedy_tokens(s: np.ndarray, replicas: Sequence[ReplicaSpec]) -> list[list[list[int]]]:
    """DeepSpeed-style: longest document first to the replica with the fewest tokens; first-fit packs."""
    r = len(replicas)
    tokens = np.zeros(r, dtype=np.int64)
    shares: list[list[int]] = [[] for _ in range(r)]
    for i in np.lexsort((np.arange(s.size), -s)).tolist():
        k = int(np.argmin(tokens))
        shares[k].append(i)
        tokens[k] += s[i]
    capacity = min(x.token_capacity for x in replicas)
    out = []
    for share in shares:
        packs: list[list[int]] = []
        free: list[int] = []
        for i in share:
            n = int(s[i])
            k = next((k for k, room in enumerate(free) if room >= n), None)
            if k is None:
                packs.append([i])
                free.append(capacity - n)
            else:
                packs[k].append(i)
                free[k] -= n
        out.append(packs)
    return out
