"""Stage 2 of Hydraulis' two-stage assignment: one replica's documents into microbatches (pure Python on small
lists; notation of :mod:`hetu_ext.data.two_stage`).

:func:`stage2` starts from first-fit-decreasing (the fewest microbatches: optimal for pp = 1) and, for pp > 1, tries
the microbatch counts within ``_WINDOW`` of the one its convex estimate prefers, packing documents longest first
into the least loaded microbatch that has room (capacity-aware LPT); it keeps the packing of lowest
``sum + (pp - 1) max``. :func:`stage2_floor` bounds its result from below (stage 1's refinement skips the exchanges
it cannot accept), :func:`replica_time` prices a given packing the same way.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import numpy as np

from .replica_arrays import ReplicaArrays

_WINDOW = 3  # stage 2 tries microbatch counts within this many of the one its convex estimate prefers


def stage2(s: np.ndarray, idx: Sequence[int], rep: ReplicaArrays, r: int) -> tuple[list[list[int]], float]:
    """Microbatches of replica r's documents ``idx`` and their predicted seconds (pure Python: shares are small)."""
    if len(idx) == 0:
        return [], 0.0
    cap, pp, c = int(rep.cap[r]), float(rep.pp[r]), float(rep.rc[r])
    a, b, sl = float(rep.ra[r]), float(rep.rb[r]), rep.lengths
    order = sorted(idx, key=rep.rank.__getitem__)  # longest first, ties by index
    lens = [sl[i] for i in order]
    best, q, tok = _first_fit_sums(order, lens, cap)
    best_t = _sums_time(q, tok, rep.stages[r], rep.pp[r])
    if pp == 1:
        return best, best_t
    weights = [a * n * n + b * n for n in lens]
    total, top = sum(weights), weights[0]
    # sum + (pp - 1) max >= W + c M + (pp - 1)(max(W / M, top) + c): convex in M, least near M* below; try a
    # window of counts around it (the fill stops shrinking once W / M < top, so M* <= W / top + 1)
    m_star = math.sqrt((pp - 1) * total / c) if c > 0 else float(len(lens))
    m_star = min(m_star, total / top + 1 if top > 0 else m_star)
    first = max(len(best), int(m_star) - _WINDOW)  # at the first-fit count too: LPT may balance it better
    for m in range(first, min(len(lens), int(m_star) + _WINDOW + 1) + 1):
        if total + c * m + (pp - 1) * (max(total / m, top) + c) >= best_t:
            continue
        # two of the m + 1 costliest documents share a microbatch: the fill is at least their sum (an exact
        # floor; margin far above rounding, so only counts LPT could not win with are skipped)
        if m < len(lens) and (total + c * m + (pp - 1) * (weights[m - 1] + weights[m] + c)) * (1 - 1e-9) >= best_t:
            continue
        found = _lpt(order, lens, weights, cap, m)
        if found is not None:
            t = _sums_time(found[1], found[2], rep.stages[r], rep.pp[r])
            if t < best_t:
                best, best_t = found[0], t
    return best, best_t


def stage2_floor(idx: Sequence[int], rep: ReplicaArrays, r: int) -> float:
    """A lower bound on :func:`stage2`'s seconds for replica r's documents ``idx``: each microbatch costs at
    least its representative stage's time, so the sum is at least the work ``W`` plus ``c`` per microbatch (at
    least ``ceil(tokens / cap)`` of them), and the fill and drain at least ``pp - 1`` times the costliest
    document's microbatch."""
    if len(idx) == 0:
        return 0.0
    a, b, c, sl = float(rep.ra[r]), float(rep.rb[r]), float(rep.rc[r]), rep.lengths
    lens = [sl[i] for i in idx]
    longest = max(lens)
    work = a * sum(n * n for n in lens) + b * sum(lens)
    packs = max(1, -(-sum(lens) // int(rep.cap[r])))
    return work + c * packs + (float(rep.pp[r]) - 1) * (a * longest * longest + b * longest + c)


def replica_time(packs: list[list[int]], rep: ReplicaArrays, r: int) -> float:
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
        if len(stages) == 1:
            a, b, c = stages[0]
            times.append(a * q + b * tok + c)
        else:
            times.append(max(a * q + b * tok + c for a, b, c in stages))
    return sum(times) + (rep.pp[r] - 1) * max(times)


def _sums_time(q: list[int], tok: list[int], stages: list[tuple[float, float, float]], pp) -> float:
    """:func:`replica_time` from each microbatch's squared and plain token sums (the same arithmetic)."""
    if len(stages) == 1:
        a, b, c = stages[0]
        times = [a * x + b * y + c for x, y in zip(q, tok)]
    else:
        times = [max(a * x + b * y + c for a, b, c in stages) for x, y in zip(q, tok)]
    return sum(times) + (pp - 1) * max(times)


def _first_fit_sums(ids: list[int], lens: list[int], cap: int) -> tuple[list[list[int]], list[int], list[int]]:
    """:func:`first_fit` and each pack's squared and plain token sums. Packs whose room is below the shortest
    document are left out of the scan (first fit could never choose them)."""
    packs: list[list[int]] = []
    free: list[int] = []
    q: list[int] = []
    shortest = min(lens, default=0)
    open_: list[int] = []  # packs in order whose room still holds the shortest document (no other can take one)
    for i, n in zip(ids, lens):
        for k in open_:
            if free[k] >= n:
                packs[k].append(i)
                free[k] -= n
                q[k] += n * n
                if free[k] < shortest:
                    open_.remove(k)
                break
        else:
            k = len(packs)
            packs.append([i])
            free.append(cap - n)
            q.append(n * n)
            if free[k] >= shortest:
                open_.append(k)
    return packs, q, [cap - x for x in free]


def first_fit(ids: list[int], lens: list[int], cap: int) -> list[list[int]]:
    """Packs of the documents ``ids`` (tokens ``lens``, in that order) by first fit: each document goes into the
    first pack with ``cap`` tokens of room left, else opens a new one. Given in decreasing length, this is
    first-fit-decreasing. A document longer than ``cap`` gets a pack of its own (callers check lengths)."""
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


def _lpt(ids: list[int], lens: list[int], weights: list[float], cap: int, m: int
         ) -> tuple[list[list[int]], list[int], list[int]] | None:
    """Longest first into the least loaded of m microbatches with room; None if one does not fit anywhere.
    A heap of (load, microbatch); only when the least loaded one is full are the others scanned. Returns the
    packs and each one's squared and plain token sums."""
    if m > len(ids):
        return None  # a microbatch would stay empty
    shortest = min(lens, default=0)
    if m and weights[m - 1] > 0 and lens[0] <= cap:
        # the first m documents each open their own microbatch (the empty ones are the least loaded, lowest first)
        packs = [[i] for i in ids[:m]]
        used = lens[:m]
        q = [n * n for n in used]
        heap = [(0.0 + w, k) for k, w in enumerate(weights[:m])]
        heapq.heapify(heap)
        start = m
    else:
        packs = [[] for _ in range(m)]
        used = [0] * m
        q = [0] * m
        heap = [(0.0, k) for k in range(m)]
        start = 0
    for i, n, w in zip(ids[start:], lens[start:], weights[start:]):
        load, k = heap[0]
        if used[k] + n > cap:
            while used[heap[0][1]] + shortest > cap:  # full for good: LPT would never choose it again
                heapq.heappop(heap)
                if not heap:
                    return None
            load, k = heap[0]
        if used[k] + n <= cap:
            heapq.heapreplace(heap, (load + w, k))
        else:
            fits = [(ld, j) for ld, j in heap if used[j] + n <= cap]
            if not fits:
                return None
            load, k = min(fits)
            heap.remove((load, k))
            heap.append((load + w, k))
            heapq.heapify(heap)
        packs[k].append(i)
        used[k] += n
        q[k] += n * n
    return (packs, q, used) if all(packs) else None
