"""``plan predict`` of MoE runs (issue 49, pure): the FLOPs Megatron-LM counts are the active experts' (the
inventory's, which test_inventory checks against FlopCounterMode on Megatron-core's MoE layers), the all-to-all is
its own term, and the planners refuse MoE by name."""

from __future__ import annotations

import dataclasses

import pytest

from hetu_ext.model import ModelSpec
from hetu_ext.model import inventory as inv
from hetu_ext.plan.cost import moe_step, step_model
from hetu_ext.plan.cost.devices import load_device
from hetu_ext.plan.cli import main

MIXTRAL = ModelSpec(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                    num_query_groups=8, swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
                    add_bias_linear=False, untie_embeddings_and_output_weights=True, seq_length=4096,
                    max_position_embeddings=4096, vocab_size=32000, num_experts=8, moe_router_topk=2)
"""Mixtral 8x7B (Megatron-LM's example's model: 46.7 B parameters, 12.9 B active)."""
RUN = step_model.Parallel(pp=4, dp=16, micro_batch_size=1, global_batch_size=256, distributed_optimizer=True,
                          overlap_grad_reduce=True, ep=8)
"""The example's layout on 64 GPUs: PP 4, EP 8 (over the 16 data-parallel ranks of a stage)."""
H100 = load_device("h100-sxm")


def test_mixtral_counts():
    assert round(inv.param_count(MIXTRAL) / 1e9, 1) == 46.7
    assert round(inv.active_param_count(MIXTRAL) / 1e9, 1) == 12.9


def test_flops_are_the_active_experts():
    """Megatron's count (TFLOP/s x step x GPUs) is the inventory's MoE FLOPs per token (router, top-2 experts,
    attention, output layer) times the global batch's tokens: not the dense model's of the same width."""
    r = step_model.predict(MIXTRAL, RUN, H100)
    counted = r.tflops_per_gpu * 1e12 * r.step_s * RUN.gpus
    tokens = RUN.global_batch_size * MIXTRAL.seq_length
    assert counted == pytest.approx(tokens * inv.training_flops_per_token(MIXTRAL, seq_length=MIXTRAL.seq_length),
                                    rel=1e-9)
    every_expert = dataclasses.replace(MIXTRAL, moe_router_topk=8)
    assert counted < 0.5 * tokens * inv.training_flops_per_token(every_expert, seq_length=MIXTRAL.seq_length)


def test_all_to_all_is_its_own_term():
    """EP 1 moves no tokens; EP 8 within a node: 4 all-to-alls per MoE layer and microbatch (dispatch and combine,
    forward and backward), each the 7/8 of the rank's T x topk x h bf16 values that leave it, at NVLink's bandwidth;
    across nodes (TP 2 x EP 8 > 8 GPUs) slower."""
    one = step_model.predict(MIXTRAL, dataclasses.replace(RUN, ep=1), H100)
    assert one.parts["ep_comm"] == 0.0
    r = step_model.predict(MIXTRAL, RUN, H100)
    bw, latency = H100.link(8, spans_nodes=False)
    each = 7 / 8 * MIXTRAL.seq_length * 2 * MIXTRAL.hidden_size * 2 / bw + latency
    assert moe_step.all_to_all_s(MIXTRAL, H100, RUN) == pytest.approx(each)
    assert r.parts["ep_comm"] == pytest.approx(RUN.microbatches * 8 * 4 * each)
    across = dataclasses.replace(RUN, tp=2, dp=8, sequence_parallel=True)
    assert moe_step.all_to_all_s(MIXTRAL, H100, across) > moe_step.all_to_all_s(MIXTRAL, H100, RUN) / 2
    # more experts per rank (EP 2) hold more parameters: more memory per GPU
    assert step_model.predict(MIXTRAL, dataclasses.replace(RUN, ep=2), H100).memory_bytes > r.memory_bytes


def test_one_expert_is_the_dense_model_plus_its_router():
    """E = 1, top-1, the expert as wide as the dense MLP: the same GEMMs, parameters and step but the router's
    (2 h per token) and its (1, h) weight."""
    spec = dataclasses.replace(MIXTRAL, num_experts=1, moe_router_topk=1)
    dense = dataclasses.replace(MIXTRAL, num_experts=None, moe_ffn_hidden_size=None, moe_router_topk=2)
    par = dataclasses.replace(RUN, ep=1)
    moe, plain = step_model.predict(spec, par, H100), step_model.predict(dense, par, H100)
    assert moe.step_s == pytest.approx(plain.step_s, rel=2e-3) and moe.step_s > plain.step_s
    assert moe.memory_bytes == pytest.approx(plain.memory_bytes, rel=1e-4)


@pytest.mark.parametrize("flags, needle", [
    (["--num-experts", "8", "--expert-model-parallel-size", "3"], "must divide --num-experts 8"),
    (["--expert-model-parallel-size", "2"], "need an MoE model"),
    (["--moe-ffn-hidden-size", "64"], "needs --num-experts"),
])
def test_bad_moe_input_is_one_line(flags, needle, capsys):
    base = ["predict", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--gpus", "8"]
    assert main(base + flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_predict_prints_the_moe_run_and_planners_refuse_moe(capsys):
    flags = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--num-experts", "4",
             "--expert-model-parallel-size", "2", "--gpus", "4"]
    assert main(["predict", *flags]) == 0
    out = capsys.readouterr().out
    assert "ep_comm" in out.splitlines()[-1]
    for planner in ("malleus", "lobra", "hydraulis"):
        assert main([planner, "--num-experts", "4"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--num-experts" in err[0] and "dense models only" in err[0], err
