"""A lower bound on any grouping of a step (pure): the grouping relaxation (:mod:`.relaxation`) on the whole
program and on pairs of strategies."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hetu_ext.data.cost import CostTable
from hetu_ext.model.spec import ModelSpec
from hetu_ext.plan.core.replicas import replica_specs
from hetu_ext.plan.hotspa.relaxation import relaxation
from hetu_ext.plan.hotspa.grouping import check_capacity
from hetu_ext.plan.core.strategies import StrategySet


PAIR_ANCHOR_LEVELS = 48
"""Thresholds of the anchor rows (row 7) in a two-strategy program of :func:`grouping_bound_s`: the whole program's
12, spread over every length any strategy holds, leave a pipelined group's longest members between two of them
(32 GPUs at 16K on Wikipedia: 5.17 s for a TP 1 x PP 8 x DP 4 group whose packer bound is 5.35 s); with two
strategies, 48 still solve in seconds."""


def grouping_bound_s(lengths: Sequence[int], strategies: StrategySet, spec: ModelSpec, cost: CostTable, *,
                     fixed_s: Sequence[float] | None = None, time_limit_s: float = 120.0,
                     min_strategies: int = 1, upper_s: float | None = None, bisections: int = 3,
                     by_pairs: bool = True) -> float:
    """A lower bound on ``sum over groups (the packer's time of the group under its strategy + fixed_s[k])``
    over every grouping of ``lengths`` into groups under ``strategies`` (any split, contiguous or not; at least
    one sequence per pipeline of a group's strategy), ``fixed_s[k]`` a time every used strategy adds (its
    all-reduce, its switch; default 0): what HotSPa can reach at best under the packer's cost model. The
    mixed-integer relaxation of :mod:`hetu_ext.plan.hotspa.relaxation` (its docstring has the proof), solved by
    scipy's HiGHS; its dual bound is returned, so a time limit keeps it a bound.

    ``upper_s``: the price of a grouping already known (e.g. the best strategy alone); groupings dearer than it
    need no bound, which lets the relaxation count every pipeline's fill and drain (row 1); the result is then
    ``min(upper_s, relaxation)``, and ``bisections`` more relaxations look for a lower U still out of reach
    (``min(U, relaxation at U)`` is a bound for every U; each halves the interval, each is a HiGHS solve).
    ``min_strategies``: bound only the groupings that use at least that many strategies (2 with each strategy
    alone priced exactly apart, e.g. by the packer, gives a tighter bound on every grouping: the least of the
    two); infinity when fewer strategies hold a sequence than that.

    ``by_pairs`` (with ``upper_s`` and ``min_strategies=2``): a grouping of two strategies or more uses exactly
    two, or at least three, so the least of one program per pair of strategies (only groupings using both; a
    small program, so the anchor rows get :data:`PAIR_ANCHOR_LEVELS` thresholds) and of the whole program with at
    least three is a bound too. Each program only asks for groupings within U (none: U bounds them). Measured:
    one Wikipedia step over 32 GPUs (15 strategies, 106 programs) in about 60 s on 2 cores."""
    check_capacity(lengths, strategies)
    plans = [st.plan for st in strategies.items]
    replicas = [replica_specs(st.plan, spec, cost, max_pack_tokens=st.max_len) for st in strategies.items]
    fixed = list(fixed_s) if fixed_s is not None else [0.0] * len(plans)
    every = tuple(range(len(plans)))
    programs = [(every, min_strategies, {})]
    if by_pairs and upper_s is not None and min_strategies == 2 and len(plans) > 2:
        longest = max(lengths, default=0)
        holds = [max(r.token_capacity for r in reps) >= longest for reps in replicas]
        rows = {"anchor_levels": PAIR_ANCHOR_LEVELS, "binary": 2 * max(len(reps) for reps in replicas) + 16}
        programs = [(every, 3, {})] + [((k, q), 2, rows) for k in every for q in every[k + 1:] if holds[k] or holds[q]]

    def bound(program, upper: float | None) -> float:
        keep, least, rows = program
        return relaxation(lengths, [plans[k] for k in keep], [replicas[k] for k in keep],
                          fixed_s=[fixed[k] for k in keep], upper_s=upper, min_strategies=least,
                          time_limit_s=time_limit_s, cutoff=upper is not None and len(programs) > 1, **rows).bound_s

    try:
        values = [bound(program, upper_s) for program in programs]
    except RuntimeError:  # HiGHS bounded one program not at all within its time: the whole one, as without pairs
        programs = [(every, min_strategies, {})]
        values = [bound(programs[0], upper_s)]
    best = min(values)
    if upper_s is None or not np.isfinite(best):
        return best
    # min(U, relaxation at U) bounds every grouping for any U: bisect for the largest U every program proves out
    # of reach (one that proved the first U out of reach proved its groupings all cost U or more: no new solve)
    open_ = [p for p, v in zip(programs, values) if v < upper_s * (1 - 1e-9)]
    lo, hi = best, upper_s
    for _ in range(bisections):
        if hi - lo <= 1e-4 * hi:
            break
        mid = (lo + hi) / 2
        try:
            proven = all(bound(program, mid) >= mid * (1 - 1e-9) for program in open_)
        except RuntimeError:  # no bound within the time: not proven
            proven = False
        if proven:
            lo = best = mid
        else:
            hi = mid
    return best
