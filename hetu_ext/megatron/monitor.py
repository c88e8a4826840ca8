"""Malleus's straggler monitor on a training run: time each rank's layers, estimate slowdowns, propose a plan.

Every ``interval`` steps the used ranks exchange their per-step compute seconds and FLOPs (one small
all_gather_object over the plan's used ranks); every rank then holds the same :class:`SlowdownEstimator`. When
the slowdowns move past the policy's hysteresis, every rank makes the same Malleus plan for them (the planner
is pure and deterministic); the plan's lowest used rank logs the slowdowns, the detection latency when the
slowdown was emulated, and the plan (also written to ``--hetu-replan-output`` if given). With
``--hetu-straggler-replan online`` the trainer then migrates to it (migrate.py) and goes on.

Between changes the reporting rank also prints the estimate every ``log_interval`` steps (at the first exchange
at or after each multiple), Megatron-LM-like and one line at any scale::

    straggler monitor: step 20 | slowest: rank 3 x4.02 | median: x1.00 | stragglers: rank 3 x4.02 |

Idle ranks take part in every exchange, so they can join a migration, and time one transformer layer of the
model (the probe) before each, so their speed stays measured: a dropped straggler that recovers is brought back
by the next plan. Until an idle rank has a full window of probes it keeps the slowdown it was last assumed at.

The monitor composes parts that each do one job: hetu_ext/runtime/straggler.py times the layers
(:class:`LayerTimer`), emulates slowdowns (:func:`factor_at`, :func:`onset_latency`) and exchanges the timings
(:func:`exchange_timings`, the only collective); hetu_ext/plan/malleus/straggler_policy.py detects with hysteresis
(:class:`StragglerDetector`) and re-plans (:func:`replan`), both pure. What stays here: the work a step's
timings are divided by, the idle rank's probe of a Megatron-core layer, the log lines, the metrics events and
the plan file.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hetu_ext.plan import ModelSpec, Plan, dump_plan, format_plan, plan_to_dict
from hetu_ext.model import inventory
from hetu_ext.plan.cost.stage import layer_forward_flops
from hetu_ext.plan.malleus.straggler_policy import StragglerDetector, StragglerPolicy, replan
from hetu_ext.runtime.straggler import CostFn, LayerTimer, SlowdownEvent, exchange_timings, factor_at, onset_latency


@dataclass
class StragglerMonitor:
    rank: int
    plan: Plan
    spec: ModelSpec
    micro_batch: int
    interval: int
    policy: StragglerPolicy
    events: list[SlowdownEvent]
    gpus_per_node: int
    gpu_memory_bytes: int = 80 * 2**30
    replan_output: str | None = None
    log_interval: int = 1
    """Print the estimate every this many steps (at the exchanges; 0: only when the stragglers change)."""
    timer: LayerTimer = field(default_factory=LayerTimer)
    layer_cost: Callable[[int], CostFn] | None = None
    optimizer_sharded: bool = False
    """--use-distributed-optimizer on the plan runtime: re-plans use the sharded optimizer's memory."""
    """--hetu-emulate-cost: TP degree -> one layer's emulated seconds for a microbatch's shape."""
    detector: StragglerDetector = field(init=False)
    detections: list[tuple[int, dict[int, float]]] = field(default_factory=list)
    estimates: dict[int, float] = field(default_factory=dict)
    """The latest measured slowdowns (rank -> x, 1.0 = the healthy pace); empty until a window is full."""
    compute_ms: dict[int, float] = field(default_factory=dict)
    """Per rank, its mean measured compute milliseconds per step since the previous exchange."""
    exchanged_at: int = 0
    """The step of the last exchange (``compute_ms`` and ``estimates`` are from it)."""
    metrics: object | None = None
    """A :class:`hetu_ext.metrics.MetricsWriter` for detection / re-plan events (the reporting rank's), or None."""
    _printed: int = 0
    """The step of the last estimate line."""
    _warm: set[int] = field(default_factory=set)
    _samples: list[tuple[float, float]] = field(default_factory=list)
    """(compute seconds, FLOPs) per step since the last exchange."""
    _flops: float = 0.0

    def __post_init__(self) -> None:
        self.detector = StragglerDetector(policy=self.policy)
        self.use_plan(self.plan)

    @property
    def assumed(self) -> dict[int, float]:
        """Slowdowns the current plan was made for (none: a healthy cluster)."""
        return self.detector.assumed

    def use_plan(self, plan: Plan) -> None:
        """Follow a new plan: this rank's work per step changes, past timings no longer compare."""
        self.plan = plan
        self.detector.restart()
        self._samples, self._flops = [], 0.0
        where = plan.stage_of(self.rank)
        if where is not None:
            pipeline = plan.pipelines[where[0]]
            stage = pipeline.stages[where[1]]
            # fwd + bwd FLOPs of this rank's share of its layers per step (TP splits each layer's work)
            self._flops = (3 * stage.num_layers * pipeline.num_microbatches
                           * layer_forward_flops(self.spec, self.micro_batch) / stage.tp)

    def use_microbatches(self, shapes: list[tuple[int, int]]) -> None:
        """This step's microbatches as (tokens, sum of squared document lengths) (--hetu-packing: packs differ,
        so does the work a step's timings are divided by)."""
        where = self.plan.stage_of(self.rank)
        if where is not None:
            stage = self.plan.pipelines[where[0]].stages[where[1]]
            self._flops = 3 * stage.num_layers / stage.tp * sum(
                inventory.layer_forward_flops(self.spec, tokens=t, sum_sq=q) for t, q in shapes)

    def use_group_microbatches(self, groups: list[tuple[Plan, list[tuple[int, int]]]]) -> None:
        """HotSPa: this step's work is the sum over its groups of this rank's share under each group's plan."""
        self._flops = 0.0
        for plan, shapes in groups:
            where = plan.stage_of(self.rank)
            if where is not None:
                stage = plan.pipelines[where[0]].stages[where[1]]
                self._flops += 3 * stage.num_layers / stage.tp * sum(
                    inventory.layer_forward_flops(self.spec, tokens=t, sum_sq=q) for t, q in shapes)

    def attach(self, layers, tp: int = 1) -> None:
        """Time ``layers`` (a stage of TP degree ``tp``: the cost emulation's strategy)."""
        self.timer.attach(list(layers), cost=self.layer_cost(tp) if self.layer_cost else None)

    def before_step(self, step: int) -> None:
        """``step``: the 1-based number of the step about to run (as in the log lines)."""
        self.timer.factor = factor_at(self.events, self.rank, step)

    def probe(self, layer, iteration: int) -> None:
        """Idle rank: time one microbatch through one layer (forward and backward), as the others' layers are
        timed, and record it; called at each exchange so the idle rank's speed stays measured."""
        s, b, h = self.spec.seq_length, self.micro_batch, self.spec.hidden_size
        param = next(layer.parameters())
        x = torch.randn(s, b, h, dtype=param.dtype, device=param.device, requires_grad=True)  # (s, b, h)

        def run() -> None:
            out, _ = layer(hidden_states=x, attention_mask=None)
            out.float().sum().backward()
            layer.zero_grad(set_to_none=True)

        if id(layer) not in self._warm:
            run()  # the first pass pays one-off costs (allocation, kernel selection) the training steps do not
            self._warm.add(id(layer))
        handles = self.timer.attach([layer], cost=self.layer_cost(1) if self.layer_cost else None)
        self.before_step(iteration)
        run()
        work = self.timer.take_work() if self.timer.cost_emulated else 3 * layer_forward_flops(self.spec, b)
        self._samples.append((self.timer.take(), work))
        for handle in handles:
            handle.remove()

    def estimate_line(self, iteration: int) -> str:
        """The current estimate as one log line: the slowest rank, the median and the stragglers assumed."""
        slowest = max(sorted(self.estimates), key=self.estimates.__getitem__)
        median = statistics.median(self.estimates.values())
        shown = ", ".join(f"rank {r} x{x:.2f}" for r, x in sorted(self.assumed.items())) or "none"
        return (f"straggler monitor: step {iteration} | slowest: rank {slowest} x{self.estimates[slowest]:.2f} | "
                f"median: x{median:.2f} | stragglers: {shown} |")

    def _event(self, event: str, **fields) -> None:
        if self.metrics is not None and self.rank == min(self.plan.used_ranks):
            self.metrics.event(event, **fields)

    def after_step(self, iteration: int, log) -> Plan | None:
        """Record the step; every ``interval`` steps exchange timings (collective over all ranks, idle ones
        included) and return a new plan when the slowdowns moved past the hysteresis, else None."""
        if self.timer.cost_emulated:  # the emulated cost model's seconds are the work, whatever the packs
            work = self.timer.take_work()
            if work:
                self._samples.append((self.timer.take(), work))
        elif self._flops:
            self._samples.append((self.timer.take(), self._flops))
        if iteration % self.interval:
            return None
        everyone = exchange_timings(self.rank, self._samples)
        self._samples = []
        self.exchanged_at = iteration
        self.compute_ms = {rank: 1e3 * sum(s for s, _ in samples) / len(samples)
                           for rank, samples in everyone if samples}
        self.detector.add(everyone)
        found = self.detector.detect()
        if found is None:
            return None
        self.estimates = found.estimates
        reporter = self.rank == min(self.plan.used_ranks)
        say = log if reporter else (lambda _: None)
        if not found.changed:
            if self.log_interval and iteration // self.log_interval > self._printed // self.log_interval:
                self._printed = iteration
                say(self.estimate_line(iteration))
            return None
        self._printed = iteration  # the detection line below says it
        stragglers = found.stragglers
        self.detections.append((iteration, stragglers))
        latency = onset_latency(self.events, stragglers, iteration)
        shown = ", ".join(f"rank {r} x{x:.2f}" for r, x in sorted(stragglers.items())) or "none"
        say(f"straggler monitor: step {iteration}: stragglers {shown}"
            f"{f', {latency} steps after onset' if latency is not None else ''}")
        self._event("detection", iteration=iteration, stragglers={str(r): x for r, x in stragglers.items()},
                    latency_steps=latency)
        return self._replan(iteration, stragglers, say, reporter)

    def _replan(self, iteration: int, stragglers: dict[int, float], say, reporter: bool) -> Plan | None:
        """Malleus's plan for the stragglers, said, recorded and written to ``replan_output``; None if it is the
        current plan or none fits."""
        try:
            planned = replan(self.plan, self.spec, stragglers, micro_batch=self.micro_batch,
                             gpus_per_node=self.gpus_per_node, gpu_memory_bytes=self.gpu_memory_bytes,
                             optimizer_sharded=self.optimizer_sharded)
        except ValueError as exc:
            say(f"straggler monitor: no plan for these slowdowns: {exc}")
            return None
        if planned.plan == self.plan:
            say("straggler monitor: the current plan is still the best one")
            self._event("replan", iteration=iteration, changed=False)
            return None
        say(f"straggler monitor: Malleus plan for them ({planned.template}):\n{format_plan(planned.plan)}")
        self._event("replan", iteration=iteration, changed=True, template=str(planned.template),
                    plan=plan_to_dict(planned.plan))
        if self.replan_output and reporter:
            with open(self.replan_output, "w") as f:
                f.write(dump_plan(planned.plan))
            say(f"straggler monitor: wrote {self.replan_output}")
        return planned.plan
