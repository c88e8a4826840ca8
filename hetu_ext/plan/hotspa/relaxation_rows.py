"""The grouping relaxation's constraint families, one function each, adding its rows to a
:class:`~.relaxation_program.ProgramBuilder` ``p``; each docstring says why its rows hold for every grouping.

Notation (per pipeline r of strategy k holding sequence i of ``s`` tokens; stage j costs ``a_j Q + b_j S + c_j`` per
microbatch): ``w_ir = sum_j g_j (a_j s^2 + b_j s)`` (g_j: stage j's ranks) the rank-seconds the sequence costs on r
whatever pack it is in (a pack's time on stage j is at least its sequences' sum); ``tau_ir = max_j (a_j s^2 + b_j s
+ c_j)`` the least time of any microbatch holding it, on the slowest stage; ``nu_ir = min_j (a_j s^2 + b_j s)`` what
it adds to any pack's time. The packer's model: ``T_r = sum over packs t(p) + (pp_r - 1) max_p t(p)``, ``t(p) = max_j
(a_j Q_p + b_j S_p + c_j)``, and ``T_k = max_r T_r``.
"""

from __future__ import annotations

import numpy as np

from hetu_ext.plan.hotspa.relaxation_program import ProgramBuilder


def bucket_rows(p: ProgramBuilder) -> None:
    """*Buckets*: E (and EP, the plain work) of a bucket pair is at least the work of the cheapest ``x count``
    members, a convex function of x held from below by its supporting lines at 0 and 1 (``least`` and ``most``: at
    x = 1 all members, ``tot``) and, with ``bucket_lines``, at 1/4, 1/2, 3/4 of the count: ``S_q + count w_(q+1) (x -
    q / count)``, S_q the q cheapest members' sum (exact when the whole bucket goes one way). With ``bucket_sums``:
    the parts of a split bucket cannot all be its cheapest members: with ``w_ref`` each member's work on the bucket's
    first strategy and ``rho_k`` the least ``w_k / w_ref`` over its members, the work sent to each k, divided by
    ``rho_k``, adds up to at least the bucket's ``w_ref`` (every member goes somewhere)."""
    ui, uk, bucket, mb, X = p.ui, p.uk, p.bucket, p.mb, p.X
    j = np.arange(mb)
    for name, base in (("work", p.E), ("plain", p.EP)):
        lo_c, hi_c = p.least[name][ui[bucket], uk[bucket]], p.most[name][ui[bucket], uk[bucket]]
        tot = (p.uwork if name == "work" else p.uplain)[ui[bucket], uk[bucket]]
        p.add(np.r_[j, j], np.r_[base + j, X + bucket], np.r_[np.ones(mb), -lo_c], np.zeros(mb), np.full(mb, np.inf))
        p.add(np.r_[j, j], np.r_[base + j, X + bucket], np.r_[np.ones(mb), -hi_c], tot - hi_c, np.full(mb, np.inf))
        costs = p.work if name == "work" else p.plain
        for quarter in (1, 2, 3) if p.opts.bucket_lines else ():
            slope, offset = np.zeros(mb), np.full(mb, -np.inf)
            for t, pair in enumerate(bucket):
                u, k = ui[pair], uk[pair]
                ranked = np.sort(costs[p.units[u], k])
                q = ranked.size * quarter // 4
                if 0 < q < ranked.size:
                    slope[t] = ranked.size * ranked[q]
                    offset[t] = ranked[:q].sum() - q * ranked[q]  # E - slope x >= S_q - q w_(q+1)
            p.add(np.r_[j, j], np.r_[base + j, X + bucket], np.r_[np.ones(mb), -slope], offset, np.full(mb, np.inf))
        r_, c_, v_, low = [], [], [], []
        for u in np.unique(ui[bucket]) if p.opts.bucket_sums else ():
            mine = np.flatnonzero(ui[bucket] == u)
            ref = costs[p.units[u], uk[bucket[mine[0]]]]
            rho = np.array([np.min(costs[p.units[u], uk[bucket[t]]] / ref) for t in mine])
            r_.append(np.full(mine.size, len(low)))
            c_.append(base + mine)
            v_.append(1.0 / rho)
            low.append(ref.sum())
        if low:
            p.add(np.concatenate(r_), np.concatenate(c_), np.concatenate(v_), np.array(low),
                  np.full(len(low), np.inf))


def assignment_rows(p: ProgramBuilder) -> None:
    """*Assignment*: every unit goes to its strategies once in all (shares adding up to 1); a unit only to a used
    strategy (``x <= y``); z_k, the fill and drain of k's longest member (``(pp - 1) w``), is at least each member's
    (it is a max)."""
    m, X, one = p.m, p.X, np.ones(p.m)
    x = np.arange(m)
    p.add(p.ui, X + x, one, np.ones(p.U), np.ones(p.U))
    p.add(np.r_[x, x], np.r_[X + x, p.Y + p.uk], np.r_[one, -one], np.full(m, -np.inf), np.zeros(m))
    p.add(np.r_[x, x], np.r_[X + x, p.Z + p.uk], np.r_[p.ufill[p.ui, p.uk], -one], np.full(m, -np.inf), np.zeros(m))


def work_rows(p: ProgramBuilder) -> None:
    """*Row 1, work*: ``G T_k >= sum_r G_r T_r`` (G: the world's ranks, G_r: pipeline r's), and ``G_r T_r`` is at
    least its sequences' ``w`` plus ``(pp - 1) G_r max_{i on r} tau_i``: (a) the pipeline holding the group's longest
    sequence pays its fill and drain, ``(pp - 1) w`` of it (z_k); (b) given ``U`` (``upper_s``), every pipeline's:
    ``G_r max_{i on r} tau_i >= sum_{i on r} w_i tau_i / U`` (the largest tau is at least any weighted mean of them,
    and ``sum_{i on r} w_i <= G_r T_r <= G_r U``), so each sequence carries ``w_i (1 + (pp - 1) tau_i / U)``, plus
    every stage's ``c_j`` per microbatch (``sum_j g_j c_j s / cap_r`` per sequence: at least ``S / cap_r``
    microbatches for S tokens), or its stages' ``(a_j s^2 + b_j s)`` scaled by :func:`f_over_u` (the per-microbatch
    overhead against the fill), whichever is larger. (b) holds for every grouping whose step takes at most ``U``;
    the bound is then ``min(U, relaxation)``, a bound on every grouping."""
    K, T = p.K, p.T
    ks = np.arange(K)
    r_, c_, v_ = p.members("plain", lambda sel: p.uk[sel])
    p.add(np.r_[r_, ks, ks], np.r_[c_, p.Z + ks, T + ks], np.r_[v_, np.ones(K), -np.ones(K)],
          np.full(K, -np.inf), np.zeros(K))
    if p.opts.upper_s is not None:
        r_, c_, v_ = p.members("work", lambda sel: p.uk[sel])
        p.add(np.r_[r_, ks], np.r_[c_, T + ks], np.r_[v_, -np.ones(K)], np.full(K, -np.inf), np.zeros(K))


def alone_rows(p: ProgramBuilder) -> None:
    """*Row 2, alone*: ``T_k >= pp_r tau_ir`` for every binary member i (its microbatch's fill and drain plus its own
    pass); a bucket has no such row (its share may be fractional)."""
    b, uk = p.b, p.uk
    p.add(np.r_[np.arange(b.size), np.arange(b.size)], np.r_[p.X + b, p.T + uk[b]],
          np.r_[p.ualone[p.ui[b], uk[b]], -np.ones(b.size)], np.full(b.size, -np.inf), np.zeros(b.size))


def size_rows(p: ProgramBuilder) -> None:
    """*Row 4, size*: ``sum_i x_ik >= d_k y_k``: a used strategy's group holds at least one sequence per pipeline
    (HotSPa's rule); each bucket counts its members exactly."""
    ks = np.arange(p.K)
    p.add(np.r_[p.uk, ks], np.r_[p.X + np.arange(p.m), p.Y + ks],
          np.r_[p.count[p.ui], -p.pipelines.astype(np.float64)], np.zeros(p.K), np.full(p.K, np.inf))


def pair_rows(p: ProgramBuilder) -> None:
    """*Row 3, pairs*: with more members than k has pipelines (d), two of the ``d + 1`` largest (by nu) share a
    pipeline, so ``T_k >= pp nu_(d) + nu_(d+1)`` (the d-th and (d+1)-th largest nu in the group; the pair's larger
    one pays the fill). Encoded with thresholds ``theta_1 > theta_2 > ...`` (``thresholds`` of them): binaries
    ``u_l`` (at least d members with nu >= theta_l, forced by ``count - n u_l <= d - 1``) and ``v_l`` (at least d +
    1), ``T_k >= sum_l (theta_l - theta_{l+1}) (pp u_l + v_l)`` (telescoping: the sum is ``pp theta(u) +
    theta(v)``, the least thresholds the order statistics reach)."""
    ui, uk, unu, count, X, n = p.ui, p.uk, p.unu, p.count, p.X, float(p.n)
    for k in range(p.K):
        d = int(p.pipelines[k])
        mine = np.flatnonzero(uk == k)
        if count[ui[mine]].sum() <= d:
            continue
        ranked = np.sort(np.repeat(unu[ui[mine], k], count[ui[mine]].astype(np.int64)))[::-1]
        ranks = np.unique(np.linspace(d - 1, min(ranked.size - 1, 2 * d + 8), p.opts.thresholds).round().astype(int))
        theta = np.r_[np.unique(ranked[ranks])[::-1], 0.0]
        tele_c, tele_v = [p.T + k], [-1.0]
        for level, delta in zip(theta[:-1], theta[:-1] - theta[1:]):
            reach = mine[unu[ui[mine], k] >= level]  # units each of whose members has nu >= level
            for need, weight in ((d, p.pp[k]), (d + 1, 1)):
                v = p.new_binary()
                p.add(np.zeros(reach.size + 1, dtype=np.int64), np.r_[X + reach, v],
                      np.r_[count[ui[reach]], -n], -np.inf, need - 1)
                tele_c.append(v)
                tele_v.append(weight * delta)
        p.add(np.zeros(len(tele_c), dtype=np.int64), tele_c, tele_v, -np.inf, 0.0)


def pipeline_rows(p: ProgramBuilder) -> None:
    """*Row 5, pipelines* (k's pipelines identical, ``2 <= d <= explicit_pipelines``): the ``3 d + 8`` longest
    sequences k holds, each in k's group, go to one pipeline p each (binary q; the r-th longest only to pipelines
    ``<= r``, which identical pipelines allow without loss), ``T_k >= sum_{on p} nu + c_min M_p + (pp - 1) max_{on
    p} tau + R_p``: a few long sequences on few pipelines cannot be spread as the work row spreads them. ``M_p``, an
    integer, counts p's packs: they hold its tokens (``cap M_p >= sum_{on p} s``, the rest's share R_p counted in
    tokens at its largest seconds per token) and each sequence over half the capacity needs its own; every pack runs
    at least the least stage's ``c``. ``R_p >= 0`` is p's share of the members the row does not place, ``sum_p R_p
    >=`` their work on the mean stage (stages of equal ranks only): a pack's time, the max over stages, is at least
    the mean over stages, and each sequence's mean is at least its nu. With pp > 1 also row 1 with every pipeline's
    fill at once: ``d G_r T_k >= sum_r G_r T_r >= sum_i w_i + G_r (pp - 1) sum_p fill_p`` (fill_p: the largest tau
    of the explicit sequences on p, at most the largest microbatch there), so ``T_k >= sum_i w_i / G + (pp - 1) / d
    sum_p fill_p``."""
    for k in range(p.K):
        d = int(p.pipelines[k])
        if not 2 <= d <= p.opts.explicit_pipelines or not p.identical[k]:
            continue
        mine = np.flatnonzero((p.uk == k) & p.is_binary)[:3 * d + 8]  # pairs of its longest held sequences
        if mine.size <= d:
            continue
        _pipelines_of(p, k, d, mine)


def _pipelines_of(p: ProgramBuilder, k: int, d: int, mine: np.ndarray) -> None:
    """Row 5 for strategy k (d pipelines) and its explicit members ``mine`` (pair indices)."""
    X, T, pp, s = p.X, p.T, p.pp, p.s
    # d fill variables, then q[r, p] at q0 + r d + p, then d pack counts, then d shares of the others' work
    fill0 = p.new_vars([0.0] * d + [1.0] * (mine.size * d) + [1.0] * d + [0.0] * d,
                       [np.inf] * d + [1.0 if q <= r else 0.0 for r in range(mine.size) for q in range(d)]
                       + [np.inf] * 2 * d)  # symmetry: the r-th longest on pipelines <= r
    q0 = fill0 + d
    packs0 = q0 + mine.size * d
    rest0 = packs0 + d
    even = p.even(k)
    if even:  # the members not placed explicitly run somewhere: at least their mean stage's time, divisible
        g_cols, g_vals = p.group_work(k, p.world / sum(len(st.ranks) for st in p.plans[k].pipelines[0].stages))
        keep = ~np.isin(g_cols, X + mine)
        p.add(np.zeros(d + keep.sum(), dtype=np.int64), np.r_[rest0 + np.arange(d), g_cols[keep]],
              np.r_[np.ones(d), -g_vals[keep]], 0.0, np.inf)
    nu_r = p.unu[p.ui[mine], k]
    tau_r = p.ualone[p.ui[mine], k] / pp[k]
    tokens = s[np.concatenate([p.units[u] for u in p.ui[mine]])]
    cap = float(p.replicas[k][0].token_capacity)
    stages = p.replicas[k][0].stage_costs
    c_least = min(c.c for c in stages)
    r_all = np.arange(mine.size)
    halves = r_all[tokens > cap / 2]
    # the rest's tokens: its mean-stage seconds per token are largest at its longest member (a s + b rises)
    others = np.flatnonzero((p.uk == k) & ~np.isin(np.arange(p.m), mine))
    per_token = 0.0
    if even and others.size:
        longest = max(s[p.units[u]].max() for u in p.ui[others])
        per_token = 1.0 / (np.mean([c.a for c in stages]) * longest + np.mean([c.b for c in stages]))
    for q in range(d):  # pipeline q: its sequences' passes, its packs' overhead, its fill and drain, within T_k
        p.add(np.zeros(mine.size + 4, dtype=np.int64),
              np.r_[q0 + r_all * d + q, packs0 + q, fill0 + q, rest0 + q, T + k],
              np.r_[nu_r, c_least, pp[k] - 1, 1.0 if even else 0.0, -1.0], -np.inf, 0.0)
        p.add(np.zeros(mine.size + 2, dtype=np.int64), np.r_[q0 + r_all * d + q, rest0 + q, packs0 + q],
              np.r_[tokens, per_token, -cap], -np.inf, 0.0)                        # its packs hold its tokens
        p.add(np.zeros(halves.size + 1, dtype=np.int64), np.r_[q0 + halves * d + q, packs0 + q],
              np.r_[np.ones(halves.size), -1.0], -np.inf, 0.0)                     # over half a pack: one each
        if pp[k] > 1:  # its fill: at least each of its sequences' microbatch
            p.add(np.r_[r_all, r_all], np.r_[q0 + r_all * d + q, np.full(mine.size, fill0 + q)],
                  np.r_[tau_r, -np.ones(mine.size)], np.full(mine.size, -np.inf), np.zeros(mine.size))
    for r in range(mine.size):  # on one pipeline exactly when in k's group
        p.add(np.zeros(d + 1, dtype=np.int64), np.r_[q0 + r * d + np.arange(d), X + mine[r]],
              np.r_[np.ones(d), -1.0], 0.0, 0.0)
    if pp[k] > 1:  # and every pipeline's fill at once: T_k >= the group's work / G + (pp - 1) / d sum_p fill_p
        w_cols, w_vals = p.group_work(k)
        p.add(np.zeros(w_cols.size + d + 1, dtype=np.int64), np.r_[w_cols, fill0 + np.arange(d), T + k],
              np.r_[w_vals, np.full(d, (pp[k] - 1) / d), -1.0], -np.inf, 0.0)


def microbatch_rows(p: ProgramBuilder) -> None:
    """*Row 6, microbatches* (given U; k's pipelines identical, pp > 1, some stage j at least the mean stage in a
    and in b, stages of equal ranks): a pipeline whose work on stage j is W over M microbatches takes at least ``W +
    c_j M + (pp - 1)(W / M + c_j)``, at least ``f(W) = W + 2 sqrt((pp - 1) c_j W) + (pp - 1) c_j``
    (:func:`~.relaxation_program.f_over_u`); f rises and W is at least the mean stage's work, so ``T_k >= f(mean W
    over k's pipelines)`` with the mean stage; f is concave, so on each segment of ``[0, U]`` (cut at ``U / 2^7 ..
    U / 2, U``) its chord lies under it: a binary picks the segment W is in (one when k is used), and ``T_k`` is at
    least that chord (big-M: the largest chord at U, off for the other segments)."""
    upper_s = p.opts.upper_s
    for k in range(p.K):
        stages = p.replicas[k][0].stage_costs
        depth, d = int(p.pp[k]), int(p.pipelines[k])
        if not p.opts.microbatch_rows or upper_s is None or depth < 2 or not p.identical[k] or not p.even(k):
            continue
        mean_a, mean_b = np.mean([c.a for c in stages]), np.mean([c.b for c in stages])
        over = [c for c in stages if c.a >= mean_a and c.b >= mean_b]  # its work >= the mean stage's
        if not over:
            continue
        ranks = sum(len(st.ranks) for st in p.plans[k].pipelines[0].stages)
        cj = max(c.c for c in over)

        def f(w: float) -> float:
            return w + 2.0 * np.sqrt((depth - 1) * cj * w) + (depth - 1) * cj

        points = np.r_[0.0, upper_s * 2.0 ** np.arange(-7, 1)]  # segments [W_l, W_l+1] up to U
        chords = [(f(w0), (f(w1) - f(w0)) / (w1 - w0)) for w0, w1 in zip(points[:-1], points[1:])]
        big = max(f0 + slope * (upper_s - w0) for (f0, slope), w0 in zip(chords, points[:-1]))
        scale = p.world / (d * ranks)  # uplain (rank-seconds / G) -> one stage's seconds per pipeline, on average
        zs = p.new_vars([1.0] * len(chords), [1.0] * len(chords)) + np.arange(len(chords))
        p.add(np.zeros(len(chords) + 1, dtype=np.int64), np.r_[zs, p.Y + k], np.r_[np.ones(len(chords)), -1.0],
              0.0, 0.0)                                                            # one segment when k is used
        w_cols, w_vals = p.group_work(k, scale)
        p.add(np.zeros(w_cols.size + len(chords), dtype=np.int64), np.r_[w_cols, zs], np.r_[w_vals, -points[1:]],
              -np.inf, 0.0)                                                        # W <= the segment's top
        p.add(np.zeros(w_cols.size + len(chords), dtype=np.int64), np.r_[w_cols, zs], np.r_[w_vals, -points[:-1]],
              0.0, np.inf)                                                         # W >= its bottom
        for l, ((f0, slope), bottom) in enumerate(zip(chords, points[:-1])):  # T_k >= chord_l(W) - big (1 - z_l)
            p.add(np.zeros(w_cols.size + 2, dtype=np.int64), np.r_[w_cols, p.T + k, zs[l]],
                  np.r_[slope * w_vals, -1.0, big], -np.inf, big - f0 + slope * bottom)


def anchor_rows(p: ProgramBuilder) -> None:
    """*Row 7, anchors* (k's pipelines identical, pp > 1): pipeline p runs at least its sequences' nu plus ``(pp -
    1) A_p``, ``A_p`` the largest tau on p (its longest microbatch is at least any of its sequences'), so as in row
    5 ``T_k >= sum_i w_i / G + (pp - 1) / d sum_p A_p``. Let ``A_(j)`` be the j-th largest ``A_p`` and ``V(theta)``
    the nu of k's members whose tau is at least theta. If ``A_(j+1) < theta``, those members sit on at most j
    pipelines, each running at most ``T_k - (pp - 1) theta`` of nu, so ``V(theta) <= j (T_k - (pp - 1) theta)`` when
    some member reaches theta (with none, V = 0 and no pipeline pays that fill: the level term is taken times the
    binary of j = 0, which says whether any does; times ``y_k`` instead, as at first, a small group paid fills of
    levels none of its members reaches, 0.0042 s for a 0.0013 s group, caught by a test); a binary per (theta, j)
    is forced to 1 when that fails (j = 0: when any member reaches theta), and ``sum_p A_p`` is at least the
    telescoped thresholds (as in row 3; ``anchor_levels`` of them), a chosen j standing for the j' below it
    (``A_(j'+1) >= A_(j+1)``). Buckets count by their least member's tau and nu, so a group of short sequences pays
    the fills its longest ones force, which row 5 (binary sequences only) does not see: 32 GPUs at 16K, TP 1 x PP 8
    x DP 4 holding 1,155 short sequences, 5.00 s -> 5.15 s (the packer's own bound 5.17 s)."""
    for k in range(p.K):
        depth, d = int(p.pp[k]), int(p.pipelines[k])
        mine = np.flatnonzero(p.uk == k)
        if not p.opts.anchor_rows or depth < 2 or not p.identical[k] or mine.size == 0:
            continue
        _anchors_of(p, k, depth, d, mine)


def _anchors_of(p: ProgramBuilder, k: int, depth: int, d: int, mine: np.ndarray) -> None:
    """Row 7 for strategy k (pipelines of ``depth`` stages, d of them) and its members ``mine`` (pair indices)."""
    ui, count, X, n = p.ui, p.count, p.X, float(p.n)
    utau = np.array([p.alone[p.units[u], k].min() for u in ui[mine]]) / depth  # each member's tau is at least
    vcoef = count[ui[mine]] * p.unu[ui[mine], k]  # x of it: at least this much nu (its least member's each)
    ranked = np.unique(utau)[::-1]
    picks = np.unique(np.geomspace(1, ranked.size, p.opts.anchor_levels).round().astype(int) - 1)
    theta = np.r_[ranked[picks], 0.0]
    js = sorted({q for q in (0, 1, 2, 3, d // 4, d // 2, (3 * d) // 4, d - 1) if 0 <= q < d})
    weights = np.diff(np.r_[-1, js])  # A_(j'+1) >= A_(j+1) for every j' in (previous j, j]
    tele_c, tele_v = [], []
    reached = None
    for level, delta in zip(theta[:-1], theta[:-1] - theta[1:]):
        above = utau >= level
        reach, coef = mine[above], vcoef[above]
        for jj, weight in zip(js, weights):
            v = p.new_binary()
            if jj == 0:  # any member reaching the level: some pipeline's fill reaches it
                p.add(np.zeros(reach.size + 1, dtype=np.int64), np.r_[X + reach, v],
                      np.r_[count[ui[reach]], -n], -np.inf, 0.0)
                reached = v
            else:  # more nu above the level than j pipelines hold next to such a fill (when any reaches it)
                p.add(np.zeros(reach.size + 3, dtype=np.int64), np.r_[X + reach, p.T + k, reached, v],
                      np.r_[coef, -float(jj), jj * (depth - 1) * level, -coef.sum()], -np.inf, 0.0)
            tele_c.append(v)
            tele_v.append(weight * delta * (depth - 1) / d)
    w_cols, w_vals = p.group_work(k)
    p.add(np.zeros(w_cols.size + len(tele_c) + 1, dtype=np.int64), np.r_[w_cols, tele_c, p.T + k],
          np.r_[w_vals, tele_v, -1.0], -np.inf, 0.0)


def pack_rows(p: ProgramBuilder) -> None:
    """*Row 8, packs* (given U; k's pipelines identical, pp = 1): a pack of at most ``cap`` tokens computes at most
    ``P = a cap^2 + b cap`` (``Q <= S^2``), so a pipeline of fewer than m packs computes at most ``(m - 1) P`` and
    one of m or more at most ``T_k - m c``. If ``T_k >= (m - 1) P + m c``, every pipeline computes at most ``T_k - m
    c`` and ``T_k >= W / d + m c`` (W: the group's work on its d pipelines); a binary per m (2 .. ``pack_rows``)
    picks which side of that level ``T_k`` is (big-M: ``2 U``, above every ``T_k`` and ``W / d`` of a grouping within
    U). Row 1 counts ``c`` per ``cap`` tokens, divisibly: 1.1 c where a full sequence and a tenth of one on every
    pipeline run two packs each."""
    upper_s = p.opts.upper_s
    for k in range(p.K):
        d = int(p.pipelines[k])
        if not p.opts.pack_rows or upper_s is None or p.pp[k] != 1 or not p.identical[k] or not (p.uk == k).any():
            continue
        rep = p.replicas[k][0]
        cost_ = rep.stage_costs[0]
        cap = float(rep.token_capacity)
        one_pack = cost_.a * cap * cap + cost_.b * cap  # the most any pack of at most cap tokens computes
        w_cols, w_vals = p.group_work(k, p.world / (d * len(p.plans[k].pipelines[0].stages[0].ranks)))
        big = 2.0 * upper_s  # above every T_k and W / d of a grouping within U
        for packs in range(2, p.opts.pack_rows + 1):  # T_k > (packs - 1) one_pack + packs c => T_k >= W / d + packs c
            h = p.new_binary()
            p.add(np.zeros(2, dtype=np.int64), np.r_[p.T + k, h], np.r_[1.0, -big], -np.inf,
                  (packs - 1) * one_pack + packs * cost_.c)
            p.add(np.zeros(w_cols.size + 2, dtype=np.int64), np.r_[w_cols, p.T + k, h], np.r_[w_vals, -1.0, big],
                  -np.inf, big - packs * cost_.c)


FAMILIES = (bucket_rows, assignment_rows, work_rows, alone_rows, size_rows, pair_rows, pipeline_rows,
            microbatch_rows, anchor_rows, pack_rows)
"""Every family, in the order its rows (and variables) come in the program."""
