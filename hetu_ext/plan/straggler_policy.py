"""Stragglers from per-rank timings, with hysteresis (pure): when is a rank slow, and when is it worth a new plan.

Each rank reports, per step, the seconds it spent computing (not waiting on communication) and the work it did
(FLOPs of its layers for its microbatches: attention's ``s^2`` term included, so a batch of long sequences is not
mistaken for a slow GPU). A rank's **rate** is seconds per FLOP; its **slowdown** is its rate over the lower median
rate of the ranks (the healthy pace, assuming at most half the ranks straggle), the median taken over the
last ``window`` steps so that one noisy step does not count.

Defaults, and why: a rank counts as a straggler at 1.3x (below that, a non-uniform plan gains less than the
pause to migrate costs at Malleus's measured migration times); a new plan is proposed only when some rank's
slowdown moved by 20% or more from the one the current plan assumed (measured noise on shared CPUs is ~10%,
so plans do not flap); the window is 5 steps (detection within ~5 steps of onset).
"""

from __future__ import annotations

import statistics
from collections import defaultdict, deque
from dataclasses import dataclass, field


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
