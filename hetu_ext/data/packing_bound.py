"""The lower bound that certifies a packing: no assignment of the documents beats it (pure: numpy only).

Four bounds, the largest wins: the longest document, a fractional work bound, the exclusive documents (those
longer than half a pack never share a microbatch, so with F full-length pieces some replica runs ceil(F / R)
full packs), and for identical pipelined replicas an anchored bound counting the fill and drain each replica's
costliest document forces. Measured: with pp = 1 on Wikipedia lengths the results are within 0.5% of it; on a
heavy-tailed batch (lognormal sigma 2, 4K packs) the work bound alone left 6-9% where the exclusive term proves
the packer optimal; with pp > 1 the bound is loose (the relaxation lets microbatches shrink below a document),
e.g. 10-18% at 4K packs and pp = 4 while the MILP of the tests finds stage 2 optimal per replica and the whole
heuristic within 3.5% of the optimum on small instances.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from .replica_arrays import ReplicaArrays

if TYPE_CHECKING:
    from .packing import ReplicaSpec


def lower_bound_s(s: np.ndarray, replicas: Sequence[ReplicaSpec]) -> float:
    """Seconds that no assignment of documents ``s`` to ``replicas`` can beat on its slowest replica.

    The largest of these two bounds, :func:`_exclusive_bound`'s and, for identical pipelines, the anchored one.
    (1) The longest document: the microbatch holding it runs ``pp`` times on the critical path (once in steady
    state, ``pp - 1`` in fill and drain) on the best replica able to hold it.
    (2) Work: replica r's time is at least ``f_r(W) = W + c M + (pp - 1)(W / M + c)`` for its work W priced on one
    fixed stage (any one stage's time lower-bounds the slowest's) and any real M >= 1, minimised over M; with
    documents divisible, the best level T solves ``sum_r f_r^-1(T) = total work`` (bisection). Work is priced on
    replica 0's representative stage scaled by ``k_r = min(a_r / a_0, b_r / b_0)`` so it adds across replicas.
    """
    if s.size == 0:
        return 0.0
    rep = ReplicaArrays(replicas, s)
    smax = float(s.max())
    fits = rep.cap >= smax
    longest = float(np.min((rep.pp * (rep.ra * smax * smax + rep.rb * smax + rep.rc))[fits]))
    a0, b0 = rep.ra[0], rep.rb[0]
    ratios = [rep.ra / a0] if a0 > 0 else []
    ratios += [rep.rb / b0] if b0 > 0 else []
    k = np.min(ratios, axis=0) if ratios else np.ones_like(rep.ra)
    total = a0 * float(np.square(s, dtype=np.float64).sum()) + b0 * float(s.sum())
    if total <= 0 or not np.all(k > 0):
        return max(longest, _exclusive_bound(s, rep))
    lo, hi = 0.0, float(np.max(rep.pp * (total * k + rep.rc)))  # one replica alone reaches hi

    pp, c = rep.pp, rep.rc  # _inverse_f with its level-free parts computed once (the same arithmetic)
    fill = np.sqrt((pp - 1) * c)
    knee = np.divide(c, pp - 1, out=np.full_like(c, np.inf), where=pp > 1)
    single = pp == 1

    def work_at(level: float) -> float:
        big = np.square(np.maximum(math.sqrt(level) - fill, 0.0))
        w = np.where(single, level - c, np.where(big >= knee, big, level / pp - c))
        return float(np.sum(np.maximum(w, 0.0) / k))

    for _ in range(100):
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            break
        lo, hi = (lo, mid) if work_at(mid) >= total else (mid, hi)
    bound = max(longest, lo, _exclusive_bound(s, rep))  # lo: a level whose capacities fall short of the work
    if _identical(rep) and rep.pp[0] > 1:  # with pp = 1 the costliest document adds no fill and drain
        bound = max(bound, _anchored_bound(s, rep, bound))
    return bound


def _exclusive_bound(s: np.ndarray, rep: ReplicaArrays, candidates: int = 48) -> float:
    """Documents longer than half the largest token capacity never share a microbatch (two of them exceed every
    capacity), so a replica holding n of them runs n microbatches, each costing at least its document's time alone
    (``t_r(x) = max_j a_j x^2 + b_j x + c_j`` over its stages). For any set D of such documents, replica r holding
    n of D runs at least ``g_r(n) = sum of D's n cheapest it can hold + (pp_r - 1) x the n-th cheapest``; every
    document of D lands somewhere, so the slowest replica is at least the |D|-th smallest of all ``g_r(n)``
    (n = 1..|D|, every replica). D = the k longest such documents, for every k (identical replicas) or for
    ``candidates`` of them (the ends of runs of equal length first): with identical replicas and F full-length
    packs (what a heavy-tailed batch cut at the pack length leaves) that is ``ceil(F / R)`` full packs plus the
    fill and drain. Replicas with the same stages, pp and capacity are priced once."""
    big = np.sort(s[s * 2 > int(rep.cap.max())]).astype(np.float64)[::-1]  # longest first
    if big.size == 0:
        return 0.0
    p = rep.a.shape[1]
    kinds: dict[tuple[float, ...], int] = {}  # the distinct rows (as np.unique(axis=0) finds them) and their counts
    for row in np.column_stack([rep.a, rep.b, rep.c, rep.pp, rep.cap]).tolist():
        kinds[tuple(row)] = kinds.get(tuple(row), 0) + 1
    priced = []  # per kind of replica: (count, pp, cost of each of ``big`` on it or inf where it cannot hold it)
    for row in sorted(kinds):
        count, key = kinds[row], np.array(row)
        a, b, c, pp, cap = key[:p], key[p:2 * p], key[2 * p:3 * p], key[3 * p], key[3 * p + 1]
        t = np.max(np.outer(big * big, a) + np.outer(big, b) + c, axis=1)
        priced.append((int(count), float(pp), np.where(big <= cap, t, np.inf)))
    if len(priced) == 1 and np.all(np.isfinite(priced[0][2])):  # identical replicas: every k at once
        count, pp, t = priced[0]  # t is non-increasing (longest first)
        k = np.arange(1, big.size + 1)
        n = -(-k // count)  # ceil(k / R) of the k longest on one replica: the cheapest n are t[k - n .. k - 1]
        prefix = np.concatenate([[0.0], np.cumsum(t)])
        return float(np.max(prefix[k] - prefix[k - n] + (pp - 1) * t[k - n]))
    ends = np.flatnonzero(np.diff(big) != 0) + 1  # the k where a run of equal lengths ends
    ks = np.unique(np.concatenate([ends[:candidates // 2], np.geomspace(1, big.size, candidates // 2).astype(int),
                                   [big.size]]))
    prepared = []  # per kind: (count, pp, t, its first finite entry, whether t is non-increasing from there)
    for count, pp, t in priced:
        first = int(np.count_nonzero(~np.isfinite(t)))  # the documents it cannot hold are the longest: a prefix
        prepared.append((count, pp, t, first, bool(np.all(t[first + 1:] <= t[first:-1]))))
    best = 0.0
    for k in ks:
        values, weights = [], []
        for count, pp, t, first, falling in prepared:
            held = t[first:k][::-1] if falling else np.sort(t[first:k])  # cheapest first: sum and n-th both least
            values.append(np.cumsum(held) + (pp - 1) * held)
            weights.append(np.full(held.size, count))
        # the answer is the least value whose kinds' slots up to it reach k, so at most any kind's value at
        # ceil(k / count) slots: when none of those beats ``best``, this k cannot raise it
        ceiling = min((float(v[-(-k // c) - 1]) for v, (c, *_) in zip(values, prepared) if -(-k // c) <= v.size),
                      default=np.inf)
        if ceiling <= best:
            continue
        v, w = np.concatenate(values), np.concatenate(weights)
        order = np.argsort(v, kind="stable")
        at = int(np.searchsorted(np.cumsum(w[order]), k, side="left"))
        if at < v.size:  # (else fewer slots than documents: no assignment exists; other bounds decide)
            best = max(best, float(v[order][at]))
    return best


def _identical(rep: ReplicaArrays) -> bool:
    return bool(np.all(rep.pp == rep.pp[0]) and np.all(rep.ra == rep.ra[0]) and np.all(rep.rb == rep.rb[0])
                and np.all(rep.rc == rep.rc[0]) and np.all(rep.cap == rep.cap[0]))


def _work_capacity(levels: np.ndarray, m: np.ndarray, pp: float, c: float, steps: int = 16) -> np.ndarray:
    """Most work a replica can hold within ``levels`` seconds (shape (L, 1)) when its costliest document costs
    ``m`` (broadcast to (L, K)); -1 where even that document alone exceeds the level. Lower-bound model:
    ``W + c M + (pp - 1)(max(W / M, m) + c)`` minimised over real ``1 <= M <= max(1, W / m)`` (past W / m the fill
    is set by m and more microbatches only add c), increasing in W, inverted by bisection."""
    m = np.broadcast_to(m, np.broadcast_shapes(levels.shape, np.shape(m))).astype(np.float64)

    def f(w: np.ndarray) -> np.ndarray:
        m_hi = np.maximum(1.0, np.divide(w, m, out=np.full_like(w, np.inf), where=m > 0))
        if c <= 0:  # microbatches are free: as many as it takes for the fill to reach m (w / inf = 0)
            return w + (pp - 1) * np.maximum(w / m_hi, m)
        mm = np.clip(np.sqrt((pp - 1) * w / c), 1.0, m_hi)
        return w + (pp - 1) * c + c * mm + (pp - 1) * np.maximum(w / mm, m)

    lo, hi = m.copy(), np.broadcast_to(levels, m.shape).astype(np.float64)
    ok = f(lo) <= levels
    for _ in range(steps):
        mid = (lo + hi) / 2
        good = f(mid) <= levels
        lo, hi = np.where(good, mid, lo), np.where(good, hi, mid)
    return np.where(ok, hi, -1.0)  # the upper end: capacity over-estimated, so the bound stays valid


def _anchored_bound(s: np.ndarray, rep: ReplicaArrays, start: float, grid: int = 24, rounds: int = 2) -> float:
    """Identical replicas: a level T is feasible only if the replicas' capacities, each lowered by the costliest
    document it must hold, cover the work.

    * J_k: if the k costliest documents (costs d_1 >= .. >= d_k) do not fit in fewer than J_k replicas (by
      volume: the forced anchors below hold C_T of their own, any other replica at most C_T(d_k); or by count: a
      replica holds at most ``floor(C_T(d_k) / d_k)`` of them), at least J_k replicas hold a document costing
      >= d_k, so the j-th costliest replica maximum is >= d_k for the first k with J_k >= j;
    * forced anchors: a document d_k larger than the spare room ``C_T(d_{k-1}) - d_{k-1}`` of any bigger anchor is
      itself the maximum of its replica, so the j-th costliest maximum is also >= the j-th such document.

    The total capacity is then at most sum_j C_T(that anchor). Levels are tested ``grid`` at a time (vectorised)
    from ``start`` (a valid bound) up; the returned level is one that failed, so the bound stays valid."""
    r = rep.pp.size
    pp, c = float(rep.pp[0]), float(rep.rc[0])
    d = np.sort(rep.ra[0] * np.square(s, dtype=np.float64) + rep.rb[0] * s)[::-1]
    total = float(d.sum())
    top = d[:min(d.size, 4 * r + 1)]
    prefix, count = np.cumsum(top), np.arange(1, top.size + 1)

    def feasible(levels: np.ndarray) -> np.ndarray:
        cap = _work_capacity(levels[:, None], top[None, :], pp, c)  # (L, K)
        bad = np.any(cap < 0, axis=1)
        cap = np.where(cap > 0, cap, np.inf)
        # a document too big to join the roomiest bigger anchor (d_{k-1}'s spare C - d) anchors a replica itself
        forced = np.concatenate([np.ones((levels.size, 1), bool), top[None, 1:] > (cap - top)[:, :-1]], axis=1)
        room = np.cumsum(np.where(forced, cap, 0.0), axis=1)  # what the forced replicas among the top k hold
        by_volume = np.cumsum(forced, axis=1) + np.ceil(np.maximum(prefix - room, 0.0) / cap - 1e-12)
        by_count = np.ceil(count / np.floor(cap / np.maximum(top, 1e-300) + 1e-12) - 1e-12)
        need = np.maximum.accumulate(np.maximum(by_volume, by_count), axis=1)
        bad |= need[:, -1] > r
        first = np.stack([np.searchsorted(row, np.arange(1, r + 1), side="left") for row in need])  # (L, R)
        for row in range(levels.size):
            where = np.flatnonzero(forced[row])[:r]
            first[row, :where.size] = np.minimum(first[row, :where.size], where)
        anchors = np.where(first < top.size, top[np.minimum(first, top.size - 1)], 0.0)
        return ~bad & (_work_capacity(levels[:, None], anchors, pp, c).sum(axis=1) >= total)

    lo, hi = start, 2 * start
    while not feasible(np.array([hi]))[0]:
        lo, hi = hi, 2 * hi
    for _ in range(rounds):
        levels = np.linspace(lo, hi, grid + 2)[1:-1]
        ok = feasible(levels)
        k = int(np.argmax(ok)) if ok.any() else grid
        lo, hi = (levels[k - 1] if k > 0 else lo), (levels[k] if k < grid else hi)
    return max(start, lo)


def _inverse_f(level: float, pp: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Largest work W with f(W) <= level, f as in :func:`lower_bound_s` (closed form per replica).

    pp = 1: f = W + c. pp > 1: the optimum M* = sqrt((pp - 1) W / c) >= 1 gives f = (sqrt W + sqrt((pp - 1) c))^2;
    below W = c / (pp - 1), M = 1 gives f = pp (W + c).
    """
    fill = np.sqrt((pp - 1) * c)
    big = np.square(np.maximum(math.sqrt(level) - fill, 0.0))
    small = level / pp - c
    knee = np.divide(c, pp - 1, out=np.full_like(c, np.inf), where=pp > 1)
    w = np.where(pp == 1, level - c, np.where(big >= knee, big, small))
    return np.maximum(w, 0.0)



def may_fit_within(s: np.ndarray, replicas: Sequence[ReplicaSpec], level: float, *, thresholds: int = 32) -> bool:
    """False only if no assignment of documents ``s`` to ``replicas`` has its slowest replica within ``level``
    seconds: a test that also counts where long documents may go, for pipelines of different shapes (Hydraulis's
    selection asks it before packing a candidate only to compare it with the best so far).

    At level T, replica r (representative stage ``a_r s^2 + b_r s + c_r``, ``pp_r`` stages, capacity ``cap_r``)
    can hold a document of ``n`` tokens only if ``n <= cap_r`` and ``pp_r (a_r n^2 + b_r n + c_r) <= T`` (its
    microbatch runs once in steady state and ``pp_r - 1`` times in fill and drain), and if it holds any document
    of at least L tokens, its work is at most ``C_r(T, m_r(L))`` (:func:`_work_capacity`: the most work whose
    1F1B time, microbatches chosen freely, stays within T when the costliest document costs
    ``m_r(L) = a_r L^2 + b_r L``; it falls as that cost grows; -1 where that document alone exceeds T). Every
    document of at least L tokens lands on a replica that can hold it, so, for every L, their work priced on
    replica 0 (``w_0 <= w_r / k_r``, ``k_r = min(a_r / a_0, b_r / b_0)`` as in :func:`lower_bound_s`) is at most
    ``sum_r C_r(T, m_r(L)) / k_r`` over the replicas able to hold an L-token document. If that fails for one L
    (``thresholds`` lengths: the longest documents' and a geometric spread of the rest), T is below every
    assignment's slowest replica. Capacities are evaluated at ``T (1 + 1e-9)`` and over-estimated by the
    bisection, so rounding only weakens the test (True when unsure)."""
    s = np.asarray(s, dtype=np.int64).reshape(-1)
    if s.size == 0 or not level > 0:
        return True
    rep = ReplicaArrays(replicas, s)
    if np.any(rep.ra < 0) or np.any(rep.rb < 0):  # costs not monotone in length: unsure
        return True
    a0, b0 = rep.ra[0], rep.rb[0]
    ratios = [rep.ra / a0] if a0 > 0 else []
    ratios += [rep.rb / b0] if b0 > 0 else []
    if not ratios:
        return True
    k = np.min(ratios, axis=0)
    if not np.all(k > 0):
        return True
    n = np.sort(s)[::-1].astype(np.float64)  # longest first
    work = np.cumsum(a0 * n * n + b0 * n)
    at = np.unique(np.geomspace(1, n.size, thresholds).astype(np.int64)) - 1
    lengths = np.unique(n[at])  # the thresholds L
    need = work[np.searchsorted(-n, -lengths, side="right") - 1]  # the work of the documents of at least L tokens
    kinds: dict[tuple[float, ...], int] = {}
    for row in zip(rep.ra.tolist(), rep.rb.tolist(), rep.rc.tolist(), rep.pp.tolist(), rep.cap.tolist(),
                   k.tolist()):
        kinds[row] = kinds.get(row, 0) + 1
    room = np.zeros(lengths.size)
    top = np.array([[level * (1 + 1e-9)]])
    for (a, b, c, pp, cap, kk), num in kinds.items():
        held = _work_capacity(top, (a * lengths * lengths + b * lengths)[None, :], pp, c)[0]
        room += np.where((held >= 0) & (cap >= lengths), held, 0.0) * (num / kk)
    return bool(np.all(room >= need))
