"""Stage 1's level search for Hydraulis' two-stage assignment: level-based first-fit-decreasing (MULTIFIT) across
replicas (notation of :mod:`hetu_ext.data.two_stage`). It groups long documents together and short ones together,
so fewer replicas of a pipeline pay a long fill and drain than under LPT, which spreads the longest documents one
per replica.
"""

from __future__ import annotations

import bisect

import numpy as np

from .replica_arrays import ReplicaArrays


def stage1_levels(s: np.ndarray, rep: ReplicaArrays, high: float, low: float, grid: int = 16,
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
        return stage1_levels_grid(s, rep, high, low, grid, low_fraction)

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


def stage1_levels_grid(s: np.ndarray, rep: ReplicaArrays, high: float, low: float, grid: int = 16,
                        low_fraction: float = 0.8) -> list[list[int]] | None:
    """:func:`stage1_levels` for any costs: every level of the grid filled at once, document by document."""
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


def _shares(order: np.ndarray, speed: np.ndarray, found: np.ndarray) -> list[list[int]]:
    """Per replica (original order) the documents (``order``'s indices) a level search put on it: ``found`` gives
    each document's position in the fastest-first order ``speed``."""
    shares: list[list[int]] = [[] for _ in range(speed.size)]
    for i, j in zip(order.tolist(), speed[found].tolist()):
        shares[j].append(i)
    return shares
