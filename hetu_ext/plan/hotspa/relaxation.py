"""The mixed-integer relaxation of HotSPa's grouping problem (pure: numpy and scipy's HiGHS, no torch).

A grouping puts every sequence of a step into the group of one strategy; each used strategy k trains its group in
``T_k`` (the packer's 1F1B time of its slowest pipeline) and adds a fixed ``F_k`` (all-reduce, switch); the step
takes ``sum over used k of (T_k + F_k)``. A group under strategy k holds at least one sequence per pipeline of k
(HotSPa's rule). This module bounds that sum from below over every grouping (:func:`relaxation`'s dual bound) and
offers the relaxation's own grouping as a planner's candidate (its primal solution, priced exactly by the caller).

Per pipeline r of k holding sequence i (``s`` tokens; stage j costs ``a_j Q + b_j S + c_j`` per microbatch):

* ``w_ir = sum_j g_j (a_j s^2 + b_j s)`` (g_j: stage j's ranks): rank-seconds the sequence costs on r, whatever
  pack it is in (a pack's time on stage j is at least its sequences' sum);
* ``tau_ir = max_j (a_j s^2 + b_j s + c_j)``: the least time of any microbatch holding it, on the slowest stage;
* ``nu_ir = min_j (a_j s^2 + b_j s)``: what it adds to any pack's time.

Rows, each a consequence of the packer's model ``T_r = sum over packs t(p) + (pp_r - 1) max_p t(p)``,
``t(p) = max_j (a_j Q_p + b_j S_p + c_j)``, and ``T_k = max_r T_r``:

1. *work*: ``G T_k >= sum_r G_r T_r`` (G: the world's ranks, G_r: pipeline r's), and ``G_r T_r`` is at least its
   sequences' ``w`` plus ``(pp - 1) G_r max_{i on r} tau_i``: (a) the pipeline holding the group's longest
   sequence pays its fill and drain, ``(pp - 1) w`` of it; (b) given ``U`` (``upper_s``), every pipeline's:
   ``G_r max_{i on r} tau_i >= sum_{i on r} w_i tau_i / U`` (the largest tau is at least any weighted mean of
   them, and ``sum_{i on r} w_i <= G_r T_r <= G_r U``), so each sequence carries ``w_i (1 + (pp - 1) tau_i / U)``,
   plus every stage's ``c_j`` per microbatch (``sum_j g_j c_j s / cap_r`` per sequence: at least ``S / cap_r``
   microbatches for S tokens), or its stages' ``(a_j s^2 + b_j s)`` scaled by :func:`f_over_u` (the
   per-microbatch overhead against the fill), whichever is larger. (b) holds for every grouping whose step takes
   at most ``U``; the bound is then ``min(U, relaxation)``, a bound on every grouping.
2. *alone*: ``T_k >= pp_r tau_ir`` for every member i (its microbatch's fill and drain plus its own pass).
3. *pairs*: with more members than k has pipelines, two of the ``d + 1`` largest (by nu) share a pipeline, so
   ``T_k >= pp nu_(d) + nu_(d+1)`` (the d-th and (d+1)-th largest nu in the group; the pair's larger one pays the
   fill). Encoded with thresholds ``theta_1 > theta_2 > ...``: binaries ``u_l`` (at least d members with nu >=
   theta_l) and ``v_l`` (at least d + 1), ``T_k >= sum_l (theta_l - theta_{l+1}) (pp u_l + v_l)`` (telescoping:
   the sum is ``pp theta(u) + theta(v)``, the least thresholds the order statistics reach).
4. *size*: ``sum_i x_ik >= d_k y_k``.
5. *pipelines* (k's pipelines identical, ``2 <= d <= explicit_pipelines``): the ``3 d + 8`` longest sequences k
   holds, each in k's group, go to one pipeline p each (binary; the r-th longest only to pipelines ``<= r``,
   which identical pipelines allow without loss), ``T_k >= sum_{on p} nu + c_min M_p + (pp - 1) max_{on p} tau
   + R_p``: a few long sequences on few pipelines cannot be spread as the work row spreads them. ``M_p``, an
   integer, counts p's packs: they hold its tokens (``cap M_p >= sum_{on p} s``) and each sequence over half the
   capacity needs its own; every pack runs at least the least stage's ``c``. ``R_p >= 0`` is p's share of the
   members row 5 does not place, ``sum_p R_p >=`` their work on the mean stage (stages of equal ranks only): a
   pack's time, the max over stages, is at least the mean over stages, and each sequence's mean is at least its
   nu. With pp > 1 also row 1 with every
   pipeline's fill at once: ``d G_r T_k >= sum_r G_r T_r >= sum_i w_i + G_r (pp - 1) sum_p fill_p`` (fill_p:
   the largest tau of the explicit sequences on p, at most the largest microbatch there), so
   ``T_k >= sum_i w_i / G + (pp - 1) / d sum_p fill_p``.
6. *microbatches* (given U; k's pipelines identical, pp > 1, some stage j at least the mean stage in a and in b,
   stages of equal ranks): a pipeline whose work on stage j is W over M microbatches takes at least ``W + c_j M +
   (pp - 1)(W / M + c_j)``, at least ``f(W) = W + 2 sqrt((pp - 1) c_j W) + (pp - 1) c_j`` (:func:`f_over_u`); f
   rises and W is at least the mean stage's work, so ``T_k >= f(mean W over k's pipelines)`` with the mean stage;
   f is concave, so on each segment of ``[0, U]`` (cut at ``U / 2^7 .. U / 2, U``) its chord lies under it: a
   binary picks the segment W is in, and ``T_k`` is at least that chord.
7. *anchors* (k's pipelines identical, pp > 1): pipeline p runs at least its sequences' nu plus ``(pp - 1) A_p``,
   ``A_p`` the largest tau on p (its longest microbatch is at least any of its sequences'), so as in row 5
   ``T_k >= sum_i w_i / G + (pp - 1) / d sum_p A_p``. Let ``A_(j)`` be the j-th largest ``A_p`` and ``V(theta)``
   the nu of k's members whose tau is at least theta. If ``A_(j+1) < theta``, those members sit on at most j
   pipelines, each running at most ``T_k - (pp - 1) theta`` of nu, so ``V(theta) <= j (T_k - (pp - 1) theta)``
   when some member reaches theta (with none, V = 0 and no pipeline pays that fill: the level term is taken
   times the binary of j = 0, which says whether any does; times ``y_k`` instead, as at first, a small group
   paid fills of levels none of its members reaches, 0.0042 s for a 0.0013 s group, caught by a test);
   a binary per (theta, j) is forced to 1 when that fails (j = 0: when any member reaches theta), and
   ``sum_p A_p`` is at least the telescoped thresholds (as in row 3), a chosen j standing for the j' below it
   (``A_(j'+1) >= A_(j+1)``). Buckets count by their least member's tau and nu, so a group of short sequences
   pays the fills its longest ones force, which row 5 (binary sequences only) does not see: 32 GPUs at 16K,
   TP 1 x PP 8 x DP 4 holding 1,155 short sequences, 5.00 s -> 5.15 s (the packer's own bound 5.17 s).
8. *packs* (given U; k's pipelines identical, pp = 1): a pack of at most ``cap`` tokens computes at most
   ``P = a cap^2 + b cap`` (``Q <= S^2``), so a pipeline of fewer than m packs computes at most ``(m - 1) P``
   and one of m or more at most ``T_k - m c``. If ``T_k >= (m - 1) P + m c``, every pipeline computes at most
   ``T_k - m c`` and ``T_k >= W / d + m c`` (W: the group's work on its d pipelines); a binary per m picks
   which side of that level ``T_k`` is (big-M: ``2 U``, above every ``T_k`` and ``W / d`` of a grouping
   within U). Row 1 counts ``c`` per ``cap`` tokens, divisibly: 1.1 c where a full sequence and a tenth of one
   on every pipeline run two packs each.

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


@dataclass(frozen=True)
class Relaxed:
    bound_s: float
    """HiGHS's dual bound: no grouping (of total at most ``upper_s``, when given) is cheaper."""
    groups: dict[int, list[int]] | None
    """The program's grouping (strategy -> indices into the lengths), each bucket's members split by its shares
    (largest remainders); None when HiGHS found no feasible point within its limits."""


def f_over_u(c: float, pp: int, upper_s: float) -> float:
    """``f(U) / U`` for ``f(W) = W + 2 sqrt((pp - 1) c W) + (pp - 1) c``: a pipeline whose work priced on one stage
    is W (``sum_p (a Q_p + b S_p)``) over M microbatches takes at least ``W + c M + (pp - 1)(W / M + c)`` (the
    largest microbatch is at least the mean), at least f(W) over every M; f is concave with f(0) >= 0, so
    ``f(W) >= W f(U) / U`` for every ``W <= U``."""
    return 1.0 + 2.0 * np.sqrt((pp - 1) * c / upper_s) + (pp - 1) * c / upper_s


def _per_sequence(s: np.ndarray, plans, replicas: Sequence[Sequence[ReplicaSpec]], world: int,
                  upper_s: float | None):
    """(work, plain, fill, alone, nu, pp, pipelines): sequences x strategies (inf where no pipeline holds it)
    and per strategy; work and plain in seconds over the world (rank-seconds / G, row 1: with every pipeline's
    fill through ``upper_s``, and without), fill the longest sequence's fill and drain term."""
    n, K = s.size, len(plans)
    work, plain, fill, alone, nu = (np.full((n, K), np.inf) for _ in range(5))
    pp = np.ones(K, dtype=np.int64)
    pipelines = np.zeros(K, dtype=np.int64)
    for k, (plan, reps) in enumerate(zip(plans, replicas)):
        pipelines[k] = len(reps)
        for pipeline, rep in zip(plan.pipelines, reps):
            per_stage = np.array([c.a * s * s + c.b * s for c in rep.stage_costs])  # stages x n
            ranks = np.array([len(stage.ranks) for stage in pipeline.stages], dtype=np.float64)
            w = ranks @ per_stage
            packs = ranks @ np.array([c.c for c in rep.stage_costs]) * s / rep.token_capacity  # c per microbatch
            tau = np.max(per_stage + np.array([[c.c] for c in rep.stage_costs]), axis=0)
            held = s <= rep.token_capacity
            pp[k] = max(pp[k], rep.pp)
            if upper_s:  # row 1 with every pipeline's fill: the larger of two arguments, per sequence
                rho = np.array([f_over_u(c.c, rep.pp, upper_s) for c in rep.stage_costs])
                w_fill = np.maximum(w * (1 + (rep.pp - 1) * tau / upper_s) + packs, (ranks * rho) @ per_stage)
            else:
                w_fill = w + packs
            for out, value in ((work, w_fill), (plain, w), (fill, (rep.pp - 1) * w), (alone, rep.pp * tau),
                               (nu, per_stage.min(axis=0))):
                out[:, k] = np.where(held, np.minimum(out[:, k], value), out[:, k])
    return work / world, plain / world, fill / world, alone, nu, pp, pipelines


def relaxation(lengths: Sequence[int], plans, replicas: Sequence[Sequence[ReplicaSpec]], *,
               fixed_s: Sequence[float] | None = None, upper_s: float | None = None, min_strategies: int = 1,
               binary: int | None = None, bucket_ratio: float = 1.05, thresholds: int = 12, explicit_pipelines: int = 8,
               microbatch_rows: bool = True, bucket_lines: bool = True, bucket_sums: bool = True,
               anchor_rows: bool = True, anchor_levels: int = 12, pack_rows: int = 3, cutoff: bool = False,
               time_limit_s: float = 120.0, node_limit: int | None = None) -> Relaxed:
    """The relaxation (module docstring) over strategies given by their ``plans`` and the packer's ``replicas``
    (one ReplicaSpec per pipeline, capacities included). ``binary``: how many of the longest sequences get binary
    assignments (default ``2 x most pipelines + 16``, what the pair rows look at); ``thresholds``: levels of the
    pair rows per strategy; ``explicit_pipelines``: the most pipelines a strategy may have for row 5 (0: none);
    ``microbatch_rows``: row 6; ``anchor_rows``: row 7 (at ``anchor_levels`` thresholds per strategy);
    ``bucket_lines``: the buckets' supporting lines at 1/4, 1/2, 3/4;
    ``bucket_sums``: a split bucket's parts add up to its whole (a planner's candidate needs none of the four:
    they tighten the bound and slow the search);
    ``pack_rows``: row 8 for m = 2 .. pack_rows (0: none);
    ``cutoff`` (with ``upper_s``): only groupings of total at most U, so HiGHS may refute the program at once
    (then U is returned, a bound: no grouping within U);
    ``node_limit`` (deterministic) or ``time_limit_s`` stop HiGHS early (the dual bound stays a bound).
    ``min_strategies``: only groupings using at least that many strategies (``inf`` when fewer hold a
    sequence)."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    s = np.asarray(lengths, dtype=np.float64)
    n, K = s.size, len(plans)
    world = max(plan.world_size for plan in plans)
    fixed = np.zeros(K) if fixed_s is None else np.asarray(fixed_s, dtype=np.float64)
    work, plain, fill, alone, nu, pp, pipelines = _per_sequence(s, plans, replicas, world, upper_s)
    identical = [all(r == reps[0] for r in reps) and len({tuple(len(st.ranks) for st in pl.stages)
                                                           for pl in plan.pipelines}) == 1
                 for plan, reps in zip(plans, replicas)]
    held = np.isfinite(work)
    if not held.any(axis=1).all():
        raise ValueError("grouping relaxation: a sequence no strategy holds")

    # units: the `binary` longest sequences alone, the rest in buckets of equal holders whose longest member is at
    # most `bucket_ratio` times their shortest; a bucket's share x is the fraction of its members sent, so each
    # coefficient is its count times the least member's (the members sent cost at least that much each)
    order = np.argsort(-s, kind="stable")
    top = int(min(n, binary if binary is not None else 2 * pipelines.max() + 16))
    units: list[np.ndarray] = [order[i:i + 1] for i in range(top)]
    rest = order[top:]
    if rest.size:
        caps = sorted({r.token_capacity for reps in replicas for r in reps})
        cls = np.searchsorted(caps, s[rest], side="left")
        for c in np.unique(cls):
            members = rest[cls == c]  # longest first
            start = 0
            for j in range(1, members.size + 1):
                if j == members.size or s[members[start]] > bucket_ratio * s[members[j]]:
                    units.append(members[start:j])
                    start = j
    U = len(units)
    count = np.array([u.size for u in units], dtype=np.float64)
    uwork = np.array([work[u].sum(axis=0) for u in units])  # units x K (inf where not held): all members
    uplain = np.array([plain[u].sum(axis=0) for u in units])
    least = {"work": np.array([work[u].min(axis=0) for u in units]) * count[:, None],  # count x the least member
             "plain": np.array([plain[u].min(axis=0) for u in units]) * count[:, None]}
    most = {"work": np.array([work[u].max(axis=0) for u in units]) * count[:, None],  # count x the largest
            "plain": np.array([plain[u].max(axis=0) for u in units]) * count[:, None]}
    ufill = np.array([fill[u].min(axis=0) for u in units])
    ualone = np.array([alone[u].max(axis=0) for u in units])  # used for single sequences only
    unu = np.array([nu[u].min(axis=0) for u in units])  # a bucket's members each reach at least this
    pairs = np.argwhere(np.isfinite(uwork))  # (unit, strategy)
    m = len(pairs)
    ui, uk = pairs[:, 0], pairs[:, 1]
    is_binary = ui < top

    # variables: x (m), y (K), z (K: fill without U), T (K), E and EP (a bucket's work and plain work in k's group,
    # one of each per bucket pair), then the threshold binaries and the rows' own
    bucket = np.flatnonzero(~is_binary)
    mb = bucket.size
    X, Y, Z, T = 0, m, m + K, m + 2 * K
    E, EP = m + 3 * K, m + 3 * K + mb
    rows, cols, vals, lo, hi = [], [], [], [], []
    cost = [np.zeros(m), fixed, np.zeros(K), np.ones(K), np.zeros(2 * mb)]
    integral = [is_binary.astype(np.float64), np.ones(K), np.zeros(K), np.zeros(K), np.zeros(2 * mb)]
    nv = m + 3 * K + 2 * mb
    nrow = 0

    def add(r, c, v, low, high):
        nonlocal nrow
        r = np.asarray(r)
        rows.append(r + nrow)
        cols.append(np.asarray(c))
        vals.append(np.asarray(v, dtype=np.float64))
        lo.append(np.atleast_1d(np.asarray(low, dtype=np.float64)))
        hi.append(np.atleast_1d(np.asarray(high, dtype=np.float64)))
        nrow += int(r.max()) + 1 if r.size else 0

    x = np.arange(m)
    one = np.ones(m)
    b = np.flatnonzero(is_binary)
    j = np.arange(mb)
    for name, base in (("work", E), ("plain", EP)):  # a share x of a bucket's members costs at least these lines
        lo_c, hi_c, tot = least[name][ui[bucket], uk[bucket]], most[name][ui[bucket], uk[bucket]], \
            (uwork if name == "work" else uplain)[ui[bucket], uk[bucket]]
        add(np.r_[j, j], np.r_[base + j, X + bucket], np.r_[np.ones(mb), -lo_c], np.zeros(mb), np.full(mb, np.inf))
        add(np.r_[j, j], np.r_[base + j, X + bucket], np.r_[np.ones(mb), -hi_c], tot - hi_c, np.full(mb, np.inf))
        # and the supporting lines of "the cheapest x count members" (convex in x) at a quarter, half, three
        # quarters of the bucket: S_q + count w_(q+1) (x - q / count), S_q the q cheapest members' sum
        costs = work if name == "work" else plain
        for quarter in (1, 2, 3) if bucket_lines else ():
            slope, offset = np.zeros(mb), np.full(mb, -np.inf)
            for t, pair in enumerate(bucket):
                u, k = ui[pair], uk[pair]
                ranked = np.sort(costs[units[u], k])
                q = ranked.size * quarter // 4
                if 0 < q < ranked.size:
                    slope[t] = ranked.size * ranked[q]
                    offset[t] = ranked[:q].sum() - q * ranked[q]  # E - slope x >= S_q - q w_(q+1)
            add(np.r_[j, j], np.r_[base + j, X + bucket], np.r_[np.ones(mb), -slope], offset, np.full(mb, np.inf))
        # and every member goes somewhere: with w_ref its work on the bucket's first strategy and rho_k the least
        # w_k / w_ref over its members, sum_k E_k / rho_k >= the bucket's w_ref (one row per bucket)
        r_, c_, v_, low = [], [], [], []
        for u in np.unique(ui[bucket]) if bucket_sums else ():
            mine = np.flatnonzero(ui[bucket] == u)
            ref = costs[units[u], uk[bucket[mine[0]]]]
            rho = np.array([np.min(costs[units[u], uk[bucket[t]]] / ref) for t in mine])
            r_.append(np.full(mine.size, len(low)))
            c_.append(base + mine)
            v_.append(1.0 / rho)
            low.append(ref.sum())
        if low:
            add(np.concatenate(r_), np.concatenate(c_), np.concatenate(v_), np.array(low), np.full(len(low), np.inf))

    def members(family: str, k_rows, scale=1.0):
        """(rows, columns, values) of the work of k's group: binary sequences through x, buckets through E / EP."""
        coef = uwork if family == "work" else uplain
        base = E if family == "work" else EP
        return (np.r_[k_rows(b), k_rows(bucket)], np.r_[X + b, base + j],
                np.r_[coef[ui[b], uk[b]] * scale, np.full(mb, scale)])

    def group_work(k: int, scale=1.0):
        """(columns, values) of the plain work of k's group alone, in one row (rows 5 and 6)."""
        _, cols_, vals_ = members("plain", lambda sel: np.zeros(sel.size, dtype=np.int64), scale)
        keep = np.r_[uk[b] == k, uk[bucket] == k]
        return cols_[keep], vals_[keep]

    add(ui, X + x, one, np.ones(U), np.ones(U))                                   # each unit once
    add(np.r_[x, x], np.r_[X + x, Y + uk], np.r_[one, -one], np.full(m, -np.inf), np.zeros(m))   # x <= y
    add(np.r_[x, x], np.r_[X + x, Z + uk], np.r_[ufill[ui, uk], -one], np.full(m, -np.inf), np.zeros(m))
    ks = np.arange(K)
    r_, c_, v_ = members("plain", lambda sel: uk[sel])
    add(np.r_[r_, ks, ks], np.r_[c_, Z + ks, T + ks], np.r_[v_, np.ones(K), -np.ones(K)],
        np.full(K, -np.inf), np.zeros(K))                                           # row 1, the longest's fill
    if upper_s is not None:
        r_, c_, v_ = members("work", lambda sel: uk[sel])
        add(np.r_[r_, ks], np.r_[c_, T + ks], np.r_[v_, -np.ones(K)], np.full(K, -np.inf),
            np.zeros(K))                                                            # row 1, every pipeline's
    add(np.r_[np.arange(b.size), np.arange(b.size)], np.r_[X + b, T + uk[b]], np.r_[ualone[ui[b], uk[b]],
        -np.ones(b.size)], np.full(b.size, -np.inf), np.zeros(b.size))          # row 2 (bucket rows dropped)
    add(np.r_[uk, ks], np.r_[X + x, Y + ks], np.r_[count[ui], -pipelines.astype(np.float64)], np.zeros(K),
        np.full(K, np.inf))                                                        # row 4
    extra = 0
    for k in range(K):                                                             # row 3
        d = int(pipelines[k])
        mine = np.flatnonzero(uk == k)
        if count[ui[mine]].sum() <= d:
            continue
        ranked = np.sort(np.repeat(unu[ui[mine], k], count[ui[mine]].astype(np.int64)))[::-1]
        ranks = np.unique(np.linspace(d - 1, min(ranked.size - 1, 2 * d + 8), thresholds).round().astype(int))
        theta = np.r_[np.unique(ranked[ranks])[::-1], 0.0]
        tele_c, tele_v = [T + k], [-1.0]
        for level, delta in zip(theta[:-1], theta[:-1] - theta[1:]):
            reach = mine[unu[ui[mine], k] >= level]  # units each of whose members has nu >= level
            for need, weight in ((d, pp[k]), (d + 1, 1)):
                v = nv + extra
                extra += 1
                add(np.zeros(reach.size + 1, dtype=np.int64), np.r_[X + reach, v],
                    np.r_[count[ui[reach]], -float(n)], -np.inf, need - 1)
                tele_c.append(v)
                tele_v.append(weight * delta)
        add(np.zeros(len(tele_c), dtype=np.int64), tele_c, tele_v, -np.inf, 0.0)
    ext_int = [1.0] * extra  # the extra variables' integrality and upper bounds (the threshold binaries so far)
    ext_up = [1.0] * extra
    for k in range(K):                                                             # row 5
        d = int(pipelines[k])
        if not 2 <= d <= explicit_pipelines or not identical[k]:
            continue
        mine = np.flatnonzero((uk == k) & is_binary)[:3 * d + 8]  # pairs of its longest held sequences
        if mine.size <= d:
            continue
        fill0, q0 = nv + extra, nv + extra + d  # d fill variables, then q[r, p] at q0 + r d + p
        packs0 = q0 + mine.size * d  # then d pack counts, then d shares of the other members' work
        rest0 = packs0 + d
        extra += d + mine.size * d + 2 * d
        ext_int += [0.0] * d + [1.0] * (mine.size * d) + [1.0] * d + [0.0] * d
        ext_up += [np.inf] * d + [1.0 if p <= r else 0.0 for r in range(mine.size) for p in range(d)]  # symmetry
        ext_up += [np.inf] * 2 * d
        even = len({len(st.ranks) for st in plans[k].pipelines[0].stages}) == 1
        if even:  # the members not placed explicitly run somewhere: at least their mean stage's time, divisible
            g_cols, g_vals = group_work(k, world / sum(len(st.ranks) for st in plans[k].pipelines[0].stages))
            keep = ~np.isin(g_cols, X + mine)
            add(np.zeros(d + keep.sum(), dtype=np.int64), np.r_[rest0 + np.arange(d), g_cols[keep]],
                np.r_[np.ones(d), -g_vals[keep]], 0.0, np.inf)
        nu_r = unu[ui[mine], k]
        tau_r = ualone[ui[mine], k] / pp[k]
        tokens = s[np.concatenate([units[u] for u in ui[mine]])]
        cap = float(replicas[k][0].token_capacity)
        stages = replicas[k][0].stage_costs
        c_least = min(c.c for c in stages)
        r_all = np.arange(mine.size)
        halves = r_all[tokens > cap / 2]
        # the rest's tokens: its mean-stage seconds per token are largest at its longest member (a s + b rises)
        others = np.flatnonzero((uk == k) & ~np.isin(np.arange(m), mine))
        per_token = 0.0
        if even and others.size:
            longest = max(s[units[u]].max() for u in ui[others])
            per_token = 1.0 / (np.mean([c.a for c in stages]) * longest + np.mean([c.b for c in stages]))
        for p in range(d):  # pipeline p: its sequences' passes, its packs' overhead, its fill and drain, within T_k
            add(np.zeros(mine.size + 4, dtype=np.int64),
                np.r_[q0 + r_all * d + p, packs0 + p, fill0 + p, rest0 + p, T + k],
                np.r_[nu_r, c_least, pp[k] - 1, 1.0 if even else 0.0, -1.0], -np.inf, 0.0)
            add(np.zeros(mine.size + 2, dtype=np.int64), np.r_[q0 + r_all * d + p, rest0 + p, packs0 + p],
                np.r_[tokens, per_token, -cap], -np.inf, 0.0)                      # its packs hold its tokens
            add(np.zeros(halves.size + 1, dtype=np.int64), np.r_[q0 + halves * d + p, packs0 + p],
                np.r_[np.ones(halves.size), -1.0], -np.inf, 0.0)                   # over half a pack: one each
            if pp[k] > 1:  # its fill: at least each of its sequences' microbatch
                add(np.r_[r_all, r_all], np.r_[q0 + r_all * d + p, np.full(mine.size, fill0 + p)],
                    np.r_[tau_r, -np.ones(mine.size)], np.full(mine.size, -np.inf), np.zeros(mine.size))
        for r in range(mine.size):  # on one pipeline exactly when in k's group
            add(np.zeros(d + 1, dtype=np.int64), np.r_[q0 + r * d + np.arange(d), X + mine[r]],
                np.r_[np.ones(d), -1.0], 0.0, 0.0)
        if pp[k] > 1:  # and every pipeline's fill at once: T_k >= the group's work / G + (pp - 1) / d sum_p fill_p
            w_cols, w_vals = group_work(k)
            add(np.zeros(w_cols.size + d + 1, dtype=np.int64), np.r_[w_cols, fill0 + np.arange(d), T + k],
                np.r_[w_vals, np.full(d, (pp[k] - 1) / d), -1.0], -np.inf, 0.0)
    for k in range(K):                                                             # row 6
        reps = replicas[k]
        stages = reps[0].stage_costs
        depth, d = int(pp[k]), int(pipelines[k])
        if not microbatch_rows or upper_s is None or depth < 2 or not identical[k] \
                or len({len(st.ranks) for st in plans[k].pipelines[0].stages}) != 1:
            continue
        mean_a, mean_b = np.mean([c.a for c in stages]), np.mean([c.b for c in stages])
        over = [c for c in stages if c.a >= mean_a and c.b >= mean_b]  # its work >= the mean stage's
        if not over:
            continue
        ranks = sum(len(st.ranks) for st in plans[k].pipelines[0].stages)
        cj = max(c.c for c in over)

        def f(w: float) -> float:
            return w + 2.0 * np.sqrt((depth - 1) * cj * w) + (depth - 1) * cj

        points = np.r_[0.0, upper_s * 2.0 ** np.arange(-7, 1)]  # segments [W_l, W_l+1] up to U
        chords = [(f(w0), (f(w1) - f(w0)) / (w1 - w0)) for w0, w1 in zip(points[:-1], points[1:])]
        big = max(f0 + slope * (upper_s - w0) for (f0, slope), w0 in zip(chords, points[:-1]))
        scale = world / (d * ranks)  # uplain (rank-seconds / G) -> one stage's seconds per pipeline, on average
        z0 = nv + extra
        extra += len(chords)
        ext_int += [1.0] * len(chords)
        ext_up += [1.0] * len(chords)
        zs = z0 + np.arange(len(chords))
        add(np.zeros(len(chords) + 1, dtype=np.int64), np.r_[zs, Y + k], np.r_[np.ones(len(chords)), -1.0],
            0.0, 0.0)                                                              # one segment when k is used
        w_cols, w_vals = group_work(k, scale)
        add(np.zeros(w_cols.size + len(chords), dtype=np.int64), np.r_[w_cols, zs], np.r_[w_vals, -points[1:]],
            -np.inf, 0.0)                                                          # W <= the segment's top
        add(np.zeros(w_cols.size + len(chords), dtype=np.int64), np.r_[w_cols, zs], np.r_[w_vals, -points[:-1]],
            0.0, np.inf)                                                           # W >= its bottom
        for l, ((f0, slope), bottom) in enumerate(zip(chords, points[:-1])):  # T_k >= chord_l(W) - big (1 - z_l)
            add(np.zeros(w_cols.size + 2, dtype=np.int64), np.r_[w_cols, T + k, zs[l]],
                np.r_[slope * w_vals, -1.0, big], -np.inf, big - f0 + slope * bottom)
    for k in range(K):                                                             # row 7
        depth, d = int(pp[k]), int(pipelines[k])
        mine = np.flatnonzero(uk == k)
        if not anchor_rows or depth < 2 or not identical[k] or mine.size == 0:
            continue
        utau = np.array([alone[units[u], k].min() for u in ui[mine]]) / depth  # each member's tau is at least
        vcoef = count[ui[mine]] * unu[ui[mine], k]  # x of it: at least this much nu (its least member's each)
        ranked = np.unique(utau)[::-1]
        picks = np.unique(np.geomspace(1, ranked.size, anchor_levels).round().astype(int) - 1)
        theta = np.r_[ranked[picks], 0.0]
        js = sorted({q for q in (0, 1, 2, 3, d // 4, d // 2, (3 * d) // 4, d - 1) if 0 <= q < d})
        weights = np.diff(np.r_[-1, js])  # A_(j'+1) >= A_(j+1) for every j' in (previous j, j]
        tele_c, tele_v = [], []
        for level, delta in zip(theta[:-1], theta[:-1] - theta[1:]):
            above = utau >= level
            reach, coef = mine[above], vcoef[above]
            for jj, weight in zip(js, weights):
                v = nv + extra
                extra += 1
                ext_int.append(1.0)
                ext_up.append(1.0)
                if jj == 0:  # any member reaching the level: some pipeline's fill reaches it
                    add(np.zeros(reach.size + 1, dtype=np.int64), np.r_[X + reach, v],
                        np.r_[count[ui[reach]], -float(n)], -np.inf, 0.0)
                    reached = v
                else:  # more nu above the level than j pipelines hold next to such a fill (when any reaches it:
                    # with none, V = 0 and no pipeline pays the fill, whatever T_k)
                    add(np.zeros(reach.size + 3, dtype=np.int64), np.r_[X + reach, T + k, reached, v],
                        np.r_[coef, -float(jj), jj * (depth - 1) * level, -coef.sum()], -np.inf, 0.0)
                tele_c.append(v)
                tele_v.append(weight * delta * (depth - 1) / d)
        w_cols, w_vals = group_work(k)
        add(np.zeros(w_cols.size + len(tele_c) + 1, dtype=np.int64), np.r_[w_cols, tele_c, T + k],
            np.r_[w_vals, tele_v, -1.0], -np.inf, 0.0)
    for k in range(K):                                                             # row 8
        d = int(pipelines[k])
        if not pack_rows or upper_s is None or pp[k] != 1 or not identical[k] or not (uk == k).any():
            continue
        rep = replicas[k][0]
        cost_ = rep.stage_costs[0]
        cap = float(rep.token_capacity)
        one_pack = cost_.a * cap * cap + cost_.b * cap  # the most any pack of at most cap tokens computes
        w_cols, w_vals = group_work(k, world / (d * len(plans[k].pipelines[0].stages[0].ranks)))
        big = 2.0 * upper_s  # above every T_k and W / d of a grouping within U
        for packs in range(2, pack_rows + 1):  # T_k > (packs - 1) one_pack + packs c  =>  T_k >= W / d + packs c
            h = nv + extra
            extra += 1
            ext_int.append(1.0)
            ext_up.append(1.0)
            add(np.zeros(2, dtype=np.int64), np.r_[T + k, h], np.r_[1.0, -big], -np.inf,
                (packs - 1) * one_pack + packs * cost_.c)
            add(np.zeros(w_cols.size + 2, dtype=np.int64), np.r_[w_cols, T + k, h], np.r_[w_vals, -1.0, big],
                -np.inf, big - packs * cost_.c)
    nv += extra
    c = np.concatenate(cost + [np.zeros(extra)])
    integrality = np.concatenate(integral + [np.asarray(ext_int)])
    upper = np.concatenate([np.ones(m + K), np.full(2 * K + 2 * mb, np.inf), np.asarray(ext_up)])
    A = coo_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(nrow, nv)).tocsr()
    constraints = [LinearConstraint(A, np.concatenate(lo), np.concatenate(hi))]
    if min_strategies > 1:
        if len(set(uk.tolist())) < min_strategies:
            return Relaxed(bound_s=float("inf"), groups=None)
        pick = np.zeros(nv)
        pick[Y:Z] = 1.0
        constraints.append(LinearConstraint(pick[None, :], min_strategies, np.inf))
    if cutoff and upper_s is not None:  # only groupings within upper_s: when there is none, upper_s is a bound
        constraints.append(LinearConstraint(c[None, :], -np.inf, upper_s))
    options = {"time_limit": time_limit_s, "mip_rel_gap": 1e-6}
    if node_limit is not None:
        options["node_limit"] = node_limit
    res = milp(c, constraints=constraints, integrality=integrality, bounds=Bounds(np.zeros(nv), upper),
               options=options)
    if cutoff and upper_s is not None and res.status == 2:
        return Relaxed(bound_s=float(upper_s), groups=None)
    bound = getattr(res, "mip_dual_bound", None)
    if bound is None or not np.isfinite(bound):
        raise RuntimeError(f"grouping relaxation: HiGHS returned no bound ({res.message})")
    if upper_s is not None:
        bound = min(bound, upper_s)
    groups = None
    if res.x is not None:
        share = np.full((U, K), -1.0)  # -1: not held
        share[ui, uk] = res.x[X:X + m]
        groups = {}
        for u, members in enumerate(units):  # a bucket's members split by its shares (largest remainders)
            p = np.clip(share[u], 0.0, None)
            quota = p / p.sum() * members.size if p.sum() > 0 else np.eye(K)[int(share[u].argmax())] * members.size
            take = np.floor(quota + 1e-9).astype(np.int64)
            for k in np.argsort(-(quota - take), kind="stable")[:members.size - int(take.sum())]:
                take[k] += 1
            start = 0
            for k in np.flatnonzero(take):
                groups.setdefault(int(k), []).extend(int(i) for i in members[start:start + take[k]])
                start += int(take[k])
    return Relaxed(bound_s=float(bound), groups=groups)
