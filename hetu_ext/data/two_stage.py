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

With pipelines, stage 1 also runs level-based first-fit-decreasing (MULTIFIT, :func:`_stage1_levels`), which
groups long documents together and short ones together so fewer replicas pay a long fill and drain; the better
of the two stage-1 results (after stage 2) is refined. Without pipelines it runs where replicas hold few
documents (``_FEW``), where LPT's lumps cost most.

The lower bound that certifies results is in :mod:`hetu_ext.data.packing_bound`.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .packing import ReplicaSpec

_WINDOW = 3  # stage 2 tries microbatch counts within this many of the one its convex estimate prefers
_FEW = 4
"""Documents per replica up to which pp = 1 replicas try MULTIFIT too. LPT's worst case is ``1 + 1/k - 1/(k R)``
when the replica finishing last holds k documents (Coffman and Sethi, 1976): with few long documents it may put
three mid-length ones on one replica where MULTIFIT pairs them with short ones (13 documents on 4 replicas: 5.55 s
against the optimal 5.19 s). With many documents LPT is within rounding of the bound, and the level search would
only cost time."""


class ReplicaArrays:
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
        self.stages = [sorted({(c.a, c.b, c.c) for c in x.stage_costs}) for x in replicas]
        """Per replica, the distinct (a, b, c) of its stages as Python floats (stage 2 works on small lists)."""
        self.lengths: list[int] = s.tolist()
        rank = np.empty(s.size, dtype=np.int64)
        rank[np.lexsort((np.arange(s.size), -s))] = np.arange(s.size)
        self.rank: list[int] = rank.tolist()
        """Each document's position in the longest-first order (ties: lower index first)."""


def assign_hetu(s: np.ndarray, replicas: Sequence[ReplicaSpec], *, bound_s: float = 0.0) -> list[list[list[int]]]:
    """[replica][microbatch] -> document indices: stage 1 across replicas, stage 2 within each.

    With pipelines (some pp > 1), or with few documents per replica (at most ``_FEW``), stage 1 also tries
    level-based first-fit-decreasing (:func:`_stage1_levels`) and keeps whichever of the two gives the lower
    slowest replica after stage 2; then refines that one. With few documents (cheap) both are refined and the
    better kept, so the result is never worse than LPT's alone (refining may favour either start: on random
    instances of 1-4 documents per replica, refining only MULTIFIT's lost up to 2.3% against LPT's on 6% of
    them). ``bound_s``: a lower bound on the slowest replica (seconds), where the level search starts."""
    rep = ReplicaArrays(replicas, s)
    shares = _stage1(s, rep)
    packed = [_stage2(s, share, rep, r) for r, share in enumerate(shares)]
    few = s.size <= _FEW * len(replicas)
    cutoff = max((t for _, t in packed), default=0.0)
    if (few or np.any(rep.pp > 1)) and s.size and cutoff > bound_s * (1 + 1e-3):  # else optimal
        other = _stage1_levels(s, rep, cutoff, bound_s)
        if other is not None:
            packed_other: list[tuple[list[list[int]], float]] | None = []
            for r, share in enumerate(other):  # kept only if every replica beats the cutoff: stop at the first not
                if _stage2_floor(share, rep, r) * (1 - 1e-9) >= cutoff:
                    packed_other = None
                    break
                packed_other.append(_stage2(s, share, rep, r))
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


def _shares(order: np.ndarray, speed: np.ndarray, found: np.ndarray) -> list[list[int]]:
    """Per replica (original order) the documents (``order``'s indices) a level search put on it: ``found`` gives
    each document's position in the fastest-first order ``speed``."""
    shares: list[list[int]] = [[] for _ in range(speed.size)]
    for i, j in zip(order.tolist(), speed[found].tolist()):
        shares[j].append(i)
    return shares


def _stage1_levels(s: np.ndarray, rep: ReplicaArrays, high: float, low: float, grid: int = 16,
                   low_fraction: float = 0.8) -> list[list[int]] | None:
    """Pipelines pay ``pp - 1`` times their costliest microbatch, so spreading the longest documents one per
    replica (what LPT does) makes every replica pay a long fill and drain. Instead, for a level T, documents
    longest first go to the first replica (fastest first) where ``W + c n + (pp - 1)(d_max + c) <= T`` still
    holds (each document its own microbatch: stage 2 can only do better): long documents share replicas and the
    short ones end up together, paying a short fill (MULTIFIT). ``grid`` levels between ``low`` (a lower bound;
    at least low_fraction x high) and ``high`` are tried lowest first (:func:`_fill_level`) until one fits, once
    more on the narrowed range if that was wider than 6%; the shares of the lowest level that fits, or None."""
    order = np.lexsort((np.arange(s.size), -s))
    speed = np.argsort(rep.ra * 1024.0 ** 2 + rep.rb * 1024.0, kind="stable")  # fastest first
    ra, rb, rc, pp, cap = rep.ra[speed], rep.rb[speed], rep.rc[speed], rep.pp[speed], rep.cap[speed]
    lengths = s[order].astype(np.float64)
    squares = lengths * lengths
    if np.any(ra < 0) or np.any(rb < 0):  # costs not monotone in length: the runs below need them so
        return _stage1_levels_grid(s, rep, high, low, grid, low_fraction)

    least = None  # [j]: per document, its least cost on replicas j.. (inf: none holds it), for the volume test
    if ra.size * lengths.size <= 4_000_000:
        every = ra[:, None] * squares[None, :] + rb[:, None] * lengths[None, :] + rc[:, None]
        every[cap[:, None] < lengths[None, :]] = np.inf
        least = np.concatenate([np.minimum.accumulate(every[::-1], axis=0)[::-1], np.full((1, lengths.size),
                                                                                          np.inf)])
    kinds: list[tuple[list[float], list[float], list[float], int]] = []
    index: dict[tuple, int] = {}
    kind_of = []
    for key in zip(ra.tolist(), rb.tolist(), rc.tolist(), pp.tolist(), cap.tolist()):
        if key not in index:
            cost = ra[len(kind_of)] * squares + rb[len(kind_of)] * lengths + rc[len(kind_of)]  # non-increasing
            index[key] = len(kinds)
            kinds.append((cost.tolist(), (-cost).tolist(), (-(pp[len(kind_of)] * cost)).tolist(),
                          int(np.searchsorted(-lengths, -float(key[4]), side="left"))))
        kind_of.append(index[key])
    lo, hi, found = max(low, low_fraction * high), high, None
    for _ in range(1 if hi - lo <= 0.06 * hi else 2):
        levels = np.linspace(lo, hi, grid + 1)[1:]
        k, where = -1, None
        for k in range(levels.size):  # the lowest level that fits is the answer: the ones above are not needed
            where = _fill_level(float(levels[k]), kinds, kind_of, least)
            if where is not None:
                break
        if where is None:
            break
        lo, hi, found = (levels[k - 1] if k else lo), levels[k], where
    return None if found is None else _shares(order, speed, found)


def _fill_level(level: float, kinds: list[tuple[list[float], list[float], list[float], int]], kind_of: list[int],
                least: np.ndarray | None = None) -> np.ndarray | None:
    """First fit of the documents (longest first) into the replicas (in order) of ``level`` seconds each, a
    document costing ``pp`` times its own time where it opens a replica and its own time after: the replica
    (position in that order) of each document, or None if one fits nowhere. ``kinds[kind_of[j]]``: replica j's
    (costs, negated costs, negated pp x costs) of every document and the first document within its capacity.

    Computed replica by replica, which is the same first fit: a document lands in replica 0 exactly when it fits
    there when its turn comes, whatever the later replicas hold; those replica 0 leaves over go on, in order, to
    replica 1, and so on. Costs fall along the (longest first) order, so past a document that does not fit, the
    next one that does is a binary search (then the next one not yet taken: skip pointers); the room is spent one
    taken document at a time (the same floating-point subtractions and comparisons as document by document).
    ``least`` (optional, rows 0..R): each document's least cost on replicas j and after; when the documents left
    need more than the untouched replicas' rooms (by a margin far above rounding), the level fails early: nothing
    the first fit does can place them all."""
    size = len(kinds[0][0])
    nxt = list(range(size + 1))  # skip pointers: following them from i reaches the first document >= i not taken
    where = [0] * size
    free = np.ones(size, dtype=bool) if least is not None else None
    remaining, r = size, len(kind_of)

    def find(i: int) -> int:
        root = i
        while nxt[root] != root:
            root = nxt[root]
        while nxt[i] != root:
            nxt[i], i = root, nxt[i]
        return root

    for j in range(r):
        if remaining == 0:
            break
        if free is not None and float(least[j][free].sum()) > (r - j) * level * (1 + 1e-9):
            return None
        costs, neg, neg_pp, start = kinds[kind_of[j]]
        pos = find(bisect.bisect_left(neg_pp, -level, start))  # opens the replica: pp x its cost <= level
        if pos >= size:
            continue
        room = level + neg_pp[pos]
        taken = [pos]
        nxt[pos] = pos + 1
        pos = find(pos + 1)
        while pos < size:
            cost = costs[pos]
            if cost <= room:
                taken.append(pos)
                room -= cost
                nxt[pos] = pos + 1
                pos = find(pos + 1)
            else:
                pos = find(bisect.bisect_left(neg, -room, pos))  # the next one with cost <= room
        for i in taken:
            where[i] = j
        remaining -= len(taken)
        if free is not None:
            free[taken] = False
    return np.asarray(where, dtype=np.int64) if remaining == 0 else None


def _stage1_levels_grid(s: np.ndarray, rep: ReplicaArrays, high: float, low: float, grid: int = 16,
                        low_fraction: float = 0.8) -> list[list[int]] | None:
    """:func:`_stage1_levels` for any costs: every level of the grid filled at once, document by document."""
    order = np.lexsort((np.arange(s.size), -s))
    speed = np.argsort(rep.ra * 1024.0 ** 2 + rep.rb * 1024.0, kind="stable")  # fastest first
    ra, rb, rc, pp, cap = rep.ra[speed], rep.rb[speed], rep.rc[speed], rep.pp[speed], rep.cap[speed]
    lengths = s[order].astype(np.float64).tolist()

    def fill(levels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(L,) fits and (L, N) replica of each document, for every level at once."""
        rows = np.arange(levels.size)
        room = np.repeat(levels[:, None], speed.size, axis=1)
        opened = np.zeros(room.shape, dtype=bool)
        alive = np.ones(levels.size, dtype=bool)
        where = np.zeros((levels.size, s.size), dtype=np.int64)
        for k, n in enumerate(lengths):
            cost = ra * (n * n) + rb * n + rc  # (R,): the document alone in a microbatch
            need = np.where(opened, cost, pp * cost)
            ok = (need <= room) & (cap >= n)
            j = np.argmax(ok, axis=1)
            alive &= ok[rows, j]
            room[rows, j] -= need[rows, j]
            opened[rows, j] = True
            where[:, k] = j
        return alive, where

    lo, hi, found = max(low, low_fraction * high), high, None
    for _ in range(1 if hi - lo <= 0.06 * hi else 2):
        levels = np.linspace(lo, hi, grid + 1)[1:]
        alive, where = fill(levels)
        if not alive.any():
            break
        k = int(np.argmax(alive))
        lo, hi, found = (levels[k - 1] if k else lo), levels[k], where[k]
    return None if found is None else _shares(order, speed, found)


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


def _stage2(s: np.ndarray, idx: Sequence[int], rep: ReplicaArrays, r: int) -> tuple[list[list[int]], float]:
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


def _sums_time(q: list[int], tok: list[int], stages: list[tuple[float, float, float]], pp) -> float:
    """:func:`_time` from each microbatch's squared and plain token sums (the same arithmetic)."""
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


def _time(packs: list[list[int]], rep: ReplicaArrays, r: int) -> float:
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
                if _stage2_floor(new_q, rep, q) * (1 - 1e-9) >= goal or \
                        _stage2_floor(new_r, rep, r) * (1 - 1e-9) >= goal:
                    continue
                pq = _stage2(s, new_q, rep, q)
                if not pq[1] < goal:
                    continue
                pr = _stage2(s, new_r, rep, r)
                if max(pr[1], pq[1]) < goal:
                    shares[r], shares[q], packed[r], packed[q] = new_r, new_q, pr, pq
                    improved = True
                    break
            if improved:
                break
        if not improved:
            return


def _stage2_floor(idx: Sequence[int], rep: ReplicaArrays, r: int) -> float:
    """A lower bound on :func:`_stage2`'s seconds for replica r's documents ``idx``: each microbatch costs at
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
