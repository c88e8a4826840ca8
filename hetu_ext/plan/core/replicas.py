"""A plan's pipelines as the packer sees them (pure): per stage, the cost of a microbatch at the stage's TP degree,
layers and slowest rank; per pipeline, the most tokens a pack may hold in the device's memory. The packing
algorithms (:mod:`hetu_ext.data.packing`) know replicas only, never plans."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from hetu_ext.data.cost import CostTable, LengthCost
from hetu_ext.data.packing import ReplicaSpec
from hetu_ext.model.spec import ModelSpec

from hetu_ext.plan.core.plan import Plan


CP_DEGREES = (1, 2, 4, 8)
"""Context-parallel degrees the planners' strategy spaces hold."""
CP_LINK_BYTES_PER_S = 100e9
"""Bus bandwidth of a CP group's K/V all-gather and gradient reduce-scatter (the planners' benchmarks' switch and
all-reduce links: 100 GB/s per GPU)."""


@dataclass(frozen=True)
class ReplicaShape:
    """One replica shape: ``tp`` x ``cp`` x ``pp`` GPUs, what one microbatch may hold, its per-stage cost (the
    pools of LobRA's deployments and Hydraulis's candidates)."""

    tp: int
    pp: int
    capacity: int
    """Most tokens of one microbatch (memory bound)."""
    replica: ReplicaSpec
    cp: int = 1
    """Context-parallel degree of every stage."""

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp

    @property
    def name(self) -> str:
        return f"TP{self.tp}PP{self.pp}" + (f"CP{self.cp}" if self.cp > 1 else "")


def cp_cost(layer: LengthCost, model: ModelSpec, *, tp: int, cp: int,
            link_bytes_per_s: float = CP_LINK_BYTES_PER_S, dtype_bytes: int = 2) -> LengthCost:
    """A layer's cost on each of ``cp`` context-parallel TP groups (the step model's CP, ``all_gather``,
    :mod:`hetu_ext.plan.cost.step_model`): every document of a pack split in two load-balanced chunks per rank, so
    attention (``a``) and per-token work (``b``) divide by ``cp``; every token's K/V heads (``2 g d / tp``
    values) are gathered by the other ``cp - 1`` ranks in the forward and their gradients reduce-scattered in the
    backward, ``2 (cp-1)/cp x 2 g d / tp x dtype_bytes / link`` seconds per token, exposed; the per-microbatch
    ``c`` is unchanged; activations per token divide by ``cp`` (a pack holds ``cp`` times the tokens)."""
    if cp == 1:
        return layer
    kv = 2 * model.num_query_groups * model.kv_channels / tp * dtype_bytes
    exchange = 2 * (cp - 1) / cp * kv / link_bytes_per_s
    return LengthCost(a=layer.a / cp, b=layer.b / cp + exchange, c=layer.c,
                      memory_per_token_bytes=layer.memory_per_token_bytes / cp,
                      memory_fixed_bytes=layer.memory_fixed_bytes)


def replica_specs(plan: Plan, model: ModelSpec, cost: CostTable, *, slowdowns: Mapping[int, float] | None = None,
                  max_pack_tokens: int) -> list[ReplicaSpec]:
    """One ReplicaSpec per pipeline of ``plan``: stage costs = per-layer cost at the stage's TP degree x its layers
    x its slowest rank's slowdown (CP stages: :func:`cp_cost`); capacity = ``max_pack_tokens`` lowered to what fits in ``cost``'s device
    memory with the microbatches 1F1B keeps in flight on each stage (``pp - j`` on stage j)."""
    if model.num_layers != plan.pipelines[0].stages[-1].layer_stop:
        raise ValueError(f"replica_specs: the plan holds {plan.pipelines[0].stages[-1].layer_stop} layers but the "
                         f"model has {model.num_layers}; use the plan made for this model")
    slowdowns = dict(slowdowns or {})
    specs = []
    for i, pipeline in enumerate(plan.pipelines):
        stage_costs, capacity = [], max_pack_tokens
        for j, stage in enumerate(pipeline.stages):
            layer = cp_cost(cost.for_tp(stage.tp), model, tp=stage.tp, cp=stage.cp)
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
