"""Straggler weighting on DeepSpeed's engine at every ZeRO stage: each rank's share of the global batch follows
the measured speeds.

DeepSpeed 0.19.4+ lets the caller decide how many backward passes make a step (``"managed_gradient_accumulation":
false``; ``backward(loss, scale_wrt_gas=False)`` then ``step()``). Two ways to give a slow rank less work:

* ZeRO-0 and ZeRO-1 (``WEIGHTED_STAGES``): a rank's backwards only accumulate into its own gradients and ``step()``
  reduces once, so ranks may run different *microbatch counts* (``--hetu-microbatches 3,1``; the unit of the
  counts is a microbatch).
* ZeRO-2 and ZeRO-3 (``BUDGET_STAGES``) reduce-scatter gradients (and ZeRO-3 gathers parameters) on every
  forward and backward: a rank running fewer microbatches would leave the others waiting in a collective it never
  joins (DeepSpeed's own issues report ZeRO-3 hanging so). Every rank runs the same number of microbatches (the
  global batch's microbatches over the ranks) and a slow rank gets fewer *tokens* per microbatch: the unit of the
  counts is a sample (``seq_length`` tokens), a rank's samples are cut into that many microbatches of
  near-equal size (:func:`budget_microbatches`), each at least one sample. Under ``--hetu-packing`` the packer's
  token shares do it, the packs evened out per step (packs.py).

Exactness: every rank's loss is its microbatches' token-summed loss over the global batch's tokens (one small
all-reduce of token counts per step), times the world size (DeepSpeed averages over the ranks), so the update is
the single-process one on the same global batch for any split of it.

Speeds: the same parts as the Megatron path's monitor (hetu_ext/runtime/straggler.py times each transformer layer,
emulates slowdowns and exchanges timings; hetu_ext/plan/malleus/straggler_policy.py detects with hysteresis). A rank's
work per step is its count (microbatches or samples: each of one shape) or, packed, its tokens; on a change the
counts are Malleus's split over one-stage pipelines (:func:`weighted_counts`, pure): the slowest rank's ``count x
slowdown`` is minimised, every rank keeping its least (one microbatch; under ZeRO-2/3 one sample per microbatch).
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


BUDGET_STAGES = (2, 3)
"""ZeRO stages that reduce (2) and gather (3) on every pass: every rank runs the same microbatch count, weighting
moves samples (or packed tokens) between ranks instead."""


def check_stage(stage: int, microbatches: tuple[int, ...] | None = None) -> None:
    """One error naming rule, values and fix when per-rank microbatch counts are asked of a ZeRO stage that
    reduces per backward (``--hetu-straggler-interval`` and ``--hetu-packing`` work at every stage)."""
    if microbatches and stage not in WEIGHTED_STAGES:
        raise ValueError(f"--hetu-microbatches {','.join(map(str, microbatches))} gives the ranks different "
                         f"microbatch counts, which needs a ZeRO stage whose backwards only accumulate locally "
                         f"({', '.join(map(str, WEIGHTED_STAGES))}); ZeRO-{stage} reduces gradients on every "
                         "backward, so the ranks would deadlock: pass --zero-stage 1, or drop --hetu-microbatches and "
                         "let --hetu-straggler-interval N move samples between ranks (the same microbatch count on "
                         "each)")


def weighted_counts(total: int, slowdowns: dict[int, float], world: int, least: int = 1) -> tuple[int, ...]:
    """Units (microbatches or samples) per rank summing to ``total``, minimising max over ranks of ``count x
    slowdown`` (rank absent from ``slowdowns``: 1.0), each rank at least ``least`` (pure).

    >>> weighted_counts(4, {1: 3.0}, 2)
    (3, 1)
    >>> weighted_counts(12, {2: 3.0}, 3, least=2)
    (5, 5, 2)
    """
    from hetu_ext.plan.malleus import balance_microbatches

    if total < world * least:
        raise ValueError(f"{total} units per global batch cannot give each of {world} ranks {least}")
    x = [slowdowns.get(r, 1.0) for r in range(world)]
    counts = balance_microbatches(total, x, x)
    while min(counts) < least:  # every rank keeps its least (DeepSpeed's step expects a backward on each)
        poor = counts.index(min(counts))
        rich = max(range(world), key=lambda r: ((counts[r] - 1) * x[r], r) if counts[r] > least else (-1.0, r))
        counts[poor] += 1
        counts[rich] -= 1
    return tuple(counts)


def budget_microbatches(counts: tuple[int, ...], rank: int, iteration: int, per_rank: int) -> list[range]:
    """Sample ids of ``rank``'s ``per_rank`` microbatches in step ``iteration`` (0-based) when rank r holds
    ``counts[r]`` samples of the global batch (samples [gB, (g + 1)B), B = sum(counts), dealt in rank order): its
    samples cut into ``per_rank`` runs whose sizes differ by at most one, larger first (pure).

    >>> budget_microbatches((5, 5, 2), 1, 0, 2)
    [range(5, 8), range(8, 10)]
    """
    if counts[rank] < per_rank:
        raise ValueError(f"rank {rank} holds {counts[rank]} samples, fewer than its {per_rank} microbatches")
    start = iteration * sum(counts) + sum(counts[:rank])
    out = []
    for m in range(per_rank):
        size = counts[rank] // per_rank + (1 if m < counts[rank] % per_rank else 0)
        out.append(range(start, start + size))
        start += size
    return out


def rank_plan(counts: tuple[int, ...], num_layers: int) -> Plan:
    """One-stage pipelines (rank r = pipeline r) with these microbatch counts: the data assignment's plan."""
    return Plan(pipelines=tuple(
        Pipeline(stages=(Stage(ranks=(r,), layer_start=0, layer_stop=num_layers, has_embedding=True,
                               has_output=True),), num_microbatches=c) for r, c in enumerate(counts)))


@dataclass
class MicrobatchWeighting:
    """Measure each rank's layer speed and follow it with the counts (every rank holds one)."""

    rank: int
    world: int
    counts: tuple[int, ...]
    """Per rank: microbatches (ZeRO-0/1, ``per_rank`` 0) or samples (ZeRO-2/3: ``per_rank`` microbatches each)."""
    interval: int
    """Exchange timings every this many steps (0: counts stay as given)."""
    policy: object
    """A :class:`hetu_ext.plan.malleus.straggler_policy.StragglerPolicy`."""
    events: list = field(default_factory=list)
    """Emulated slowdowns (hetu_ext.runtime.straggler.parse_schedule)."""
    nominal_s: float | None = None
    """--hetu-emulate-layer-ms in seconds (emulated device time of a layer's forward of ``nominal_tokens``)."""
    nominal_tokens: int = 0
    """Tokens of a full microbatch (micro-batch size x seq_length): a pass of t tokens is emulated as
    ``nominal_s x t / nominal_tokens`` (so a slow rank given fewer tokens per microbatch is faster); 0: every pass
    takes ``nominal_s``."""
    per_rank: int = 0
    """ZeRO-2/3: the microbatches every rank runs (``counts`` are samples, each rank at least this many); 0:
    ``counts`` are microbatches (ZeRO-0/1)."""
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

    @property
    def unit(self) -> str:
        return "samples" if self.per_rank else "microbatches"

    def attach(self, layers) -> None:
        if self.nominal_s is not None and self.nominal_tokens:
            scale = 3.0 * self.nominal_s / self.nominal_tokens  # the timer's cost is forward + backward (1 + 2)
            self.timer.nominal_s = None
            self.timer.attach(list(layers), cost=lambda tokens, _squares: scale * tokens)
        else:
            self.timer.attach(list(layers))

    def exclude_collectives(self, engine) -> list[str]:
        """Leave ZeRO's work inside the layers that is not the layers' compute out of the timed spans (a healthy
        rank's wait in a collective there is the straggler's compute): ZeRO-3's parameter management around every
        submodule (the ``DeepSpeedZeRoOffload`` functions its forward and backward hooks call: gathering the
        parameters, waiting for them, releasing them, tracing the order for prefetching) and ZeRO-1/2/3's gradient
        reductions (the optimizer's ``reduce_ready_partitions_and_remove_grads``, which every parameter's gradient
        hook calls; ZeRO-1 only with ``overlap_comm``). Returns what it wrapped; ZeRO-0 communicates in
        ``step()``."""
        wrapped, optimizer, stage = [], engine.optimizer, engine.zero_optimization_stage()
        targets = []
        if stage >= 2 or (stage == 1 and hasattr(optimizer, "reduce_ready_partitions_and_remove_grads")):
            targets.append((optimizer, "reduce_ready_partitions_and_remove_grads"))
        if stage == 3:
            targets += [(optimizer.parameter_offload, f"{when}_sub_module_{way}_function")
                        for when in ("pre", "post") for way in ("forward", "backward")]
        for owner, name in targets:
            if not callable(getattr(owner, name, None)):
                raise RuntimeError(f"ZeRO-{stage} straggler weighting: DeepSpeed's {type(owner).__name__} has no "
                                   f"{name} (another DeepSpeed version?), so the layer timings would include "
                                   "collective waits: use DeepSpeed 0.19.x or drop --hetu-straggler-interval")
            setattr(owner, name, self.timer.exclude(getattr(owner, name)))
            wrapped.append(f"{type(owner).__name__}.{name}")
        return wrapped

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
        counts = weighted_counts(self.total, found.stragglers, self.world, least=max(1, self.per_rank))
        self.assumed = dict(found.stragglers)
        if counts == self.counts and work is None:
            return False
        self.counts = counts
        self.history.append((iteration + 1, counts))
        self.detector.restart()
        if self.rank == 0:
            shown = ", ".join(f"rank {r} x{x:.2f}" for r, x in sorted(found.stragglers.items())) or "none"
            log(f"straggler monitor: step {iteration}: stragglers {shown}; {self.unit} per rank from step "
                f"{iteration + 1}: {list(counts)}")
        return True
