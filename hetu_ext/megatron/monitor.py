"""Malleus's straggler monitor on a training run: time each rank's layers, estimate slowdowns, propose a plan.

Every ``interval`` steps the used ranks exchange their per-step compute seconds and FLOPs (one small
all_gather_object over the plan's used ranks); every rank then holds the same :class:`SlowdownEstimator`. When
the slowdowns move past the policy's hysteresis, the plan's lowest used rank logs them, with the detection
latency when the slowdown was emulated, and the plan the Malleus planner makes for them (written to
``--hetu-replan-output`` if given). Migrating the running job to that plan online is the next step of the
Malleus issue; today the plan is applied by restarting with ``--hetu-plan``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch.distributed as dist

from hetu_ext.plan import ModelSpec, Plan, dump_plan, format_plan
from hetu_ext.plan.cluster import Cluster
from hetu_ext.plan.cost import layer_forward_flops
from hetu_ext.plan.malleus import plan_malleus
from hetu_ext.plan.straggler_policy import SlowdownEstimator, StragglerPolicy, should_replan
from hetu_ext.runtime.straggler import LayerTimer, SlowdownEvent, factor_at

logger = logging.getLogger(__name__)


@dataclass
class StragglerMonitor:
    rank: int
    plan: Plan
    spec: ModelSpec
    micro_batch: int
    interval: int
    policy: StragglerPolicy
    events: list[SlowdownEvent]
    group: object
    gpus_per_node: int
    replan_output: str | None = None
    timer: LayerTimer = field(default_factory=LayerTimer)
    estimator: SlowdownEstimator = field(init=False)
    assumed: dict[int, float] = field(default_factory=dict)
    """Slowdowns the current plan was made for (none: a healthy cluster)."""
    detections: list[tuple[int, dict[int, float]]] = field(default_factory=list)
    _samples: list[tuple[int, float, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.estimator = SlowdownEstimator(policy=self.policy)
        where = self.plan.stage_of(self.rank)
        pipeline = self.plan.pipelines[where[0]]
        layers = pipeline.stages[where[1]].num_layers
        # fwd + bwd FLOPs of this rank's share of its layers per step (TP splits each layer's work)
        self._flops = (3 * layers * pipeline.num_microbatches * layer_forward_flops(self.spec, self.micro_batch)
                       / pipeline.stages[where[1]].tp)

    def attach(self, layers) -> None:
        self.timer.attach(list(layers))

    def before_step(self, step: int) -> None:
        """``step``: the 1-based number of the step about to run (as in the log lines)."""
        self.timer.factor = factor_at(self.events, self.rank, step)

    def after_step(self, iteration: int, log) -> None:
        self._samples.append((iteration, self.timer.take(), self._flops))
        if iteration % self.interval:
            return
        everyone: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, (self.rank, self._samples), group=self.group)
        self._samples = []
        for rank, samples in everyone:
            for _, seconds, flops in samples:
                self.estimator.add(rank, seconds, flops)
        measured = self.estimator.stragglers()
        if not should_replan(self.assumed, measured, self.policy):
            return
        self.detections.append((iteration, measured))
        self.assumed = measured
        if self.rank != min(self.plan.used_ranks):
            return
        onsets = [e.step for e in self.events if e.rank in measured and e.step <= iteration]
        latency = f", {iteration - max(onsets)} steps after onset" if onsets else ""
        shown = ", ".join(f"rank {r} x{x:.2f}" for r, x in sorted(measured.items())) or "none"
        log(f"straggler monitor: step {iteration}: stragglers {shown}{latency}")
        cluster = Cluster(world_size=self.plan.world_size, gpus_per_node=self.gpus_per_node,
                          gpu_memory_bytes=80 * 2**30, slowdowns=measured)
        try:
            planned = plan_malleus(cluster, self.spec, micro_batch=self.micro_batch,
                                   num_microbatches=self.plan.num_microbatches)
        except ValueError as exc:
            log(f"straggler monitor: no plan for these slowdowns: {exc}")
            return
        log(f"straggler monitor: Malleus plan for them ({planned.template}):\n{format_plan(planned.plan)}")
        if self.replan_output:
            with open(self.replan_output, "w") as f:
                f.write(dump_plan(planned.plan))
            log(f"straggler monitor: wrote {self.replan_output}; restart with --hetu-plan to apply it")
