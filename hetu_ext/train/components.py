"""The trainer's components built from the run's settings: the LR scheduler, the straggler monitor and its
emulated layer costs, and a plan's short name."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable

from hetu_ext.config import PackingConfig, StragglerConfig, TrainingConfig
from hetu_ext.megatron import host
from hetu_ext.megatron.monitor import StragglerMonitor
from hetu_ext.megatron.placement import Placement
from hetu_ext.megatron.state import scheduler_settings
from hetu_ext.plan import ModelSpec, Plan, plan_to_dict
from hetu_ext.plan.core.batches import scheduler_unit
from hetu_ext.plan.malleus.straggler_policy import StragglerPolicy
from hetu_ext.runtime.straggler import CostFn, parse_schedule


def make_scheduler(training: TrainingConfig, packing: PackingConfig, placement: Placement, plan: Plan):
    """Megatron's LR/weight-decay scheduler, stepped in samples as Megatron-LM does (None on idle ranks)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if not placement.active:
        return None
    unit = scheduler_unit(training, packing, plan)
    return OptimizerParamScheduler(placement.optimizer, init_lr=0.0,
                                   **scheduler_settings(training, unit))


def plan_id(plan: Plan) -> str:
    """A short stable name of a plan (metrics records, events): the first 10 hex digits of its YAML's SHA-1."""
    return hashlib.sha1(json.dumps(plan_to_dict(plan), sort_keys=True).encode()).hexdigest()[:10]


def straggler_monitor(straggler: StragglerConfig, micro_batch: int, log_interval: int, spec: ModelSpec, plan: Plan,
                      h: host.Host, placement: Placement, optimizer_sharded: bool = False):
    """The straggler monitor (on every rank, idle ones too), or None when --hetu-straggler-interval is 0."""
    if not straggler.interval:
        return None
    monitor = StragglerMonitor(
        rank=h.rank, plan=plan, spec=spec, micro_batch=micro_batch, interval=straggler.interval,
        policy=StragglerPolicy(threshold=straggler.threshold, min_change=straggler.min_change,
                               window=straggler.window),
        events=parse_schedule(straggler.emulate_slowdown or ""),
        gpus_per_node=straggler.gpus_per_node or h.world_size, replan_output=straggler.replan_output,
        log_interval=log_interval)
    if straggler.emulate_layer_ms:
        monitor.timer.nominal_s = straggler.emulate_layer_ms / 1e3
    monitor.layer_cost = emulated_layer_cost(straggler)
    monitor.optimizer_sharded = optimizer_sharded
    return monitor


def emulated_layer_cost(straggler: StragglerConfig) -> Callable[[int], CostFn] | None:
    """--hetu-emulate-cost FILE: TP degree -> (tokens, sum of squares) -> one layer's fwd + bwd seconds."""
    if not straggler.emulate_cost:
        return None
    from hetu_ext.data.cost import load_cost_table

    table = load_cost_table(straggler.emulate_cost)

    def per_tp(tp: int) -> CostFn:
        cost = table.for_tp(tp)
        return lambda tokens, sum_sq: cost.moments_s(sum_sq, tokens)

    return per_tp
