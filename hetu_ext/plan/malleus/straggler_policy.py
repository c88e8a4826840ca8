"""Stragglers from per-rank timings, with hysteresis (pure): when is a rank slow, when is it worth a new plan, and
which plan.

Each rank reports, per step, the seconds it spent computing (not waiting on communication) and the work it did
(FLOPs of its layers for its microbatches: attention's ``s^2`` term included, so a batch of long sequences is not
mistaken for a slow GPU). A rank's **rate** is seconds per FLOP; its **slowdown** is its rate over the lower median
rate of the ranks (the healthy pace, assuming at most half the ranks straggle), the median taken over the
last ``window`` steps so that one noisy step does not count.

Defaults, and why: a rank counts as a straggler at 1.3x (below that, a non-uniform plan gains less than the
pause to migrate costs at Malleus's measured migration times); a new plan is proposed only when some rank's
slowdown moved by 20% or more from the one the current plan assumed (measured noise on shared CPUs is ~10%,
so plans do not flap); the window is 5 steps (detection within ~5 steps of onset).

:class:`StragglerDetector` keeps the estimate and the slowdowns the current plan assumes across exchanges of
timings; :func:`replan` makes Malleus's plan for the stragglers it finds. Both are deterministic, so every rank,
fed the same timings, reaches the same verdict and the same plan with no further communication. The straggler
monitor (hetu_ext/megatron/monitor.py) feeds them what hetu_ext/runtime/straggler.py measures and exchanges.
"""

from __future__ import annotations

import statistics
from collections import defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from hetu_ext.plan.core.cluster import Cluster
from hetu_ext.plan.cost.stage import CostModel
from hetu_ext.plan.malleus import PlannedStep, plan_malleus
from hetu_ext.model.spec import ModelSpec
from hetu_ext.plan.core.plan import Plan


@dataclass(kw_only=True)
class StragglerPolicy:
    """Hysteresis of straggler detection (``straggler:`` section / ``--hetu-straggler-*`` flags)."""

    threshold: float = 1.3
    """A rank whose slowdown is at least this is a straggler."""
    min_change: float = 0.2
    """Propose a new plan only if a slowdown moved by this fraction from what the current plan assumed."""
    window: int = 5
    """Steps over which each rank's rate is a median."""

    def __post_init__(self) -> None:
        if self.threshold < 1.0 or self.min_change <= 0 or self.window < 1:
            raise ValueError(f"straggler policy: need threshold >= 1, min_change > 0, window >= 1; got "
                             f"{self.threshold}, {self.min_change}, {self.window}")


@dataclass
class SlowdownEstimator:
    """Per-rank slowdowns from a stream of (rank, compute seconds, FLOPs) samples."""

    policy: StragglerPolicy = field(default_factory=StragglerPolicy)
    _rates: dict[int, deque] = field(default_factory=lambda: defaultdict(deque))

    def add(self, rank: int, seconds: float, flops: float) -> None:
        if flops <= 0:
            return
        rates = self._rates[rank]
        rates.append(seconds / flops)
        while len(rates) > self.policy.window:
            rates.popleft()

    def slowdowns(self) -> dict[int, float]:
        """Rank -> slowdown (1.0 = the lower-median pace) of the ranks with a full window of samples."""
        per_rank = {rank: statistics.median(rates) for rank, rates in self._rates.items()
                    if len(rates) >= self.policy.window}
        if not per_rank:
            return {}
        healthy = statistics.median_low(per_rank.values())  # of two middle paces the faster: 1 of 2 may straggle
        return {rank: max(1.0, rate / healthy) for rank, rate in per_rank.items()}

    def stragglers(self) -> dict[int, float]:
        return {r: x for r, x in self.slowdowns().items() if x >= self.policy.threshold}


def should_replan(assumed: dict[int, float], measured: dict[int, float], policy: StragglerPolicy) -> bool:
    """True when a measured slowdown differs from the one the current plan assumed by ``min_change`` or more,
    counting only ranks that are, or were assumed to be, stragglers."""
    for rank in set(assumed) | set(measured):
        was, now = assumed.get(rank, 1.0), measured.get(rank, 1.0)
        if max(was, now) < policy.threshold:
            continue
        if abs(now - was) / was >= policy.min_change:
            return True
    return False


@dataclass(frozen=True)
class Detection:
    """What the timings say at one exchange."""

    estimates: dict[int, float]
    """Measured slowdowns (rank -> x, 1.0 = the healthy pace) of the ranks with a full window of samples."""
    stragglers: dict[int, float]
    """The slowdowns a plan should assume now: the measured ones at or past the threshold, and those assumed
    before for ranks not measured now (an idle rank without a full window of probes keeps its last slowdown)."""
    changed: bool
    """The stragglers moved past the hysteresis (:func:`should_replan`) from those the current plan assumes."""


@dataclass
class StragglerDetector:
    """Detection with hysteresis over a stream of per-rank timings (pure: no clock, no process group)."""

    policy: StragglerPolicy = field(default_factory=StragglerPolicy)
    assumed: dict[int, float] = field(default_factory=dict)
    """Slowdowns the current plan was made for (none: a healthy cluster); set by :meth:`detect` on a change."""
    estimator: SlowdownEstimator = field(init=False)

    def __post_init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        """A new plan: each rank's work per step changed, so past rates no longer compare (``assumed`` stays)."""
        self.estimator = SlowdownEstimator(policy=self.policy)

    def add(self, timings: Iterable[tuple[int, Iterable[tuple[float, float]]]]) -> None:
        """Per rank, its (compute seconds, FLOPs) samples since the last exchange."""
        for rank, samples in timings:
            for seconds, flops in samples:
                self.estimator.add(rank, seconds, flops)

    def detect(self) -> Detection | None:
        """The verdict of the samples so far; None until some rank has a full window. On a change the new
        stragglers become ``assumed`` (the plan made for them, or the failure to make one, is the caller's)."""
        measured = self.estimator.slowdowns()
        if not measured:
            return None
        unmeasured = {r: x for r, x in self.assumed.items() if r not in measured}
        stragglers = {**unmeasured, **{r: x for r, x in measured.items() if x >= self.policy.threshold}}
        changed = should_replan(self.assumed, stragglers, self.policy)
        if changed:
            self.assumed = stragglers
        return Detection(estimates=measured, stragglers=stragglers, changed=changed)


def replan(current: Plan, spec: ModelSpec, slowdowns: dict[int, float], *, micro_batch: int, gpus_per_node: int,
           gpu_memory_bytes: int, optimizer_sharded: bool = False) -> PlannedStep:
    """Malleus's plan for ``current``'s ranks and microbatch count under ``slowdowns`` (rank -> x), keeping
    ``current`` when it is as good (``plan_malleus``'s ``current``). ValueError when no plan fits.
    ``optimizer_sharded``: the run's optimizer state is sharded (--use-distributed-optimizer)."""
    cluster = Cluster(world_size=current.world_size, gpus_per_node=gpus_per_node,
                      gpu_memory_bytes=gpu_memory_bytes, slowdowns=slowdowns)
    return plan_malleus(cluster, spec, micro_batch=micro_batch, num_microbatches=current.num_microbatches,
                        current=current, cost=CostModel(optimizer_sharded=optimizer_sharded))
