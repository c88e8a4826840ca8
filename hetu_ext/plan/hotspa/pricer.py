"""HotSPa's group pricer (pure): the packer's certified estimate, its exact price, the relaxation's bound and
grouping, and the fills the planners ask for, per strategy."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hetu_ext.data.cost import CostTable
from hetu_ext.data.packing import Assignment, ReplicaSpec, assign
from hetu_ext.data.packing_bound import lower_bound_s
from hetu_ext.model.spec import ModelSpec
from hetu_ext.plan.core.replicas import replica_specs
from hetu_ext.plan.hotspa.relaxation import relaxation
from hetu_ext.plan.hotspa.grouping import Group
from hetu_ext.plan.core.strategies import StrategySet


RELAXED_NODES = 200
"""Branch-and-bound nodes the planner's relaxation may take (a node count, not a clock: the same on every rank)."""


RELAXED_TIME_LIMIT_S = 60.0
"""A backstop only: the node limit ends it first on the benchmarks' steps (up to 2,000 sequences, 20 strategies)."""


class GroupPricer:
    """Predicted seconds of a group of sequences under each strategy, with the strategies' replica specs built
    once: ``exact`` runs the packer (Hydraulis's two-stage assignment), ``estimate`` is its certified lower bound
    (hetu_ext.data.packing_bound; the packer lands within a few percent of it), cheap enough for the dynamic
    program's many candidate groups."""

    def __init__(self, strategies: StrategySet, spec: ModelSpec, cost: CostTable) -> None:
        self._strategies = strategies
        self._replicas = [replica_specs(s.plan, spec, cost, max_pack_tokens=s.max_len) for s in strategies.items]
        self._packed: dict[int, tuple[list[int], Assignment]] = {}  # per strategy, exact's last lengths and packing

    def estimate(self, k: int, lengths: list[int]) -> float:
        """Identical pipelines (a uniform strategy): work spread evenly over the ``d`` pipelines, packs of the
        capacity, plus the fill and drain of one average pack (O(n)); other plans: the packer's lower bound."""
        if not lengths:
            return 0.0
        replicas = self._replicas[k]
        s = np.asarray(lengths, dtype=np.float64)
        if any(r != replicas[0] for r in replicas[1:]):
            return lower_bound_s(s.astype(np.int64), replicas)
        first, d = replicas[0], len(replicas)
        tokens, squares = float(s.sum()) / d, float((s * s).sum()) / d
        packs = max(1.0, np.ceil(tokens / first.token_capacity))
        return first.microbatch_s(squares, tokens) + first.stage_costs[0].c * (packs - 1) \
            + (first.pp - 1) * first.microbatch_s(squares / packs, tokens / packs)

    def bound(self, k: int, lengths: list[int]) -> float:
        """The packer's certified lower bound (hetu_ext.data.packing_bound): never above :meth:`exact`."""
        return lower_bound_s(np.asarray(lengths, dtype=np.int64), self._replicas[k]) if lengths else 0.0

    def relaxed(self, lengths: Sequence[int], fixed_s: Sequence[float], *, upper_s: float | None = None,
                node_limit: int = RELAXED_NODES) -> list[Group] | None:
        """The grouping of :func:`hetu_ext.plan.hotspa.relaxation.relaxation` (``fixed_s[k]``: what a used
        strategy adds; ``upper_s``: a known grouping's price), stopped after ``node_limit`` branch-and-bound nodes
        (deterministic: every rank gets the same groups), without rows 5 to 7 and the buckets' extra lines and
        sums (they tighten the bound but slow the search for a grouping: 16 GPUs at 32K, 200 nodes, 9.29 s with row
        5, 9.17 s without; with row 6 and the lines a step's grouping took up to 17.5 s; with the sums the
        Wikipedia row at 8 GPUs and 16K lost 0.6%; with row 7 a step of the 32-GPU 16K one took 13.4 s, not 9.5 s,
        for the same grouping);
        None when it found none or a group breaks HotSPa's rules (a sequence longer than its strategy takes, fewer
        sequences than pipelines)."""
        plans = [st.plan for st in self._strategies.items]
        out = relaxation(lengths, plans, self._replicas, fixed_s=fixed_s, upper_s=upper_s, node_limit=node_limit,
                         time_limit_s=RELAXED_TIME_LIMIT_S, explicit_pipelines=0, microbatch_rows=False,
                         anchor_rows=False, bucket_lines=False, bucket_sums=False, pack_rows=0)
        if not out.groups:
            return None
        groups = [Group(strategy=k, indices=tuple(sorted(ix))) for k, ix in sorted(out.groups.items())]
        for g in groups:
            st = self._strategies.items[g.strategy]
            if len(g.indices) < len(st.plan.pipelines) or max(lengths[i] for i in g.indices) > st.max_len:
                return None
        return groups

    def fill(self, k: int, core: list[int], pool: list[int]) -> list[int] | None:
        """Positions in ``pool`` (lengths) that top strategy k's pipelines up once the packer has packed ``core``:
        every pipeline, the least loaded first, takes the longest pool sequences whose time (plus ``c`` for each
        pack its tokens now need past the capacity) still fits under the slowest pipeline's level. None for
        pipelined or unlike replicas (their time is not a sum of their sequences')."""
        replicas = self._replicas[k]
        first = replicas[0]
        if first.pp != 1 or any(r != first for r in replicas[1:]):
            return None
        out = assign(core, replicas, method="hetu")
        level = max(out.predicted_s)
        cost, cap = first.stage_costs[0], first.token_capacity
        free = sorted((i for i, x in enumerate(pool) if x <= cap), key=lambda i: -pool[i])
        picked = []
        for p in np.argsort(out.predicted_s, kind="stable"):
            load = out.predicted_s[p]
            tokens = sum(core[i] for mb in out.microbatches[p] for i in mb)
            left = []
            for i in free:
                x = pool[i]
                more = cost.document_s(x) + cost.c * (-(-(tokens + x) // cap) - -(-tokens // cap))
                if load + more <= level:
                    load, tokens = load + more, tokens + x
                    picked.append(i)
                else:
                    left.append(i)
            free = left
        return picked

    def slowest(self, k: int, lengths: list[int]) -> tuple[list[int], float]:
        """Indices into ``lengths`` of the sequences on the slowest pipeline of the packer's assignment (the one
        :meth:`exact` made for these lengths, else packed again), and that pipeline's seconds over the mean
        pipeline's."""
        last = self._packed.get(k)
        if last is None or last[0] != list(lengths):
            self.exact(k, lengths)
            last = self._packed[k]
        out = last[1]
        worst = int(np.argmax(out.predicted_s))
        return [i for mb in out.microbatches[worst] for i in mb], out.predicted_s[worst] - float(
            np.mean(out.predicted_s))

    def exact(self, k: int, lengths: list[int]) -> float:
        """The packer's slowest replica (seconds); the packing is kept for :meth:`packed`."""
        if not lengths:
            return 0.0
        out = assign(lengths, self._replicas[k], method="hetu")
        self._packed[k] = (list(lengths), out)
        return max(out.predicted_s)

    def packed(self, k: int, lengths: Sequence[int], replicas: Sequence[ReplicaSpec]) -> Assignment | None:
        """The packing :meth:`exact` made for strategy k, if its last call had these lengths (in this order) and
        the pricer's replicas equal ``replicas`` (then it is what ``assign(lengths, replicas, method="hetu")``
        returns: the packer is deterministic); else None."""
        last = self._packed.get(k)
        if last is None or list(self._replicas[k]) != list(replicas) or last[0] != list(lengths):
            return None
        return last[1]
