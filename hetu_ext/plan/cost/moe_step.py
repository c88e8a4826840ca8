"""An MoE run in the step model (pure): Megatron-LM's uniform grid with expert parallelism (``ep``) and expert TP
(``etp``, default the TP degree), every layer an MoE layer, the alltoall token dispatcher.

The MoE model is priced as the dense model of the same attention whose MLP does the work of the active experts
(:func:`active_equivalent`: width ``topk x F + F_shared``, so its GEMM FLOPs per token are those of the
``moe_router_topk`` experts each token visits and the shared experts), then corrected for what differs:

* **expert GEMMs**: a rank runs ``E / ep`` experts, each over ``m = T ep topk / E`` tokens (balanced routing; ``T``
  the rank's tokens per microbatch, ``b s / (cp tp)`` under sequence parallelism), each a GEMM of its own shape: the
  forward's difference against the equivalent's wide MLP GEMMs at the device's efficiency curve (backward 2x, full
  recomputation once more);
* **all-to-all** (the term a dense model has not): per MoE layer and microbatch, dispatch and combine in the
  forward, again in the backward (and the forward's again under full recomputation), each sending the ``(ep-1)/ep``
  of the rank's ``T topk h`` bf16 values that leave it, over the EP group (Megatron's rank order tp-cp-ep-dp: it
  leaves the node when ``tp cp ep`` exceeds it), not overlapped;
* **parameters**: the router ``(E, h)`` on every rank, ``E / ep`` experts cut by ``etp``, the shared experts by
  TP, against the equivalent's MLP: weights and gradients (6 bytes per element), Adam (12, over the DP x CP ranks
  for the dense part, over the expert-data-parallel ranks ``dp cp tp / (ep etp)`` for the experts' under the
  distributed optimizer) and the optimizer step's traffic;
* **gradient reduction** of the experts over their expert-data-parallel group instead of the equivalent MLP's over
  DP x CP (exposed as step_model's is: hidden behind the backward when overlapped).

Megatron's TFLOP/s and MFU count the MoE model's own FLOPs (the inventory's: active experts, the router).
Not modelled: routing imbalance (capacity, dropped tokens), the permutation kernels, grouped-GEMM kernels'
efficiency, a layout with dense layers (``--moe-layer-freq``: refused).
"""

from __future__ import annotations

import dataclasses

from hetu_ext.model import inventory
from hetu_ext.model.spec import ModelSpec

from hetu_ext.plan.cost import step_model
from hetu_ext.plan.cost.devices import Device

WEIGHT_GRAD_BYTES = 6
"""bf16 weight and fp32 gradient per element."""
ADAM_BYTES = 12
"""fp32 master and two moments per element."""


def check(spec: ModelSpec, par: step_model.Parallel) -> None:
    """ValueError (one line) for an MoE layout Megatron-LM would refuse, or one the model does not price."""
    etp = par.etp or par.tp
    if not all(spec.moe_layers):
        raise ValueError("--moe-layer-freq other than 1 (dense layers between MoE ones) is not priced by the step "
                         "model; predict with every layer an MoE layer")
    if spec.num_experts % par.ep:
        raise ValueError(f"--expert-model-parallel-size {par.ep} must divide --num-experts {spec.num_experts}")
    if (par.dp * par.cp * par.tp) % (par.ep * etp):
        raise ValueError(f"--expert-model-parallel-size x --expert-tensor-parallel-size = {par.ep} x {etp} must "
                         f"divide the ranks of a stage's data-parallel x CP x TP group ({par.dp} x {par.cp} x "
                         f"{par.tp}); change --gpus or the expert sizes")
    if spec.moe_ffn_hidden_size % etp:
        raise ValueError(f"--expert-tensor-parallel-size {etp} must divide --moe-ffn-hidden-size "
                         f"{spec.moe_ffn_hidden_size}")


def active_equivalent(spec: ModelSpec) -> ModelSpec:
    """The dense model whose MLP does the active experts' and shared experts' work (width ``topk F + F_shared``)."""
    width = spec.moe_router_topk * spec.moe_ffn_hidden_size + (spec.moe_shared_expert_intermediate_size or 0)
    return dataclasses.replace(spec, num_experts=None, ffn_hidden_size=width, moe_ffn_hidden_size=None,
                               moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False,
                               moe_router_enable_expert_bias=False, moe_layer_freq=1)


def _rank_tokens(spec: ModelSpec, par: step_model.Parallel) -> float:
    """Tokens of one microbatch a rank routes (sequence parallelism splits them by TP, as MoE with TP needs)."""
    return par.micro_batch_size * spec.seq_length / (par.cp * par.tp)


def _mlp_rows(spec: ModelSpec, f: int) -> int:
    return 2 * f if spec.swiglu else f


def expert_gemm_delta_s(spec: ModelSpec, device: Device, par: step_model.Parallel) -> float:
    """Forward seconds per MoE layer and microbatch: the experts' own GEMMs (and the shared experts') less the
    equivalent's wide MLP GEMMs."""
    etp, h, t = par.etp or par.tp, spec.hidden_size, par.tp
    tokens = _rank_tokens(spec, par) * (1 if par.tp == 1 else t)  # a TP group's tokens, each GEMM cut by TP/ETP
    f, local = spec.moe_ffn_hidden_size, spec.num_experts // par.ep
    m = tokens * par.ep * spec.moe_router_topk / spec.num_experts

    def gemms(m_: float, f_: int, cut: int) -> float:
        rows = _mlp_rows(spec, f_)
        return (2 * m_ * rows * h / cut / device.gemm_flops_per_s(m_, rows / cut, h)
                + 2 * m_ * h * f_ / cut / device.gemm_flops_per_s(m_, h, f_ / cut))

    moe = local * gemms(m, f, etp)
    if spec.moe_shared_expert_intermediate_size:
        moe += gemms(tokens, spec.moe_shared_expert_intermediate_size, t)
    routed = _rank_tokens(spec, par)
    moe += 2 * routed * h * spec.num_experts / device.gemm_flops_per_s(routed, spec.num_experts, h)  # router
    return moe - gemms(tokens, active_equivalent(spec).ffn_hidden_size, t)


def all_to_all_s(spec: ModelSpec, device: Device, par: step_model.Parallel) -> float:
    """One dispatch (or combine) of one MoE layer and microbatch over the EP group, seconds."""
    if par.ep == 1:
        return 0.0
    bw, latency = device.link(par.ep, spans_nodes=par.tp * par.cp * par.ep > device.gpus_per_node)
    leaving = (par.ep - 1) / par.ep * _rank_tokens(spec, par) * spec.moe_router_topk * spec.hidden_size * 2
    return leaving / bw + latency


def layer_params(spec: ModelSpec, par: step_model.Parallel) -> tuple[float, float, float]:
    """Per rank and MoE layer: (the MoE MLP's non-expert elements, its expert elements, the equivalent MLP's)."""
    etp, h = par.etp or par.tp, spec.hidden_size
    f, fs = spec.moe_ffn_hidden_size, spec.moe_shared_expert_intermediate_size
    experts = spec.num_experts // par.ep * (_mlp_rows(spec, f) + f) * h / etp
    dense = spec.num_experts * h + ((_mlp_rows(spec, fs) + fs) * h / par.tp if fs else 0.0)
    dense += h if spec.moe_shared_expert_gate else 0.0
    width = active_equivalent(spec).ffn_hidden_size
    return dense, experts, (_mlp_rows(spec, width) + width) * h / par.tp


def predict(spec: ModelSpec, par: step_model.Parallel, device: Device) -> step_model.Prediction:
    """Step time, throughput and peak memory per GPU of the MoE ``spec`` under ``par`` on ``device``."""
    check(spec, par)
    equivalent = active_equivalent(spec)
    base = step_model.predict(equivalent, dataclasses.replace(par, ep=1, etp=None), device)
    layers = max(step_model.stage_layers(equivalent, par))
    m, redo = par.microbatches, 1 if par.recompute == "full" else 0
    compute = m * layers * expert_gemm_delta_s(spec, device, par) * (3 + redo)
    a2a = m * layers * all_to_all_s(spec, device, par) * (4 + 2 * redo)
    dense, experts, replaced = layer_params(spec, par)
    holders = par.dp * par.cp if par.distributed_optimizer else 1
    expert_holders = par.dp * par.cp * par.tp // (par.ep * (par.etp or par.tp)) if par.distributed_optimizer else 1
    memory = layers * ((dense - replaced) * (WEIGHT_GRAD_BYTES + ADAM_BYTES / holders)
                       + experts * (WEIGHT_GRAD_BYTES + ADAM_BYTES / expert_holders))
    updated = layers * ((dense - replaced) / holders + experts / expert_holders)
    optimizer = updated * step_model.OPTIMIZER_BYTES_PER_PARAM / device.hbm_bytes_per_s
    dp_comm = 0.0 if par.overlap_grad_reduce else _reduce_delta_s(device, par, layers, dense - replaced, experts)
    step = base.step_s + compute + a2a + optimizer + dp_comm
    tokens = par.global_batch_size * spec.seq_length
    extra = 3 * tokens * spec.num_layers * (inventory.layer_matmul_flops_per_token(spec, moe=True)
                                            - inventory.layer_matmul_flops_per_token(equivalent))
    counted = step_model.step_flops(equivalent, par) + extra * (4 / 3 if redo else 1)
    model = step_model.step_flops(equivalent, par, recompute=False, causal=True) + extra
    parts = {**base.parts, "compute": base.parts["compute"] + compute, "ep_comm": a2a,
             "optimizer": base.parts["optimizer"] + optimizer, "dp_comm": base.parts["dp_comm"] + dp_comm}
    return step_model.Prediction(step_s=step, tflops_per_gpu=counted / (step * par.gpus) / 1e12,
                                 mfu=model / (step * par.gpus * device.peak_flops),
                                 memory_bytes=base.memory_bytes + memory, parts=parts)


def _reduce_delta_s(device: Device, par: step_model.Parallel, layers: int, dense: float, experts: float) -> float:
    """The gradient reduction's change, not overlapped: the experts' over their expert-data-parallel group and the
    non-expert difference over DP x CP (all-reduce; reduce-scatter + gather under the distributed optimizer)."""
    factor = (1.0 if par.distributed_optimizer else 2.0) * step_model.GRAD_REDUCE_BYTES + (
        2.0 if par.distributed_optimizer else 0.0)

    def reduce(elements: float, group: int) -> float:
        if group <= 1:
            return 0.0
        bw, _ = device.link(group, spans_nodes=par.gpus > device.gpus_per_node)
        return (group - 1) / group * elements * factor / bw

    expert_group = par.dp * par.cp * par.tp // (par.ep * (par.etp or par.tp))
    return reduce(layers * experts, expert_group) + reduce(layers * dense, par.dp * par.cp)
