"""The mixed-integer relaxation of HotSPa's grouping problem (pure: numpy and scipy's HiGHS, no torch).

A grouping puts every sequence of a step into the group of one strategy; each used strategy k trains its group in
``T_k`` (the packer's 1F1B time of its slowest pipeline) and adds a fixed ``F_k`` (all-reduce, switch); the step
takes ``sum over used k of (T_k + F_k)``. A group under strategy k holds at least one sequence per pipeline of k
(HotSPa's rule). This module bounds that sum from below over every grouping (:func:`relaxation`'s dual bound) and
offers the relaxation's own grouping as a planner's candidate (its primal solution, priced exactly by the caller).

The program is built by a :class:`~.relaxation_program.ProgramBuilder` (the per-sequence bounds, the units, the
variables) to which each constraint family of :mod:`.relaxation_rows` adds its rows, in the order of
:data:`~.relaxation_rows.FAMILIES`; each family's docstring holds its proof (why every grouping satisfies it):
assignment, row 1 (work), row 2 (alone), row 3 (pairs), row 4 (size), row 5 (pipelines), row 6 (microbatches), row
7 (anchors), row 8 (packs), and the buckets' lines.

The longest ``binary`` sequences get a binary assignment per strategy; the rest are gathered into buckets of equal
holders (cut at every strategy's capacity) and of lengths within ``bucket_ratio`` of each other, whose share
``x_uk`` is the fraction of the bucket's members in k's group (any split of them is such a point): each bucket row
counts its members exactly (rows 3, 4), and the work of those members is at least that of the cheapest ``x`` count
members, a convex function of x held from below by its supporting lines at 0, 1/4, 1/2, 3/4 and 1 of the count
(exact when the whole bucket goes one way). The parts of a split bucket cannot all be its cheapest members: with
``w_ref`` each member's work on the bucket's first strategy and ``rho_k`` the least ``w_k / w_ref`` over its
members, the work sent to each k, divided by ``rho_k``, adds up to at least the bucket's ``w_ref``. The program
stays small at thousands of sequences. HiGHS's dual bound is returned, so a time limit keeps it a bound (its
default tolerances, 1e-6 relative, apply).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hetu_ext.data.packing import ReplicaSpec
from hetu_ext.plan.hotspa.relaxation_program import ProgramBuilder, RelaxationOptions, f_over_u
from hetu_ext.plan.hotspa.relaxation_rows import FAMILIES

__all__ = ["Relaxed", "RelaxationOptions", "f_over_u", "build_program", "relaxation"]


@dataclass(frozen=True)
class Relaxed:
    bound_s: float
    """HiGHS's dual bound: no grouping (of total at most ``upper_s``, when given) is cheaper."""
    groups: dict[int, list[int]] | None
    """The program's grouping (strategy -> indices into the lengths), each bucket's members split by its shares
    (largest remainders); None when HiGHS found no feasible point within its limits."""


def build_program(lengths: Sequence[int], plans, replicas: Sequence[Sequence[ReplicaSpec]],
                  opts: RelaxationOptions) -> ProgramBuilder:
    """The builder after every constraint family has added its rows."""
    builder = ProgramBuilder(lengths, plans, replicas, opts)
    for family in FAMILIES:
        family(builder)
    return builder


def relaxation(lengths: Sequence[int], plans, replicas: Sequence[Sequence[ReplicaSpec]], **options) -> Relaxed:
    """The relaxation (module docstring) over strategies given by their ``plans`` and the packer's ``replicas``
    (one ReplicaSpec per pipeline, capacities included); ``options``: the fields of :class:`RelaxationOptions`.
    ``fixed_s``: each strategy's fixed cost F_k; ``upper_s``: U, a known grouping's total;
    ``binary``: how many of the longest sequences get binary assignments (default ``2 x most pipelines + 16``, what
    the pair rows look at); ``thresholds``: levels of the pair rows per strategy; ``explicit_pipelines``: the most
    pipelines a strategy may have for row 5 (0: none); ``microbatch_rows``: row 6; ``anchor_rows``: row 7 (at
    ``anchor_levels`` thresholds per strategy); ``bucket_lines``: the buckets' supporting lines at 1/4, 1/2, 3/4;
    ``bucket_sums``: a split bucket's parts add up to its whole (a planner's candidate needs none of the four:
    they tighten the bound and slow the search);
    ``pack_rows``: row 8 for m = 2 .. pack_rows (0: none);
    ``cutoff`` (with ``upper_s``): only groupings of total at most U, so HiGHS may refute the program at once
    (then U is returned, a bound: no grouping within U);
    ``node_limit`` (deterministic) or ``time_limit_s`` stop HiGHS early (the dual bound stays a bound).
    ``min_strategies``: only groupings using at least that many strategies (``inf`` when fewer hold a
    sequence)."""
    opts = RelaxationOptions(**options)
    return solve_program(build_program(lengths, plans, replicas, opts), opts)


def solve_program(p: ProgramBuilder, opts: RelaxationOptions) -> Relaxed:
    """HiGHS on the built program (with the options' extra rows: at least ``min_strategies``, the cutoff)."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    c, integrality, upper, A, lo, hi = p.program()
    nv = c.size
    constraints = [LinearConstraint(A, lo, hi)]
    if opts.min_strategies > 1:
        if len(set(p.uk.tolist())) < opts.min_strategies:
            return Relaxed(bound_s=float("inf"), groups=None)
        pick = np.zeros(nv)
        pick[p.Y:p.Z] = 1.0
        constraints.append(LinearConstraint(pick[None, :], opts.min_strategies, np.inf))
    if opts.cutoff and opts.upper_s is not None:  # only groupings within upper_s: with none, upper_s is a bound
        constraints.append(LinearConstraint(c[None, :], -np.inf, opts.upper_s))
    milp_options = {"time_limit": opts.time_limit_s, "mip_rel_gap": 1e-6}
    if opts.node_limit is not None:
        milp_options["node_limit"] = opts.node_limit
    res = milp(c, constraints=constraints, integrality=integrality, bounds=Bounds(np.zeros(nv), upper),
               options=milp_options)
    if opts.cutoff and opts.upper_s is not None and res.status == 2:
        return Relaxed(bound_s=float(opts.upper_s), groups=None)
    bound = getattr(res, "mip_dual_bound", None)
    if bound is None or not np.isfinite(bound):
        raise RuntimeError(f"grouping relaxation: HiGHS returned no bound ({res.message})")
    if opts.upper_s is not None:
        bound = min(bound, opts.upper_s)
    groups = None if res.x is None else _grouping_of(p, res.x)
    return Relaxed(bound_s=float(bound), groups=groups)


def _grouping_of(p: ProgramBuilder, solution: np.ndarray) -> dict[int, list[int]]:
    """The program's grouping: each unit's members split by its shares (largest remainders)."""
    K = p.K
    share = np.full((p.U, K), -1.0)  # -1: not held
    share[p.ui, p.uk] = solution[p.X:p.X + p.m]
    groups: dict[int, list[int]] = {}
    for u, members in enumerate(p.units):
        q = np.clip(share[u], 0.0, None)
        quota = q / q.sum() * members.size if q.sum() > 0 else np.eye(K)[int(share[u].argmax())] * members.size
        take = np.floor(quota + 1e-9).astype(np.int64)
        for k in np.argsort(-(quota - take), kind="stable")[:members.size - int(take.sum())]:
            take[k] += 1
        start = 0
        for k in np.flatnonzero(take):
            groups.setdefault(int(k), []).extend(int(i) for i in members[start:start + take[k]])
            start += int(take[k])
    return groups
