"""Hydraulis's per-step selection (pure): among the candidates holding a step's longest sequence, the lowest
predicted step time plus the switch from the home, priced exactly in order of the certified lower bound."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from hetu_ext.data.cost import CostTable
from hetu_ext.data.packing import Assignment, assign
from hetu_ext.data.packing_bound import lower_bound_s, may_fit_within
from hetu_ext.model.spec import ModelSpec
from hetu_ext.plan.core.replicas import replica_specs
from hetu_ext.plan.core.strategies import StrategySet
from hetu_ext.plan.hotspa import check_capacity


def select_candidate(lengths: Sequence[int], strategies: StrategySet, *, estimate: Callable[[int, list[int]], float],
                     exact: Callable[[int, list[int]], float], switch_s: Sequence[float],
                     may_win: Callable[[int, list[int], float], bool] | None = None,
                     ratios: Sequence[float] | None = None) -> tuple[int, float]:
    """The candidate with the lowest predicted step time ``exact(k, lengths) + switch_s[k]`` among those that hold
    the step's longest sequence, and that time. ``estimate`` must lower-bound ``exact`` (the packer's certified
    bound): candidates are priced exactly in order of their estimate until the next estimate cannot win, so the
    result equals brute force over every candidate (ties: the lower index). ``may_win(k, lengths, level)``
    (optional) answers False only if ``exact(k, lengths) > level``: once a candidate is priced, another one is
    skipped when it cannot come within the best by more than 1e-9 of it (so never a tie either). ``ratios``
    (optional, per candidate): the expected ``exact / estimate`` (e.g. from earlier steps); candidates are then
    priced in order of ``estimate x ratio + switch``, so the likely winner comes first and the others fall to
    their bound or to ``may_win``. Only the work depends on it, not the result."""
    check_capacity(lengths, strategies)
    s = list(lengths)
    longest = max(s, default=0)
    able = [k for k, st in enumerate(strategies.items) if st.max_len >= longest and len(st.plan.pipelines) <= len(s)]
    if not able:
        raise ValueError(f"Hydraulis: the step's {len(s)} sequences are fewer than every candidate's pipelines "
                         f"that holds {longest} tokens; raise the global batch")
    bounds = sorted((estimate(k, s) + switch_s[k], k) for k in able)
    if ratios is not None:  # the same candidates and tests, another order
        bounds.sort(key=lambda e: ((e[0] - switch_s[e[1]]) * ratios[e[1]] + switch_s[e[1]], e[1]))
    best_k, best_s = -1, float("inf")
    for bound, k in bounds:
        if bound > best_s:
            if ratios is None:
                break  # in order of the bound: the rest cannot win either
            continue
        if may_win is not None and best_k >= 0 and not may_win(k, s, best_s - switch_s[k] + 1e-9 * best_s):
            continue  # its compute exceeds that level: it cannot reach the best (Hydraulis, issue 15)
        t = exact(k, s) + switch_s[k]
        if t < best_s or (t == best_s and k < best_k):
            best_k, best_s = k, t
    return best_k, best_s


class Selector:
    """Per-step choice among ``strategies`` with prices built once: each candidate's replicas
    (hetu_ext.plan.core.replicas.replica_specs, straggler ``slowdowns`` included), the packer's certified lower bound
    (hetu_ext.data.packing_bound.lower_bound_s) as the estimate, the two-stage packer (``assign``, ``hetu``) as the
    exact price, and each candidate's switch from the home and back (hetu_ext.plan.hotspa.switch_seconds:
    weights in at ``weight_bytes``, fp32 gradients out, ``bandwidth`` bytes/s per GPU; 0 for the home)."""

    def __init__(self, strategies: StrategySet, model: ModelSpec, cost: CostTable, *, bandwidth: float,
                 weight_bytes: int = 2, slowdowns: Mapping[int, float] | None = None) -> None:
        from hetu_ext.plan.hotspa import switch_seconds

        self.strategies = strategies
        self.replicas = [replica_specs(s.plan, model, cost, max_pack_tokens=s.max_len, slowdowns=slowdowns)
                         for s in strategies.items]
        home = strategies.items[strategies.home].plan
        self.switch_s = [0.0 if k == strategies.home else
                         switch_seconds(home, s.plan, model, weight_bytes=weight_bytes, bandwidth=bandwidth)
                         for k, s in enumerate(strategies.items)]
        self._packed: dict[int, Assignment] = {}
        self._bounds: tuple[tuple[int, ...], dict[int, float]] = ((), {})  # the last lengths' bounds per candidate
        self._ratios = [1.0] * len(strategies.items)  # packed / bound when last priced: select_candidate's order

    def _bound(self, k: int, lengths: Sequence[int]) -> float:
        key = tuple(lengths)
        if key != self._bounds[0]:
            self._bounds = (key, {})
        cache = self._bounds[1]
        if k not in cache:
            cache[k] = lower_bound_s(np.asarray(lengths, dtype=np.int64), self.replicas[k])
        return cache[k]

    def estimate(self, k: int, lengths: Sequence[int]) -> float:
        """A lower bound on candidate k's compute seconds for these lengths (certified: no packing beats it)."""
        return self._bound(k, lengths) if len(lengths) else 0.0

    def may_win(self, k: int, lengths: Sequence[int], level: float) -> bool:
        """False only if no packing of these lengths on candidate k finishes within ``level`` seconds
        (hetu_ext.data.packing_bound.may_fit_within: where long documents may go on pipelines of each shape)."""
        return may_fit_within(np.asarray(lengths, dtype=np.int64), self.replicas[k], level)

    def exact(self, k: int, lengths: Sequence[int]) -> float:
        """Candidate k's compute seconds under the two-stage packer (its slowest pipeline); the packer's bound is
        the one :meth:`estimate` computed for these lengths (the same function, not run twice)."""
        if not len(lengths):
            return 0.0
        self._packed[k] = assign(list(lengths), self.replicas[k], method="hetu", bound_s=self._bound(k, lengths))
        return max(self._packed[k].predicted_s)

    def choose(self, lengths: Sequence[int], *, exact: bool = True) -> tuple[int, float, Assignment | None]:
        """(candidate index, its predicted compute + switch seconds, its packing) for one step's lengths: the
        packing is the step's (the chosen candidate was priced by packing it). ``exact``: the lowest packed time
        (:func:`select_candidate`, equal to brute force over the candidates); else the lowest certified bound
        plus switch (no packer run but the chosen one's: faster, may miss the best by the bound's gap)."""
        self._packed = {}
        self._bounds = ((), {})  # every choice computes its bounds afresh
        if exact:
            k, t = select_candidate(lengths, self.strategies, estimate=self.estimate, exact=self.exact,
                                    switch_s=self.switch_s, may_win=self.may_win, ratios=self._ratios)
            for j, packed in self._packed.items():  # what its bound missed by, for the next step's order
                bound = self._bounds[1].get(j, 0.0)
                if bound > 0:  # a running mean: one step's miss does not reorder the next
                    self._ratios[j] = (self._ratios[j] + max(packed.predicted_s) / bound) / 2
        else:
            k, _ = select_candidate(lengths, self.strategies, estimate=self.estimate, exact=self.estimate,
                                    switch_s=self.switch_s)
            t = self.exact(k, lengths) + self.switch_s[k]
        return k, t, self._packed.get(k)
