"""A plan's pipelines as the packer sees them (pure): per stage, the cost of a microbatch at the stage's TP degree,
layers and slowest rank; per pipeline, the most tokens a pack may hold in the device's memory. The packing
algorithms (:mod:`hetu_ext.data.packing`) know replicas only, never plans."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from hetu_ext.data.cost import CostTable
from hetu_ext.data.packing import ReplicaSpec
from hetu_ext.model.spec import ModelSpec

from hetu_ext.plan.core.plan import Plan


@dataclass(frozen=True)
class ReplicaShape:
    """One replica shape: ``tp`` x ``pp`` GPUs, what one microbatch may hold, its per-stage cost (the pools of
    LobRA's deployments and Hydraulis's candidates)."""

    tp: int
    pp: int
    capacity: int
    """Most tokens of one microbatch (memory bound)."""
    replica: ReplicaSpec

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    @property
    def name(self) -> str:
        return f"TP{self.tp}PP{self.pp}"


def replica_specs(plan: Plan, model: ModelSpec, cost: CostTable, *, slowdowns: Mapping[int, float] | None = None,
                  max_pack_tokens: int) -> list[ReplicaSpec]:
    """One ReplicaSpec per pipeline of ``plan``: stage costs = per-layer cost at the stage's TP degree x its layers
    x its slowest rank's slowdown; capacity = ``max_pack_tokens`` lowered to what fits in ``cost``'s device
    memory with the microbatches 1F1B keeps in flight on each stage (``pp - j`` on stage j)."""
    if model.num_layers != plan.pipelines[0].stages[-1].layer_stop:
        raise ValueError(f"replica_specs: the plan holds {plan.pipelines[0].stages[-1].layer_stop} layers but the "
                         f"model has {model.num_layers}; use the plan made for this model")
    slowdowns = dict(slowdowns or {})
    specs = []
    for i, pipeline in enumerate(plan.pipelines):
        stage_costs, capacity = [], max_pack_tokens
        for j, stage in enumerate(pipeline.stages):
            layer = cost.for_tp(stage.tp)
            slow = max(slowdowns.get(r, 1.0) for r in stage.ranks)
            stage_cost = layer.times_layers(stage.num_layers, slow)
            stage_costs.append(stage_cost)
            if cost.device_memory_bytes is not None and stage_cost.memory_per_token_bytes > 0:
                in_flight = pipeline.pp - j
                free = cost.device_memory_bytes - stage_cost.memory_fixed_bytes
                capacity = min(capacity, int(free // (stage_cost.memory_per_token_bytes * in_flight)))
        if capacity < 1:
            raise ValueError(f"replica_specs: pipeline {i} cannot hold one token per microbatch in "
                             f"{cost.device_memory_bytes:.3g} bytes per device; use more stages or a larger TP")
        specs.append(ReplicaSpec(stage_costs=tuple(stage_costs), token_capacity=capacity))
    return specs
