"""From a layer measured on one GPU to the TP degrees the planners search (pure).

``python -m hetu_ext.cli.calibrate`` on one GPU measures TP 1 only: ``t_1(s) = a s^2 + b s + c`` seconds for one
layer's forward + backward on a document of ``s`` tokens. The planners' benchmarks (HotSPa, Hydraulis, LobRA) search
TP 1..8, and price only the degrees their ``--cost-model`` table holds. :func:`extend_by_tp` adds TP ``t`` entries
from the measured ones and the step model's ratios (:mod:`hetu_ext.plan.cost.step_model`, one device profile):

* ``a_t = a_1 x attention(t) / attention(1)``: the attention core's time at ``1 / t`` of the heads;
* ``b_t = b_1 x rest(t) / rest(1) + comm``: GEMMs and memory-bound kernels per token at TP ``t`` relative to TP
  1 (the efficiency curve at the smaller GEMMs), plus the 4 TP all-reduces per token and layer (forward and
  backward) at the profile's NVLink bus bandwidth;
* ``c_t = c_1``; memory per token and fixed memory scaled by the inventory's activation bytes and parameters at
  TP ``t`` over TP 1.

Measured degrees are kept as they are. The derived entries carry the model's assumptions; a table measured on
``t`` GPUs (``--tp 1,2,4,8``) replaces them.

    python -m hetu_ext.plan.cost.calibration --table layer.yaml --out layer_tp.yaml --device h100-sxm \\
        --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 11008 [--tp 2,4,8]
"""

from __future__ import annotations

import dataclasses
import sys

from hetu_ext.data.cost import CostTable, LengthCost
from hetu_ext.model import inventory
from hetu_ext.model.spec import ModelSpec

from . import step_model
from hetu_ext.plan.cost.devices import Device, load_device

REFERENCE_TOKENS = 4096
"""Tokens of the microbatch at which the per-token ratio of GEMMs and kernels is taken."""


def _tp_parts(spec: ModelSpec, device: Device, tp: int) -> tuple[float, float, float]:
    """(attention-core seconds per squared token, other compute seconds per token, TP comm seconds per token) of
    one layer's forward + backward at TP ``tp`` (FlashAttention-style causal kernel, no recomputation)."""
    s = REFERENCE_TOKENS
    spec = dataclasses.replace(spec, seq_length=s, max_position_embeddings=s)
    par = step_model.Parallel(tp=tp, flash_attention=True)
    whole = step_model.layer_pass(spec, device, par)
    attention_flops = inventory.layer_forward_flops(spec, tokens=0, sum_sq=s * s, causal=True) / tp
    attention = 3 * attention_flops / device.gemm_flops_per_s(s, s, spec.kv_channels)
    compute = whole.compute_f + whole.compute_b - attention
    return attention / (s * s), compute / s, (whole.comm_f + whole.comm_b) / s


def extend_by_tp(table: CostTable, spec: ModelSpec, device: Device, tps: tuple[int, ...] = (2, 4, 8)) -> CostTable:
    """``table`` with an entry for each degree of ``tps`` it lacks, derived from its TP 1 entry (above)."""
    base = table.for_tp(1)
    a1, b1, _ = _tp_parts(spec, device, 1)
    per_tp = dict(table.per_tp)
    act1 = inventory.activation_bytes_per_token(spec, tp=1, attention_scores=False)
    params1 = inventory.layer_params(spec, tp=1)
    for tp in tps:
        if tp in per_tp:
            continue
        inventory.check_tp(spec, tp, where="extend the cost table: ")
        a_t, b_t, comm = _tp_parts(spec, device, tp)
        per_tp[tp] = LengthCost(
            a=base.a * a_t / a1, b=base.b * b_t / b1 + comm, c=base.c,
            memory_per_token_bytes=base.memory_per_token_bytes * inventory.activation_bytes_per_token(
                spec, tp=tp, attention_scores=False) / act1,
            memory_fixed_bytes=base.memory_fixed_bytes * inventory.layer_params(spec, tp=tp) / params1)
    derived = sorted(set(per_tp) - set(table.per_tp))
    note = f"{table.note}; TP {derived} derived from TP 1 by hetu_ext.plan.cost.calibration ({device.name} profile)"
    return dataclasses.replace(table, per_tp=dict(sorted(per_tp.items())), note=note.lstrip("; "))


if __name__ == "__main__":  # the command line lives with the planners' (hetu_ext.plan.cli)
    from hetu_ext.plan.cli import calibration_main

    sys.exit(calibration_main())
