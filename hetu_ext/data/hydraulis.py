"""Hydraulis' two-stage length-aware assignment, and the lower bound that certifies it (pure: numpy only).

Notation: replica r has stages j with per-microbatch cost ``a_j Q + b_j S + c_j`` (Q, S: squared and plain tokens
of the microbatch), ``pp_r`` stages and a token capacity ``cap_r``. Its *representative* stage ``j_r`` is the one
slowest on an even share of the batch; stage 1 and the bound price documents there:
``w_r(s) = a_r s^2 + b_r s``.

Stage 1 (across replicas), documents longest first: each goes to the replica whose estimated time after taking
it is lowest, the estimate being ``W + c M + (pp - 1) max(W / M + c, d + c)`` with ``W`` its work, ``d`` its most
expensive document and ``M`` the microbatch count that balances ``c M`` against the fill and drain
(``sqrt((pp - 1) W / c)``, at least ``ceil(tokens / cap)``). Related-machines LPT: every document lands where it
finishes first; replicas of identical shape share a heap, so a document costs O(classes + log R). Then, while it
helps, a document is moved or two swapped between the slowest replica and one of
the fastest, the candidate chosen by the estimate and accepted only if stage 2 confirms a lower maximum.

Stage 2 (inside a replica) picks the microbatch count M >= the first-fit-decreasing count and, for each M, packs
documents longest first into the least loaded microbatch that has room (capacity-aware LPT); it keeps the M of
lowest ``sum + (pp - 1) max``, stopping once ``W + c M + (pp - 1)(d + c)`` exceeds the best found.

Bound (:func:`lower_bound_s`): the longest document, a fractional work bound, and for identical pipelined
replicas an anchored bound counting the fill and drain each replica's costliest document forces. Measured: with
pp = 1 on Wikipedia lengths the results are within 0.5% of it; with pp > 1 the bound is loose (the relaxation
lets microbatches shrink below a document), e.g. 10-18% at 4K packs and pp = 4 while the MILP of the tests finds
stage 2 optimal per replica and the whole heuristic within 3.5% of the optimum on small instances.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .packing import ReplicaSpec

_MAX_EXTRA_MICROBATCHES = 32  # stage 2 tries at most this many counts above first-fit-decreasing's


class _Replicas:
    """Stage coefficients of all replicas as arrays: a, b, c of shape (R, P_max) padded with zeros."""

    def __init__(self, replicas: Sequence[ReplicaSpec], s: np.ndarray) -> None:
        r, p = len(replicas), max(x.pp for x in replicas)
        self.a, self.b, self.c = (np.zeros((r, p)) for _ in range(3))
        for k, x in enumerate(replicas):
            for j, cost in enumerate(x.stage_costs):
                self.a[k, j], self.b[k, j], self.c[k, j] = cost.a, cost.b, cost.c
        self.pp = np.array([x.pp for x in replicas], dtype=np.float64)
        self.cap = np.array([x.token_capacity for x in replicas], dtype=np.int64)
        share_q, share_s = float(np.square(s, dtype=np.float64).sum()) / r, float(s.sum()) / r
        rep = np.argmax(self.a * share_q + self.b * share_s + self.c, axis=1)
        rows = np.arange(r)
        self.ra, self.rb, self.rc = self.a[rows, rep], self.b[rows, rep], self.c[rows, rep]
        self.stages = [[(c.a, c.b, c.c) for c in x.stage_costs] for x in replicas]
        """Per replica, (a, b, c) of each stage as Python floats (stage 2 works on small lists)."""
        self.lengths: list[int] = s.tolist()


def lower_bound_s(s: np.ndarray, replicas: Sequence[ReplicaSpec]) -> float:
    """Seconds that no assignment of documents ``s`` to ``replicas`` can beat on its slowest replica.

    The larger of two bounds. (1) The longest document: the microbatch holding it runs ``pp`` times on the
    critical path (once in steady state, ``pp - 1`` in fill and drain) on the best replica able to hold it.
    (2) Work: replica r's time is at least ``f_r(W) = W + c M + (pp - 1)(W / M + c)`` for its work W priced on one
    fixed stage (any one stage's time lower-bounds the slowest's) and any real M >= 1, minimised over M; with
    documents divisible, the best level T solves ``sum_r f_r^-1(T) = total work`` (bisection). Work is priced on
    replica 0's representative stage scaled by ``k_r = min(a_r / a_0, b_r / b_0)`` so it adds across replicas.
    """
    if s.size == 0:
        return 0.0
    rep = _Replicas(replicas, s)
    smax = float(s.max())
    fits = rep.cap >= smax
    longest = float(np.min((rep.pp * (rep.ra * smax * smax + rep.rb * smax + rep.rc))[fits]))
    a0, b0 = rep.ra[0], rep.rb[0]
    ratios = [rep.ra / a0] if a0 > 0 else []
    ratios += [rep.rb / b0] if b0 > 0 else []
    k = np.min(ratios, axis=0) if ratios else np.ones_like(rep.ra)
    total = a0 * float(np.square(s, dtype=np.float64).sum()) + b0 * float(s.sum())
    if total <= 0 or not np.all(k > 0):
        return longest
    lo, hi = 0.0, float(np.max(rep.pp * (total * k + rep.rc)))  # one replica alone reaches hi

    def work_at(level: float) -> float:
        return float(np.sum(_inverse_f(level, rep.pp, rep.rc) / k))

    for _ in range(100):
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            break
        lo, hi = (lo, mid) if work_at(mid) >= total else (mid, hi)
    bound = max(longest, lo)  # lo: a level whose capacities fall short of the work
    if _identical(rep) and rep.pp[0] > 1:  # with pp = 1 the costliest document adds no fill and drain
        bound = max(bound, _anchored_bound(s, rep, bound))
    return bound


def _identical(rep: _Replicas) -> bool:
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
        m_star = np.sqrt((pp - 1) * w / c) if c > 0 else m_hi
        mm = np.clip(m_star, 1.0, m_hi)
        return w + (pp - 1) * c + c * mm + (pp - 1) * np.maximum(w / mm, m)

    lo, hi = m.copy(), np.broadcast_to(levels, m.shape).astype(np.float64)
    ok = f(lo) <= levels
    for _ in range(steps):
        mid = (lo + hi) / 2
        good = f(mid) <= levels
        lo, hi = np.where(good, mid, lo), np.where(good, hi, mid)
    return np.where(ok, hi, -1.0)  # the upper end: capacity over-estimated, so the bound stays valid


def _anchored_bound(s: np.ndarray, rep: _Replicas, start: float, grid: int = 24, rounds: int = 2) -> float:
    """Identical replicas: a level T is feasible only if the replicas' capacities, each lowered by the costliest
    document it must hold, cover the work. If the k costliest documents (costs d_1 >= .. >= d_k) do not fit in
    fewer than J_k replicas of capacity C_T(d_k) (by volume, ``prefix_k / C_T(d_k)``, or by count, a replica
    holding at most ``floor(C_T(d_k) / d_k)`` of them), at least J_k replicas hold a document costing >= d_k, so the
    j-th costliest replica maximum is >= d_k for the first k with J_k >= j, and the total capacity is at most
    sum_j C_T(that d_k). Levels are tested ``grid`` at a time (vectorised) from ``start`` (a valid bound) up."""
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
        per_replica = np.floor(cap / np.maximum(top, 1e-300) + 1e-12)  # documents costing >= d_k one can hold
        need = np.maximum.accumulate(np.maximum(np.ceil(prefix / cap - 1e-12), np.ceil(count / per_replica - 1e-12)),
                                     axis=1)
        bad |= need[:, -1] > r
        first = np.stack([np.searchsorted(row, np.arange(1, r + 1), side="left") for row in need])  # (L, R)
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


def assign_hetu(s: np.ndarray, replicas: Sequence[ReplicaSpec]) -> list[list[list[int]]]:
    """[replica][microbatch] -> document indices: stage 1 across replicas, stage 2 within each."""
    rep = _Replicas(replicas, s)
    shares = _stage1(s, rep)
    packed = [_stage2(s, share, rep, r) for r, share in enumerate(shares)]
    _refine(s, rep, shares, packed)
    return [packs for packs, _ in packed]


def _estimate(w: float, tokens: float, d: float, n: int, pp: float, c: float, cap: float) -> float:
    """Estimated replica seconds with work w, tokens, costliest document d and n documents (module docstring)."""
    m_lo = max(1.0, math.ceil(tokens / cap))
    m_star = math.sqrt((pp - 1) * w / c) if c > 0 else float(n)
    m = max(min(m_star, float(n)), m_lo)
    return w + c * m + (pp - 1) * (max(w / m, d) + c)


def _stage1(s: np.ndarray, rep: _Replicas) -> list[list[int]]:
    """Documents longest first, each to the replica whose estimated time after taking it is lowest.

    Replicas with identical coefficients, depth and capacity form a class; within a class the replica with the
    lowest current estimate is the candidate (a heap), so a step costs O(classes + log R), not O(R)."""
    r = rep.pp.size
    keys = list(zip(rep.ra.tolist(), rep.rb.tolist(), rep.rc.tolist(), rep.pp.tolist(), rep.cap.tolist()))
    classes: dict[tuple, list[tuple[float, int]]] = {}
    for k, key in enumerate(keys):
        classes.setdefault(key, []).append((0.0, k))  # (current estimate, replica): already a heap
    state = [[0.0, 0.0, 0.0, 0] for _ in range(r)]  # work, tokens, costliest document, documents
    shares: list[list[int]] = [[] for _ in range(r)]
    order = np.lexsort((np.arange(s.size), -s))
    for i, length in zip(order.tolist(), s[order].tolist()):
        best = None
        for (a, b, c, pp, cap), heap in classes.items():
            if cap < length:
                continue
            k = heap[0][1]
            w, tokens, d, n = state[k]
            cost = a * length * length + b * length
            est = _estimate(w + cost, tokens + length, max(d, cost), n + 1, pp, c, cap)
            if best is None or (est, k) < best[:2]:
                best = (est, k, cost, heap)
        est, k, cost, heap = best
        st = state[k]
        st[0] += cost
        st[1] += length
        st[2] = max(st[2], cost)
        st[3] += 1
        shares[k].append(i)
        heapq.heapreplace(heap, (est, k))
    return shares


def _stage2(s: np.ndarray, idx: Sequence[int], rep: _Replicas, r: int) -> tuple[list[list[int]], float]:
    """Microbatches of replica r's documents ``idx`` and their predicted seconds (pure Python: shares are small)."""
    if len(idx) == 0:
        return [], 0.0
    cap, pp, c = int(rep.cap[r]), float(rep.pp[r]), float(rep.rc[r])
    a, b, sl = float(rep.ra[r]), float(rep.rb[r]), rep.lengths
    order = sorted(idx, key=lambda i: (-sl[i], i))
    lens = [sl[i] for i in order]
    best = _first_fit(order, lens, cap)
    best_t = _time(best, rep, r)
    if pp == 1:
        return best, best_t
    weights = [a * n * n + b * n for n in lens]
    total, top = sum(weights), weights[0]
    m_star = math.sqrt((pp - 1) * total / c) if c > 0 else float(len(lens))
    for m in range(len(best) + 1, min(len(lens), len(best) + _MAX_EXTRA_MICROBATCHES) + 1):
        if total + c * m + (pp - 1) * (max(total / m, top) + c) >= best_t:
            if m > m_star:
                break
            continue
        packs = _lpt(order, lens, weights, cap, m)
        if packs is not None:
            t = _time(packs, rep, r)
            if t < best_t:
                best, best_t = packs, t
    return best, best_t


def _first_fit(ids: list[int], lens: list[int], cap: int) -> list[list[int]]:
    packs: list[list[int]] = []
    free: list[int] = []
    for i, n in zip(ids, lens):
        for k, room in enumerate(free):
            if room >= n:
                packs[k].append(i)
                free[k] -= n
                break
        else:
            packs.append([i])
            free.append(cap - n)
    return packs


def _lpt(ids: list[int], lens: list[int], weights: list[float], cap: int, m: int) -> list[list[int]] | None:
    """Longest first into the least loaded of m microbatches with room; None if one does not fit anywhere."""
    packs: list[list[int]] = [[] for _ in range(m)]
    load, used = [0.0] * m, [0] * m
    for i, n, w in zip(ids, lens, weights):
        best = -1
        for k in range(m):
            if used[k] + n <= cap and (best < 0 or load[k] < load[best]):
                best = k
        if best < 0:
            return None
        packs[best].append(i)
        load[best] += w
        used[best] += n
    return packs if all(packs) else None


def _time(packs: list[list[int]], rep: _Replicas, r: int) -> float:
    """Predicted 1F1B seconds of replica r running ``packs`` (packing.ReplicaSpec.time_s, on Python lists)."""
    if not packs:
        return 0.0
    sl, stages = rep.lengths, rep.stages[r]
    times = []
    for pack in packs:
        q = tok = 0
        for i in pack:
            n = sl[i]
            q += n * n
            tok += n
        times.append(max(a * q + b * tok + c for a, b, c in stages))
    return sum(times) + (len(stages) - 1) * max(times)


def _refine(s: np.ndarray, rep: _Replicas, shares: list[list[int]],
            packed: list[tuple[list[list[int]], float]], max_steps: int | None = None,
            candidates: int = 4) -> None:
    """Move one document, or swap two, between the slowest replica and one of the ``candidates`` fastest while
    stage 2 confirms the pair's maximum drops (in place)."""
    r_count = len(shares)
    for _ in range(max_steps if max_steps is not None else 2 * r_count):
        times = np.array([t for _, t in packed])
        r = int(np.argmax(times))
        improved = False
        for q in np.argsort(times, kind="stable")[:candidates].tolist():
            if q == r:
                continue
            trial = _best_exchange(s, rep, shares, times, r, q)
            if trial is None:
                continue
            new_r, new_q = trial
            pr = _stage2(s, new_r, rep, r)
            pq = _stage2(s, new_q, rep, q)
            if max(pr[1], pq[1]) < times[r] * (1 - 1e-9):
                shares[r], shares[q], packed[r], packed[q] = new_r, new_q, pr, pq
                improved = True
                break
        if not improved:
            return


def _best_exchange(s: np.ndarray, rep: _Replicas, shares: list[list[int]], times: np.ndarray, r: int,
                   q: int) -> tuple[list[int], list[int]] | None:
    """The move (r -> q) or swap whose estimated pair maximum is lowest, if below replica r's time."""
    dr, dq = np.asarray(shares[r], dtype=np.int64), np.asarray(shares[q], dtype=np.int64)
    if dr.size == 0:
        return None
    lr, lq = s[dr].astype(np.float64), s[dq].astype(np.float64)
    on_r = lambda x: rep.ra[r] * x * x + rep.rb[r] * x
    on_q = lambda x: rep.ra[q] * x * x + rep.rb[q] * x
    gain_r, cost_q = on_r(lr), on_q(lr)
    moves = np.maximum(times[r] - gain_r, times[q] + cost_q)
    moves[lr > rep.cap[q]] = np.inf
    best_move = int(np.argmin(moves))
    best, pick = moves[best_move], (best_move, -1)
    if dq.size:
        swap = np.maximum(times[r] - gain_r[:, None] + on_r(lq)[None, :],
                          times[q] - on_q(lq)[None, :] + cost_q[:, None])
        swap[(lr[:, None] > rep.cap[q]) | (lq[None, :] > rep.cap[r])] = np.inf
        swap[lr[:, None] == lq[None, :]] = np.inf
        flat = int(np.argmin(swap))
        if swap.flat[flat] < best:
            best, pick = swap.flat[flat], divmod(flat, dq.size)
    if not best < times[r]:
        return None
    i, j = pick
    new_r = [x for k, x in enumerate(shares[r]) if k != i] + ([int(dq[j])] if j >= 0 else [])
    new_q = [x for k, x in enumerate(shares[q]) if k != j] + [int(dr[i])]
    return new_r, new_q
