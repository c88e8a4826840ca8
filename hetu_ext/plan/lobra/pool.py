"""LobRA's pool of replica shapes (pure): a layer's cost with a frozen base at each TP degree, and every TP x PP
that holds enough tokens, pruned (the package docstring, step 1)."""

from __future__ import annotations

import dataclasses
import itertools

from hetu_ext.data.cost import CostTable, LengthCost
from hetu_ext.data.packing import ReplicaSpec
from hetu_ext.model import inventory
from hetu_ext.model.spec import ModelSpec
from hetu_ext.plan.core.options import PLAIN, Options
from hetu_ext.plan.core.replicas import ReplicaShape, cp_cost
from hetu_ext.plan.cost.stage import CostModel


DEGREES = (1, 2, 4, 8, 16)


MIN_CAPACITY = 1024
"""Fewest tokens a pool strategy must hold per microbatch (else more pipeline stages are tried)."""


def layer_cost(spec: ModelSpec, cost: CostModel, tp: int, options: Options = PLAIN) -> LengthCost:
    """Forward + backward seconds and memory of one transformer layer at TP ``tp`` with a frozen base (LoRA).
    ``options``: recomputation adds the inventory's recomputed FLOPs (``full``: the forward's all-reduces too) and
    keeps its activations; sequence parallelism (TP > 1) splits the activations TP left whole (same all-reduce
    bytes); the distributed optimizer changes nothing (the frozen base has no optimizer state)."""
    h = spec.hidden_size
    eff = cost.tp_efficiency.get(tp, 0.8)
    rc = options.recompute
    b = (3 * inventory.layer_matmul_flops_per_token(spec)
         + inventory.layer_recompute_flops(spec, tokens=1.0, sum_sq=0.0, recompute=rc)) / (cost.flops_per_s * tp * eff)
    if tp > 1 and tp not in cost.tp_measured:  # 2 all-reduces of s x h forward, 2 backward, ring 2 (t-1)/t
        b += 2 * 2 * h * cost.dtype_bytes * 2 * (tp - 1) / tp / cost.intra_node_bytes_per_s * (1.5 if rc == "full"
                                                                                                 else 1.0)
    a = (3 * inventory.attention_flops_per_square_token(spec)
         + inventory.layer_recompute_flops(spec, tokens=0.0, sum_sq=1.0, recompute=rc)) / (cost.flops_per_s * tp * eff)
    per_token = inventory.activation_bytes_per_token(spec, tp=tp, attention_scores=False, recompute=rc,
                                                     sequence_parallel=options.sequence_parallel and tp > 1)
    return LengthCost(a=a, b=b, c=1e-4, memory_per_token_bytes=per_token * cost.dtype_bytes / 2,
                      memory_fixed_bytes=inventory.layer_params(spec, tp=tp) * cost.dtype_bytes)


def strategy_pool(spec: ModelSpec, cost: CostModel, *, gpu_memory_bytes: float, gpus_per_node: int,
                  max_gpus: int, prune: bool = True, table: CostTable | None = None,
                  min_capacity: int = MIN_CAPACITY, options: Options = PLAIN,
                  cp_degrees: tuple[int, ...] = (1,)) -> list[ReplicaShape]:
    """Every feasible (tp, pp), and (tp, cp) without PP for CP of ``cp_degrees`` (:func:`cp_cost`; the sequence
    split in 2 cp chunks; default: no CP), that holds >= 1 token per microbatch, dominated ones pruned (module docstring).
    ``options`` (FLOP model only): priced by :func:`layer_cost`; under full recomputation the one layer
    recomputing at a time holds its whole activations for a microbatch of up to ``spec.seq_length`` tokens, taken
    off the memory.
    ``table``: measured per-layer costs (python -m hetu_ext.cli.calibrate) used instead of the FLOP model for
    the TP degrees it has (others are skipped), with its own device memory when it gives one."""
    out = []
    if table is not None and table.device_memory_bytes is not None:
        gpu_memory_bytes = table.device_memory_bytes
    shapes = [(tp, pp, 1) for tp, pp in itertools.product(DEGREES, DEGREES)] + [
        (tp, 1, cp) for tp, cp in itertools.product(DEGREES, cp_degrees) if cp > 1 and spec.seq_length % (2 * cp) == 0]
    for tp, pp, cp in shapes:
        if tp > gpus_per_node or tp * cp * pp > max_gpus or spec.num_layers % pp or inventory.tp_problems(spec, tp):
            continue
        if table is not None and tp not in table.per_tp:
            continue
        layer = table.for_tp(tp) if table is not None else layer_cost(spec, cost, tp, options)
        layer = cp_cost(layer, spec, tp=tp, cp=cp, link_bytes_per_s=cost.inter_node_bytes_per_s if tp * cp >
                        gpus_per_node else cost.intra_node_bytes_per_s, dtype_bytes=cost.dtype_bytes)
        stage = layer.times_layers(spec.num_layers // pp)
        memory = gpu_memory_bytes
        if table is None and options.recompute == "full":
            memory -= spec.seq_length / cp * inventory.activation_bytes_per_token(
                spec, tp=tp, attention_scores=False, sequence_parallel=options.sequence_parallel and tp > 1
            ) * cost.dtype_bytes / 2
        capacity = int((memory - stage.memory_fixed_bytes) // (stage.memory_per_token_bytes * pp))
        if capacity < 1:
            continue
        out.append(ReplicaShape(tp, pp, capacity, ReplicaSpec(stage_costs=(stage,) * pp, token_capacity=capacity),
                                cp=cp))
    if not prune:
        return out
    # pipeline stages add GPUs and bubbles but barely any capacity (1F1B keeps pp microbatches in flight on the
    # first stage): per TP degree keep the fewest stages holding MIN_CAPACITY tokens; then drop a strategy when
    # another of no more GPUs holds as many tokens at no higher GPU-seconds per token
    kept = []
    for tp, cp in sorted({(s.tp, s.cp) for s in out}):
        mine = sorted((s for s in out if (s.tp, s.cp) == (tp, cp)), key=lambda s: s.pp)
        kept.append(mine[0])  # the fewest stages that fit at all
        enough = [s for s in mine if s.capacity >= min_capacity]
        if enough and enough[0] is not mine[0]:
            kept.append(enough[0])  # and the fewest that hold min_capacity tokens

    def per_token_gpu_s(s: ReplicaShape) -> float:
        return s.replica.stage_costs[0].b * s.gpus

    return [s for s in kept if not any(o is not s and o.gpus <= s.gpus and o.capacity >= s.capacity
                                       and per_token_gpu_s(o) <= per_token_gpu_s(s) for o in kept)]


def lobra_cost_model(**overrides) -> CostModel:
    """hetu_ext.plan.cost.stage's A100-class defaults (bf16 weights), fields overridable."""
    return dataclasses.replace(CostModel(), **overrides)
