"""Hydraulis's FLOP cost table (per TP degree, from the step model's per-layer formulas and a device's
memory) and the gradient all-reduce of a plan (pure)."""

from __future__ import annotations

from collections.abc import Sequence

from hetu_ext.data.cost import CostTable, LengthCost
from hetu_ext.model import inventory
from hetu_ext.model.spec import ModelSpec
from hetu_ext.plan.core.options import PLAIN, Options
from hetu_ext.plan.core.plan import Plan
from hetu_ext.plan.cost.stage import CostModel


def flops_cost_table(spec: ModelSpec, *, memory_bytes: float, tp_degrees: Sequence[int] = (1, 2, 4, 8),
                     cost: CostModel | None = None, options: Options = PLAIN,
                     world_size: int | None = None) -> CostTable:
    """Per-layer costs of training ``spec`` from hetu_ext.plan.cost.stage's device constants (an A100-class GPU by
    default), for the planning CLI and benchmarks when no measured table is given: per token
    3 x the inventory's matmul FLOPs (forward + backward; GPT: ``2 (4 h^2 + 2 h f)``) at ``flops_per_s x tp x
    efficiency`` plus the 4 TP all-reduces of ``h`` values (ring ``2 (t-1)/t``, intra-node link); per squared
    token 3 x its causal attention FLOPs (GPT: ``2 h``); 1e-4 s per microbatch. Memory: the inventory's
    activations per token without the score matrices (GPT: ``10 h + 24 h / t`` bytes, bf16, FlashAttention, no
    sequence parallelism), weights, gradients and Adam state ``dtype + grad + optimizer_state`` bytes per
    parameter a rank holds (split tensors divided by TP).

    ``options`` (hetu_ext.plan.core.options): recomputation adds the inventory's recomputed FLOPs (``full``: the whole
    forward and its 2 forward all-reduces again; ``selective``: the attention core) and keeps the inventory's
    activations for it (``full``: the layer input; the one layer recomputing at a time holds its whole activations
    for a microbatch of up to ``spec.seq_length`` tokens: that much is taken off the device memory, at the
    smallest TP degree, an upper bound); sequence parallelism (TP > 1) the same all-reduce bytes and the
    activations TP left whole split by TP; the distributed optimizer keeps the Adam state once over the
    ``world_size`` ranks (each rank's share, ``optimizer_state x parameters / world_size``, taken off the device
    memory; the per-layer fixed bytes are weights and gradients)."""
    cost = cost or CostModel()
    if options.distributed_optimizer and not world_size:
        raise ValueError("flops_cost_table: the distributed optimizer needs world_size (the ranks sharing the state)")
    h, f = spec.hidden_size, spec.ffn_hidden_size
    rc = options.recompute
    per_tp = {}
    for tp in tp_degrees:
        speed = cost.flops_per_s * tp * cost.tp_efficiency.get(tp, 0.8)
        comm = 0.0 if tp == 1 else 4 * 2 * (tp - 1) / tp * h * cost.dtype_bytes / cost.intra_node_bytes_per_s
        redo_a = inventory.layer_recompute_flops(spec, tokens=0.0, sum_sq=1.0, recompute=rc, causal=True)
        redo_b = inventory.layer_recompute_flops(spec, tokens=1.0, sum_sq=0.0, recompute=rc, causal=True)
        sp = options.sequence_parallel and tp > 1
        per_tp[tp] = LengthCost(
            a=(3 * inventory.attention_flops_per_square_token(spec, causal=True) + redo_a) / speed,
            b=(3 * inventory.layer_matmul_flops_per_token(spec) + redo_b) / speed
            + comm * (1.5 if rc == "full" else 1.0), c=1e-4,
            memory_per_token_bytes=inventory.activation_bytes_per_token(
                spec, tp=tp, attention_scores=False, sequence_parallel=sp, recompute=rc) * cost.dtype_bytes / 2,
            memory_fixed_bytes=inventory.layer_params(spec, tp=tp) * (
                cost.dtype_bytes + cost.grad_bytes + (0 if options.distributed_optimizer
                                                      else cost.optimizer_state_bytes)))
    memory = memory_bytes
    if options.distributed_optimizer:
        memory -= cost.optimizer_state_bytes * inventory.param_count(spec) / world_size
    if rc == "full":
        low = min(tp_degrees)
        memory -= spec.seq_length * inventory.activation_bytes_per_token(
            spec, tp=low, attention_scores=False, sequence_parallel=options.sequence_parallel and low > 1
        ) * cost.dtype_bytes / 2
    if memory <= 0:
        raise ValueError(f"flops_cost_table: the options {options.name} leave no memory of {memory_bytes:.3g} bytes")
    what = "" if options == PLAIN else f", {options.name}"
    return CostTable(per_tp=per_tp, device=f"flops-model({cost.flops_per_s / 1e12:g} TFLOP/s, "
                     f"TP link {cost.intra_node_bytes_per_s / 1e9:g} GB/s, h {h}, ffn {f}{what})",
                     device_memory_bytes=memory)


def sync_seconds(plan: Plan, spec: ModelSpec, *, bandwidth: float, grad_bytes: int = 4) -> float:
    """Predicted seconds of the data-parallel gradient all-reduce of ``plan`` (ring: ``2 (d-1)/d`` of each rank's
    gradient bytes over ``bandwidth`` bytes/s, ``d`` the pipelines), the slowest rank's; heterogeneous pipelines
    priced the same way (each rank's layers and embedding, divided by its TP degree). Equals
    hetu_ext.plan.hotspa.allreduce_seconds on a uniform plan."""
    worst = 0.0
    for pipeline in plan.pipelines:
        for stage in pipeline.stages:
            d = len(plan.pipelines) * stage.cp  # CP ranks hold the same weights: reduced over DP x CP
            if d == 1:
                continue
            elements = inventory.layer_params(spec, tp=stage.tp) * stage.num_layers
            if stage.has_embedding:
                elements += spec.padded_vocab_size * spec.hidden_size / stage.tp
            worst = max(worst, 2 * (d - 1) / d * elements * grad_bytes / bandwidth)
    return worst
