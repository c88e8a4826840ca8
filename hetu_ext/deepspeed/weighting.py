"""Straggler-weighted microbatches on DeepSpeed's engine: per-rank microbatch counts that follow measured speeds.

DeepSpeed 0.19.4+ lets the caller decide how many backward passes make a step (``"managed_gradient_accumulation":
false``; ``backward(loss, scale_wrt_gas=False)`` then ``step()``). Under ZeRO-0 and ZeRO-1 a rank's backwards only
accumulate into its own gradients and ``step()`` reduces once (an average over the ranks), so ranks may run
different microbatch counts. ZeRO-2/3 reduce-scatter on every backward (``partition_gradients``): a rank with fewer
microbatches would leave the others waiting in a collective it never joins, so they are refused
(:func:`check_stage`).

Exactness: every rank's loss is its microbatches' token-summed loss over the global batch's tokens (one small
all-reduce of token counts per step), times the world size (DeepSpeed averages over the ranks), so the update is
the single-process one on the same global batch for any split of it.

Speeds: the same parts as the Megatron path's monitor (hetu_ext/runtime/straggler.py times each transformer layer,
emulates slowdowns and exchanges timings; hetu_ext/plan/malleus/straggler_policy.py detects with hysteresis). A rank's
work per step is its microbatch count (every microbatch has the same shape here), and on a change the counts are
Malleus's split of the global batch's microbatches over one-stage pipelines (:func:`weighted_counts`, pure):
the slowest rank's ``count x slowdown`` is minimised, every rank keeping at least one microbatch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from hetu_ext.plan import Plan
from hetu_ext.plan.core.plan import Pipeline, Stage

logger = logging.getLogger(__name__)

WEIGHTED_STAGES = (0, 1)
"""ZeRO stages whose backwards accumulate locally: 0 (DeepSpeed without ZeRO: ``step()`` all-reduces the
gradients) and 1 (``step()`` reduces them to the partitions)."""


def check_stage(stage: int, interval: int, microbatches: tuple[int, ...] | None = None, packing: str = "off") -> None:
    """One error naming rule, values and fix when weighting (or packing, whose pack counts differ per rank) is
    asked of a ZeRO stage that reduces per backward."""
    if (interval or microbatches or packing != "off") and stage not in WEIGHTED_STAGES:
        asked = (f"--hetu-straggler-interval {interval}" if interval else f"--hetu-packing {packing}"
                 if packing != "off" else f"microbatches {list(microbatches or ())}")
        raise ValueError(f"{asked} weights microbatches per rank, which needs a ZeRO stage whose backwards only "
                         f"accumulate locally ({', '.join(map(str, WEIGHTED_STAGES))}); ZeRO-{stage} reduces "
                         "gradients on every backward, so ranks with different microbatch counts would deadlock: "
                         "pass --zero-stage 1 or drop the weighting")


def weighted_counts(total: int, slowdowns: dict[int, float], world: int) -> tuple[int, ...]:
    """Microbatches per rank summing to ``total``, minimising max over ranks of ``count x slowdown`` (rank absent
    from ``slowdowns``: 1.0), each rank at least 1 (pure).

    >>> weighted_counts(4, {1: 3.0}, 2)
    (3, 1)
    """
    from hetu_ext.plan.malleus import balance_microbatches

    if total < world:
        raise ValueError(f"{total} microbatches per global batch cannot give each of {world} ranks one")
    x = [slowdowns.get(r, 1.0) for r in range(world)]
    counts = balance_microbatches(total, x, x)
    while min(counts) < 1:  # every rank keeps one microbatch (DeepSpeed's step expects a backward on each)
        poor = counts.index(min(counts))
        rich = max(range(world), key=lambda r: ((counts[r] - 1) * x[r], r) if counts[r] > 1 else (-1.0, r))
        counts[poor] += 1
        counts[rich] -= 1
    return tuple(counts)


def rank_plan(counts: tuple[int, ...], num_layers: int) -> Plan:
    """One-stage pipelines (rank r = pipeline r) with these microbatch counts: the data assignment's plan."""
    return Plan(pipelines=tuple(
        Pipeline(stages=(Stage(ranks=(r,), layer_start=0, layer_stop=num_layers, has_embedding=True,
                               has_output=True),), num_microbatches=c) for r, c in enumerate(counts)))


@dataclass
class MicrobatchWeighting:
    """Measure each rank's layer speed and follow it with the microbatch counts (every rank holds one)."""

    rank: int
    world: int
    counts: tuple[int, ...]
    interval: int
    """Exchange timings every this many steps (0: counts stay as given)."""
    policy: object
    """A :class:`hetu_ext.plan.malleus.straggler_policy.StragglerPolicy`."""
    events: list = field(default_factory=list)
    """Emulated slowdowns (hetu_ext.runtime.straggler.parse_schedule)."""
    nominal_s: float | None = None
    """--hetu-emulate-layer-ms in seconds (emulated device time of a layer's forward)."""
    assumed: dict[int, float] = field(default_factory=dict)
    """The slowdowns of the latest change (rank -> x)."""
    history: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)
    """(step from which they apply, counts) at the start and at each change."""
    detector: object = field(init=False)
    timer: object = field(init=False)
    _samples: list[tuple[float, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        from hetu_ext.plan.malleus.straggler_policy import StragglerDetector
        from hetu_ext.runtime.straggler import LayerTimer

        self.detector = StragglerDetector(policy=self.policy)
        self.timer = LayerTimer(nominal_s=self.nominal_s)
        self.history.append((1, self.counts))

    @property
    def total(self) -> int:
        return sum(self.counts)

    def attach(self, layers) -> None:
        self.timer.attach(list(layers))

    def before_step(self, step: int) -> None:
        """``step``: 1-based number of the step about to run."""
        from hetu_ext.runtime.straggler import factor_at

        self.timer.factor = factor_at(self.events, self.rank, step)

    def after_step(self, iteration: int, log: Callable[[str], None], work: float | None = None) -> bool:
        """Record the step (``iteration`` steps done; ``work``: this rank's work in it, default its microbatch
        count; --hetu-packing: its tokens); every ``interval`` steps exchange timings (collective) and, when the
        stragglers moved past the hysteresis, set new counts from the next step; True then (``assumed``: the
        slowdowns the counts, or the packer, now follow)."""
        from hetu_ext.runtime.straggler import exchange_timings

        if not self.interval:
            return False
        self._samples.append((self.timer.take(), float(self.counts[self.rank] if work is None else work)))
        if iteration % self.interval:
            return False
        everyone = exchange_timings(self.rank, self._samples)
        self._samples = []
        self.detector.add(everyone)
        found = self.detector.detect()
        if found is None or not found.changed:
            return False
        counts = weighted_counts(self.total, found.stragglers, self.world)
        self.assumed = dict(found.stragglers)
        if counts == self.counts and work is None:
            return False
        self.counts = counts
        self.history.append((iteration + 1, counts))
        self.detector.restart()
        if self.rank == 0:
            shown = ", ".join(f"rank {r} x{x:.2f}" for r, x in sorted(found.stragglers.items())) or "none"
            log(f"straggler monitor: step {iteration}: stragglers {shown}; microbatches per rank from step "
                f"{iteration + 1}: {list(counts)}")
        return True
