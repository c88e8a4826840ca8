"""The stage costs of a packing's replicas as arrays: the input of Hydraulis' two-stage assignment
(:mod:`hetu_ext.data.two_stage`) and of its certified bound (:mod:`hetu_ext.data.packing_bound`). Pure: numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .packing import ReplicaSpec


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
