"""The grouping relaxation's program under construction (pure: numpy): each sequence's bounds per strategy, the units
(binary sequences and buckets), the variables, and the rows added so far. :mod:`.relaxation_rows` adds the
constraint families to a :class:`ProgramBuilder`; :mod:`.relaxation` solves what it builds.

Variables, in order: x (one per held (unit, strategy) pair: the unit's share in the strategy's group; binary for
single sequences), y (K: strategy used), z (K: the longest member's fill, without U), T (K: the group's time), E and
EP (one of each per bucket pair: a bucket's work and plain work in k's group), then the families' own variables in
the order the families ask for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hetu_ext.data.packing import ReplicaSpec


@dataclass(frozen=True)
class RelaxationOptions:
    """The relaxation's settings (see :func:`hetu_ext.plan.hotspa.relaxation.relaxation` for each)."""

    fixed_s: Sequence[float] | None = None
    upper_s: float | None = None
    min_strategies: int = 1
    binary: int | None = None
    bucket_ratio: float = 1.05
    thresholds: int = 12
    explicit_pipelines: int = 8
    microbatch_rows: bool = True
    bucket_lines: bool = True
    bucket_sums: bool = True
    anchor_rows: bool = True
    anchor_levels: int = 12
    pack_rows: int = 3
    cutoff: bool = False
    time_limit_s: float = 120.0
    node_limit: int | None = None


def f_over_u(c: float, pp: int, upper_s: float) -> float:
    """``f(U) / U`` for ``f(W) = W + 2 sqrt((pp - 1) c W) + (pp - 1) c``: a pipeline whose work priced on one stage
    is W (``sum_p (a Q_p + b S_p)``) over M microbatches takes at least ``W + c M + (pp - 1)(W / M + c)`` (the
    largest microbatch is at least the mean), at least f(W) over every M; f is concave with f(0) >= 0, so
    ``f(W) >= W f(U) / U`` for every ``W <= U``."""
    return 1.0 + 2.0 * np.sqrt((pp - 1) * c / upper_s) + (pp - 1) * c / upper_s


def per_sequence(s: np.ndarray, plans, replicas: Sequence[Sequence[ReplicaSpec]], world: int,
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


def make_units(s: np.ndarray, top: int, replicas, bucket_ratio: float) -> list[np.ndarray]:
    """The ``top`` longest sequences alone, the rest in buckets of equal holders (cut at every strategy's
    capacity) whose longest member is at most ``bucket_ratio`` times their shortest; longest first."""
    order = np.argsort(-s, kind="stable")
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
    return units


class ProgramBuilder:
    """The program's data (per sequence, per unit), its variables' layout and the rows added so far. A bucket's
    share x is the fraction of its members sent, so each coefficient is its count times the least member's (the
    members sent cost at least that much each)."""

    def __init__(self, lengths: Sequence[int], plans, replicas: Sequence[Sequence[ReplicaSpec]],
                 opts: RelaxationOptions) -> None:
        self.opts, self.plans, self.replicas = opts, plans, replicas
        self.s = s = np.asarray(lengths, dtype=np.float64)
        self.n, self.K = n, K = s.size, len(plans)
        self.world = max(plan.world_size for plan in plans)
        fixed = np.zeros(K) if opts.fixed_s is None else np.asarray(opts.fixed_s, dtype=np.float64)
        (self.work, self.plain, self.fill, self.alone, self.nu, self.pp,
         self.pipelines) = per_sequence(s, plans, replicas, self.world, opts.upper_s)
        self.identical = [all(r == reps[0] for r in reps) and len({tuple(len(st.ranks) for st in pl.stages)
                                                                   for pl in plan.pipelines}) == 1
                          for plan, reps in zip(plans, replicas)]
        if not np.isfinite(self.work).any(axis=1).all():
            raise ValueError("grouping relaxation: a sequence no strategy holds")
        self.top = int(min(n, opts.binary if opts.binary is not None else 2 * self.pipelines.max() + 16))
        self.units = make_units(s, self.top, replicas, opts.bucket_ratio)
        self._unit_data()
        self._layout(fixed)

    def _unit_data(self) -> None:
        units, work, plain = self.units, self.work, self.plain
        self.U = len(units)
        self.count = count = np.array([u.size for u in units], dtype=np.float64)
        self.uwork = np.array([work[u].sum(axis=0) for u in units])  # units x K (inf where not held): all members
        self.uplain = np.array([plain[u].sum(axis=0) for u in units])
        self.least = {"work": np.array([work[u].min(axis=0) for u in units]) * count[:, None],  # count x the least
                      "plain": np.array([plain[u].min(axis=0) for u in units]) * count[:, None]}
        self.most = {"work": np.array([work[u].max(axis=0) for u in units]) * count[:, None],  # count x the largest
                     "plain": np.array([plain[u].max(axis=0) for u in units]) * count[:, None]}
        self.ufill = np.array([self.fill[u].min(axis=0) for u in units])
        self.ualone = np.array([self.alone[u].max(axis=0) for u in units])  # used for single sequences only
        self.unu = np.array([self.nu[u].min(axis=0) for u in units])  # a bucket's members each reach at least this

    def _layout(self, fixed: np.ndarray) -> None:
        """Variables x, y, z, T, E, EP (module docstring) and their costs and integrality; no rows yet."""
        K = self.K
        pairs = np.argwhere(np.isfinite(self.uwork))  # (unit, strategy)
        self.m = m = len(pairs)
        self.ui, self.uk = pairs[:, 0], pairs[:, 1]
        self.is_binary = self.ui < self.top
        self.bucket = np.flatnonzero(~self.is_binary)
        self.mb = mb = self.bucket.size
        self.b = np.flatnonzero(self.is_binary)
        self.X, self.Y, self.Z, self.T = 0, m, m + K, m + 2 * K
        self.E, self.EP = m + 3 * K, m + 3 * K + mb
        self.rows: list[np.ndarray] = []
        self.cols: list[np.ndarray] = []
        self.vals: list[np.ndarray] = []
        self.lo: list[np.ndarray] = []
        self.hi: list[np.ndarray] = []
        self.cost = [np.zeros(m), fixed, np.zeros(K), np.ones(K), np.zeros(2 * mb)]
        self.integral = [self.is_binary.astype(np.float64), np.ones(K), np.zeros(K), np.zeros(K), np.zeros(2 * mb)]
        self.nv = m + 3 * K + 2 * mb  # the fixed variables; the families' own come after
        self.nrow = 0
        self.extra = 0
        self.ext_int: list[float] = []
        self.ext_up: list[float] = []

    def add(self, r, c, v, low, high) -> None:
        """Rows ``nrow + r`` (as many as ``max(r) + 1``) with entries ``v`` at columns ``c``, ``low <= . <= high``."""
        r = np.asarray(r)
        self.rows.append(r + self.nrow)
        self.cols.append(np.asarray(c))
        self.vals.append(np.asarray(v, dtype=np.float64))
        self.lo.append(np.atleast_1d(np.asarray(low, dtype=np.float64)))
        self.hi.append(np.atleast_1d(np.asarray(high, dtype=np.float64)))
        self.nrow += int(r.max()) + 1 if r.size else 0

    def new_vars(self, integrality: Sequence[float], upper: Sequence[float]) -> int:
        """A family's own variables (one per entry): the column of the first."""
        first = self.nv + self.extra
        self.extra += len(integrality)
        self.ext_int += list(integrality)
        self.ext_up += list(upper)
        return first

    def new_binary(self) -> int:
        return self.new_vars([1.0], [1.0])

    def members(self, family: str, k_rows, scale=1.0):
        """(rows, columns, values) of the work of k's group: binary sequences through x, buckets through E / EP."""
        coef = self.uwork if family == "work" else self.uplain
        base = self.E if family == "work" else self.EP
        b, ui, uk = self.b, self.ui, self.uk
        return (np.r_[k_rows(b), k_rows(self.bucket)], np.r_[self.X + b, base + np.arange(self.mb)],
                np.r_[coef[ui[b], uk[b]] * scale, np.full(self.mb, scale)])

    def group_work(self, k: int, scale=1.0):
        """(columns, values) of the plain work of k's group alone, in one row (rows 5 to 8)."""
        _, cols_, vals_ = self.members("plain", lambda sel: np.zeros(sel.size, dtype=np.int64), scale)
        keep = np.r_[self.uk[self.b] == k, self.uk[self.bucket] == k]
        return cols_[keep], vals_[keep]

    def even(self, k: int) -> bool:
        """Whether k's (first) pipeline's stages have equal ranks."""
        return len({len(st.ranks) for st in self.plans[k].pipelines[0].stages}) == 1

    def program(self):
        """(c, integrality, upper bounds, A (CSR), row lower bounds, row upper bounds) of the rows added."""
        from scipy.sparse import coo_matrix

        m, K, mb, nv = self.m, self.K, self.mb, self.nv + self.extra
        c = np.concatenate(self.cost + [np.zeros(self.extra)])
        integrality = np.concatenate(self.integral + [np.asarray(self.ext_int)])
        upper = np.concatenate([np.ones(m + K), np.full(2 * K + 2 * mb, np.inf), np.asarray(self.ext_up)])
        A = coo_matrix((np.concatenate(self.vals), (np.concatenate(self.rows), np.concatenate(self.cols))),
                       shape=(self.nrow, nv)).tocsr()
        return c, integrality, upper, A, np.concatenate(self.lo), np.concatenate(self.hi)
