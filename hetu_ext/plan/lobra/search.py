"""LobRA's ranking of the fillings (pure): the ``keep`` fillings of least summed :func:`capacity_bound_s`, found by
branch and bound over the enumeration of :func:`fillings` instead of scoring every filling, with the same result.

**Why it is exact.** The depth-first search visits pool strategies in pool order and, per strategy, counts from
the most down to 0, exactly as :func:`fillings`; so its leaves come in the enumeration's order, and each is scored
by :func:`sorted_capacity_bound_s` (the same float as :func:`capacity_bound_s`). The exhaustive ranking is a
stable sort: by score, ties in enumeration order. A subtree is cut only once ``keep`` fillings are held and
:func:`partial_bound_s` (x ``1 - 1e-9``, against rounding) is >= the ``keep``-th held score. Every filling in
that subtree scores >= its bound (below) and comes later in the enumeration than every held filling, so it ranks
after all of them in the exhaustive ranking, and fillings found later only lower the ``keep``-th score: it can
never be among the ``keep`` best. The one-strategy fillings, which are always evaluated, are scored apart.

**Why the bound is a lower bound.** A node fixes the counts of the first ``i`` strategies (``decided``, those
with a count) and leaves ``left`` GPUs for the later ones (``future``; only those of at most ``left`` GPUs can
appear). Any completion's capacity bound is, per step, the largest of: (1) the longest sequence alone on the
best chosen replica holding it: the completion's holders are among the decided and future ones holding it, so
the least of those is lower; (2) per capacity level theta, the work above theta priced on the first holder's
cost (``ref``) over ``speed = sum_r n_r / m_r``. The levels ``0`` and the decided strategies' capacities are
levels of every completion, so their terms are each lower bounds of the maximum. If a decided strategy holds
more than theta, ``ref`` is the first such (decided ones come first in pool order), the decided part of the
speed is known, and the future part, ``sum n_r / m_r = sum (n_r g_r) / (g_r m_r)`` with ``sum n_r g_r <= left``,
is at most ``left x max_r 1 / (g_r m_r)``; the work over a larger speed is a lower bound. Else ``ref`` is some
future strategy q and every holder is q or a later one: the least over q of that bound. Summed over steps (as
the score), a lower bound on every completion's score.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from hetu_ext.plan.core.replicas import ReplicaShape
from hetu_ext.plan.lobra.bounds import SortedLengths, sorted_capacity_bound_s

MARGIN = 1 - 1e-9
"""A partial filling's bound is scaled by this before comparing (float rounding of a different summation)."""

Chosen = tuple[tuple[ReplicaShape, int], ...]


@dataclass(frozen=True)
class Ranking:
    """The fillings to evaluate exactly, in the order the exhaustive ranking gives them (the ``keep`` best by
    summed capacity bound, then the other one-strategy fillings by score), and the search's work."""

    candidates: list[Chosen]
    scored: int
    """Fillings scored (the exhaustive ranking scores every filling holding the longest sequence)."""
    cut: int
    """Subtrees cut by the bound."""


def _cost(shape: ReplicaShape):
    return shape.replica.stage_costs[0]


def _slowness(shape: ReplicaShape, ref: ReplicaShape) -> float:
    """m_r of :func:`sorted_capacity_bound_s`: the least seconds of ``shape`` per second of ``ref``'s work."""
    return min(_cost(shape).a / _cost(ref).a, _cost(shape).b / _cost(ref).b)


def _work(step: SortedLengths, first: int, ref: ReplicaShape) -> float:
    return _cost(ref).a * step.sq[first] + _cost(ref).b * step.tokens[first]


def _level_bound(step: SortedLengths, first: int, decided: Sequence[tuple[ReplicaShape, int]],
                 future: Sequence[ReplicaShape], left: int) -> float:
    """A lower bound on one capacity level's term of every completion (``decided``, ``future``: those holding
    more than the level; the module docstring, (2))."""
    if decided:
        ref = decided[0][0]
        rate = max((1 / (st.gpus * _slowness(st, ref)) for st in future), default=0.0)
        return _work(step, first, ref) / (sum(n / _slowness(st, ref) for st, n in decided) + left * rate)
    if not future:
        return float("inf")  # no completion holds these sequences
    return min(_work(step, first, q) / (left * max(1 / (st.gpus * _slowness(st, q)) for st in future[k:]))
               for k, q in enumerate(future))


def _step_bound(step: SortedLengths, decided: Sequence[tuple[ReplicaShape, int]], future: Sequence[ReplicaShape],
                left: int) -> float:
    """A lower bound on :func:`sorted_capacity_bound_s` of ``step`` for every completion of a partial filling."""
    s = step.s
    if not s.size:
        return 0.0
    holding = [st for st, _ in decided if st.capacity >= s[-1]] + [st for st in future if st.capacity >= s[-1]]
    if not holding:
        return float("inf")
    bound = min(_cost(st).a * s[-1] ** 2 + _cost(st).b * s[-1] + _cost(st).c for st in holding)
    for theta in [0] + sorted({st.capacity for st, _ in decided}):
        first = int(step.s.searchsorted(theta, side="right"))
        if first >= s.size:
            break
        bound = max(bound, _level_bound(step, first, [(st, n) for st, n in decided if st.capacity > theta],
                                        [st for st in future if st.capacity > theta], left))
    return bound


def partial_bound_s(steps: Sequence[SortedLengths], decided: Sequence[tuple[ReplicaShape, int]],
                    future: Sequence[ReplicaShape], left: int) -> float:
    """A lower bound on the summed capacity bound of every filling that keeps ``decided`` (strategy, count > 0,
    in pool order) and spends at most ``left`` more GPUs on ``future`` (the later pool strategies); the module
    docstring."""
    future = [st for st in future if st.gpus <= left]
    return sum(_step_bound(step, decided, future, left) for step in steps)


def rank_fillings(pool: list[ReplicaShape], steps: Sequence[SortedLengths], *, world_size: int, longest: int,
                  keep: int) -> Ranking:
    """The fillings :func:`hetu_ext.plan.lobra.deployment.plan_deployment` evaluates exactly, as scoring every
    filling of :func:`fillings` holding ``longest`` and sorting them would give them (module docstring)."""
    smallest = min(s.gpus for s in pool)
    held: list[tuple[float, tuple[int, ...], Chosen]] = []  # (score, enumeration key, filling), sorted
    width = max(keep, 1)
    work = {"scored": 0, "cut": 0}

    def score(chosen: Chosen) -> float:
        work["scored"] += 1
        return sum(sorted_capacity_bound_s(step, chosen) for step in steps)

    def visit(i: int, left: int, counts: tuple[int, ...]) -> None:
        if i == len(pool):
            chosen = tuple((s, n) for s, n in zip(pool, counts) if n)
            if left < smallest and chosen and max(s.capacity for s, _ in chosen) >= longest:
                bisect.insort(held, (score(chosen), tuple(-n for n in counts), chosen), key=lambda h: h[:2])
                del held[width:]
            return
        if len(held) == width and partial_bound_s(
                steps, [(s, n) for s, n in zip(pool, counts) if n], pool[i:], left) * MARGIN >= held[-1][0]:
            work["cut"] += 1
            return
        for n in range(left // pool[i].gpus, -1, -1):
            visit(i + 1, left - n * pool[i].gpus, counts + (n,))

    visit(0, world_size, ())
    best = held[:keep]
    alone = []
    for k, s in enumerate(pool):  # one-strategy fillings (at most one per strategy: the most replicas)
        n, key = world_size // s.gpus, tuple(-(world_size // s.gpus) if j == k else 0 for j in range(len(pool)))
        if n and world_size - n * s.gpus < smallest and s.capacity >= longest and key not in {h[1] for h in best}:
            alone.append((score(((s, n),)), key, ((s, n),)))
    return Ranking(candidates=[chosen for _, _, chosen in best + sorted(alone, key=lambda h: h[:2])],
                   scored=work["scored"], cut=work["cut"])
