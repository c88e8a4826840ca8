"""Hydraulis' two-stage length-aware assignment (pure: numpy only).

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

Stage 2 (inside a replica) starts from first-fit-decreasing (the fewest microbatches: optimal for pp = 1) and,
for pp > 1, tries the counts M within 3 of the one its convex estimate ``W + c M + (pp - 1)(max(W / M, d) + c)``
prefers (``sqrt((pp - 1) W / c)``, at most ``W / d + 1``), packing documents longest first into the least
loaded microbatch that has room (capacity-aware LPT); it keeps the packing of lowest ``sum + (pp - 1) max``.

With pipelines, stage 1 also runs level-based first-fit-decreasing (MULTIFIT, :func:`stage1_levels`), which
groups long documents together and short ones together so fewer replicas pay a long fill and drain; the better
of the two stage-1 results (after stage 2) is refined. Without pipelines it runs where replicas hold few
documents (``_FEW``), where LPT's lumps cost most.

The modules: this one (the assignment, stage 1's LPT and the refinement), :mod:`.two_stage_levels` (stage 1's
level search), :mod:`.two_stage_microbatches` (stage 2), :mod:`.replica_arrays` (the replicas' costs as arrays).
The lower bound that certifies results is in :mod:`hetu_ext.data.packing_bound`.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from .replica_arrays import ReplicaArrays
from .two_stage_levels import stage1_levels
from .two_stage_microbatches import stage2, stage2_floor

if TYPE_CHECKING:
    from .packing import ReplicaSpec

_FEW = 4
"""Documents per replica up to which pp = 1 replicas try MULTIFIT too. LPT's worst case is ``1 + 1/k - 1/(k R)``
when the replica finishing last holds k documents (Coffman and Sethi, 1976): with few long documents it may put
three mid-length ones on one replica where MULTIFIT pairs them with short ones (13 documents on 4 replicas: 5.55 s
against the optimal 5.19 s). With many documents LPT is within rounding of the bound, and the level search would
only cost time."""


def assign_hetu(s: np.ndarray, replicas: Sequence[ReplicaSpec], *, bound_s: float = 0.0) -> list[list[list[int]]]:
    """[replica][microbatch] -> document indices: stage 1 across replicas, stage 2 within each.

    With pipelines (some pp > 1), or with few documents per replica (at most ``_FEW``), stage 1 also tries
    level-based first-fit-decreasing (:func:`stage1_levels`) and keeps whichever of the two gives the lower
    slowest replica after stage 2; then refines that one. With few documents (cheap) both are refined and the
    better kept, so the result is never worse than LPT's alone (refining may favour either start: on random
    instances of 1-4 documents per replica, refining only MULTIFIT's lost up to 2.3% against LPT's on 6% of
    them). ``bound_s``: a lower bound on the slowest replica (seconds), where the level search starts."""
    rep = ReplicaArrays(replicas, s)
    shares = _stage1(s, rep)
    packed = [stage2(s, share, rep, r) for r, share in enumerate(shares)]
    few = s.size <= _FEW * len(replicas)
    cutoff = max((t for _, t in packed), default=0.0)
    if (few or np.any(rep.pp > 1)) and s.size and cutoff > bound_s * (1 + 1e-3):  # else optimal
        other = stage1_levels(s, rep, cutoff, bound_s)
        if other is not None:
            packed_other: list[tuple[list[list[int]], float]] | None = []
            for r, share in enumerate(other):  # kept only if every replica beats the cutoff: stop at the first not
                if stage2_floor(share, rep, r) * (1 - 1e-9) >= cutoff:
                    packed_other = None
                    break
                packed_other.append(stage2(s, share, rep, r))
                if not packed_other[-1][1] < cutoff:
                    packed_other = None
                    break
            if packed_other is not None and few:  # cheap: refine both starts, keep the better (LPT's on ties)
                _refine(s, rep, other, packed_other)
                _refine(s, rep, shares, packed)
                best = min(packed, packed_other, key=lambda p: max(t for _, t in p))
                return [packs for packs, _ in best]
            if packed_other is not None:
                shares, packed = other, packed_other
    _refine(s, rep, shares, packed)
    return [packs for packs, _ in packed]


def _estimate(w: float, tokens: float, d: float, n: int, pp: float, c: float, cap: float) -> float:
    """Estimated replica seconds with work w, tokens, costliest document d and n documents (module docstring)."""
    m_lo = max(1.0, math.ceil(tokens / cap))
    m_star = math.sqrt((pp - 1) * w / c) if c > 0 else float(n)
    m = max(min(m_star, float(n)), m_lo)
    return w + c * m + (pp - 1) * (max(w / m, d) + c)


def _stage1(s: np.ndarray, rep: ReplicaArrays) -> list[list[int]]:
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
    kinds = [(a, b, c, pp, cap, pp - 1, heap) for (a, b, c, pp, cap), heap in classes.items()]
    sqrt, ceil = math.sqrt, math.ceil
    for i, length in zip(order.tolist(), s[order].tolist()):
        best_est = best_k = best_cost = best_heap = None
        for a, b, c, pp, cap, fill, heap in kinds:
            if cap < length:
                continue
            k = heap[0][1]
            w, tokens, d, n = state[k]
            cost = a * length * length + b * length
            # _estimate(w + cost, tokens + length, max(d, cost), n + 1, pp, c, cap), inlined (same arithmetic)
            # (max and min written as conditionals that pick the same operand as the builtins do)
            w += cost
            fn = float(n + 1)
            m_lo = ceil((tokens + length) / cap)
            if not m_lo > 1.0:
                m_lo = 1.0
            m = sqrt(fill * w / c) if c > 0 else fn
            if fn < m:
                m = fn
            if m_lo > m:
                m = m_lo
            wm = w / m
            if cost > d:
                d = cost
            est = w + c * m + fill * ((d if d > wm else wm) + c)
            if best_est is None or est < best_est or (est == best_est and k < best_k):
                best_est, best_k, best_cost, best_heap = est, k, cost, heap
        est, k, cost, heap = best_est, best_k, best_cost, best_heap
        st = state[k]
        st[0] += cost
        st[1] += length
        st[2] = max(st[2], cost)
        st[3] += 1
        shares[k].append(i)
        heapq.heapreplace(heap, (est, k))
    return shares


def _refine(s: np.ndarray, rep: ReplicaArrays, shares: list[list[int]],
            packed: list[tuple[list[list[int]], float]], max_steps: int | None = None,
            candidates: int = 4, tries: int = 3) -> None:
    """Move one document, or swap two, between the slowest replica and one of the ``candidates`` fastest while
    stage 2 confirms the pair's maximum drops (in place); per pair, the ``tries`` best exchanges by estimate."""
    r_count = len(shares)
    for _ in range(max_steps if max_steps is not None else 2 * r_count):
        times = np.array([t for _, t in packed])
        r = int(np.argmax(times))
        improved = False
        for q in np.argsort(times, kind="stable")[:candidates].tolist():
            if q == r:
                continue
            goal = times[r] * (1 - 1e-9)
            for new_r, new_q in _exchanges(s, rep, shares, times, r, q, tries):
                # stage 2 only where its floor leaves room (a margin far above rounding: the same decisions)
                if stage2_floor(new_q, rep, q) * (1 - 1e-9) >= goal or \
                        stage2_floor(new_r, rep, r) * (1 - 1e-9) >= goal:
                    continue
                pq = stage2(s, new_q, rep, q)
                if not pq[1] < goal:
                    continue
                pr = stage2(s, new_r, rep, r)
                if max(pr[1], pq[1]) < goal:
                    shares[r], shares[q], packed[r], packed[q] = new_r, new_q, pr, pq
                    improved = True
                    break
            if improved:
                break
        if not improved:
            return


def _exchanges(s: np.ndarray, rep: ReplicaArrays, shares: list[list[int]], times: np.ndarray, r: int, q: int,
               top: int) -> list[tuple[list[int], list[int]]]:
    """Up to ``top`` moves (r -> q) or swaps whose estimated pair maximum is lowest and below replica r's time,
    best first, as the two new shares. The estimate prices documents without fill, drain or c."""
    dr, dq = np.asarray(shares[r], dtype=np.int64), np.asarray(shares[q], dtype=np.int64)
    if dr.size == 0:
        return []
    lr, lq = s[dr].astype(np.float64), s[dq].astype(np.float64)
    gain_r, cost_q = rep.ra[r] * lr * lr + rep.rb[r] * lr, rep.ra[q] * lr * lr + rep.rb[q] * lr
    moves = np.maximum(times[r] - gain_r, times[q] + cost_q)
    moves[lr > rep.cap[q]] = np.inf
    swap = np.maximum(times[r] - gain_r[:, None] + (rep.ra[r] * lq * lq + rep.rb[r] * lq)[None, :],
                      times[q] - (rep.ra[q] * lq * lq + rep.rb[q] * lq)[None, :] + cost_q[:, None])
    swap[(lr[:, None] > rep.cap[q]) | (lq[None, :] > rep.cap[r]) | (lr[:, None] == lq[None, :])] = np.inf
    scores = np.concatenate([moves, swap.ravel()])  # move i, then swap (i, j) at dr.size + i * dq.size + j
    out = []
    for k in _smallest(scores, top).tolist():
        if not scores[k] < times[r]:
            break
        i, j = (k, -1) if k < dr.size else divmod(k - dr.size, dq.size)
        new_r = [x for n, x in enumerate(shares[r]) if n != i] + ([int(dq[j])] if j >= 0 else [])
        new_q = [x for n, x in enumerate(shares[q]) if n != j] + [int(dr[i])]
        out.append((new_r, new_q))
    return out


def _smallest(x: np.ndarray, top: int) -> np.ndarray:
    """``np.argsort(x, kind="stable")[:top]`` without sorting all of ``x``: the ``top``-th smallest value by
    partition, then a stable sort of the (in index order) entries at most that value, which holds the first
    ``top`` of the full stable order, ties in the same order."""
    if x.size <= 4 * top or top < 1:
        return np.argsort(x, kind="stable")[:top]
    kth = np.partition(x, top - 1)[top - 1]
    near = np.flatnonzero(x <= kth)
    if near.size < top:  # NaN present: let the full sort decide
        return np.argsort(x, kind="stable")[:top]
    return near[np.argsort(x[near], kind="stable")[:top]]
