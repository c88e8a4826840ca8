"""The step-time and memory model (issue 35): recomputation and sequence parallelism in the per-stage cost the
planners share, the device profiles, ``python -m hetu_ext.plan predict`` and its fit to published GPU throughput.
Pure and fast: no torch, no process group."""

from __future__ import annotations

import pytest

from hetu_ext.model import inventory as inv
from hetu_ext.model.spec import ModelSpec
from hetu_ext.plan.cost import CostModel, stage_cost

GPT = ModelSpec(num_layers=4, hidden_size=1024, num_attention_heads=16, seq_length=2048, vocab_size=51200)
LLAMA = ModelSpec(num_layers=4, hidden_size=1024, num_attention_heads=16, num_query_groups=4, ffn_hidden_size=2816,
                  swiglu=True, normalization="RMSNorm", position_embedding_type="rope", add_bias_linear=False,
                  seq_length=2048, vocab_size=32000)
STAGE = dict(num_layers=4, slowdown=1.0, micro_batch=2, first=False, last=False, in_flight=3)


@pytest.mark.parametrize("spec", [GPT, LLAMA], ids=["gpt", "llama"])
def test_sequence_parallel_divides_every_activation_by_tp(spec):
    """Korthikanti et al. Table 2: with SP the 10 h TP left whole is split too, so a layer keeps
    (10 h + 24 h + 5 a s) / t; catches an SP that divides only part of it."""
    s = spec.seq_length
    for tp in (2, 4):
        whole = inv.activation_bytes_per_token(spec, tp=1, seq_length=s)
        assert inv.activation_bytes_per_token(spec, tp=tp, seq_length=s, sequence_parallel=True) == pytest.approx(
            whole / tp)
        assert inv.activation_bytes_per_token(spec, tp=tp, seq_length=s) > whole / tp


def test_recompute_keeps_what_korthikanti_counts():
    """GPT, Table 2 of Korthikanti et al.: selective keeps h (10 + 24/t) (34 h / t with SP); full keeps the
    layer input 2 h (2 h / t with SP)."""
    h, s = GPT.hidden_size, GPT.seq_length
    for tp in (1, 2, 8):
        sel = inv.activation_bytes_per_token(GPT, tp=tp, seq_length=s, recompute="selective")
        assert sel == pytest.approx(h * (10 + 24 / tp))
        assert inv.activation_bytes_per_token(GPT, tp=tp, seq_length=s, recompute="selective",
                                              sequence_parallel=True) == pytest.approx(34 * h / tp)
        assert inv.activation_bytes_per_token(GPT, tp=tp, seq_length=s, recompute="full") == 2 * h
        assert inv.activation_bytes_per_token(GPT, tp=tp, seq_length=s, recompute="full",
                                              sequence_parallel=True) == pytest.approx(2 * h / tp)
    with pytest.raises(ValueError, match="recompute must be one of none, selective, full, got 'ful'"):
        inv.activation_bytes_per_token(GPT, recompute="ful")


@pytest.mark.parametrize("spec", [GPT, LLAMA], ids=["gpt", "llama"])
def test_stage_cost_prices_recompute_and_sp(spec):
    """Defaults unchanged; full recompute adds one forward (FLOPs and all-reduces) to the backward and keeps less;
    selective adds the attention core; SP keeps the time and divides the activations."""
    cost = CostModel()
    base = stage_cost(spec, cost, tp=2, **STAGE)
    assert stage_cost(spec, cost, tp=2, recompute="none", sequence_parallel=False, **STAGE) == base
    full = stage_cost(spec, cost, tp=2, recompute="full", **STAGE)
    assert full.forward_s == base.forward_s
    assert full.backward_s == pytest.approx(base.backward_s + base.forward_s)
    assert full.memory_bytes < base.memory_bytes
    sel = stage_cost(spec, cost, tp=2, recompute="selective", **STAGE)
    tokens, sum_sq = 2 * spec.seq_length, 2 * spec.seq_length ** 2
    attention_s = 4 * sum_sq * inv.attention_flops_per_square_token(spec) / (cost.flops_per_s * 2 * 0.95)
    assert sel.backward_s == pytest.approx(base.backward_s + attention_s)
    assert inv.layer_recompute_flops(spec, tokens=tokens, sum_sq=sum_sq, recompute="full") == \
        inv.layer_forward_flops(spec, tokens=tokens, sum_sq=sum_sq)
    sp = stage_cost(spec, cost, tp=2, sequence_parallel=True, **STAGE)
    assert (sp.forward_s, sp.backward_s) == (base.forward_s, base.backward_s)
    static = stage_cost(spec, cost, tp=2, **{**STAGE, "in_flight": 0}).memory_bytes
    assert sp.memory_bytes - static == pytest.approx(
        2 * spec.seq_length * 4 * 3 * inv.activation_bytes_per_token(spec, tp=1, seq_length=spec.seq_length) / 2)
