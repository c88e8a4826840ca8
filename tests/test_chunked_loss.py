"""The loss over token chunks (hetu_ext/megatron/chunked_loss.py, ``--hetu-loss-chunk-tokens``) against
Megatron-core's whole-microbatch loss.

Reference: the same GPTModel (same weights, hetu_ext's layout-independent initialisation) with
``--hetu-loss-chunk-tokens 0``: its output layer over the whole microbatch and Megatron's vocab-parallel cross
entropy. Checked on one 2-rank launch: TP 1 with tied embeddings, TP 2 untied, TP 2 with sequence parallelism
(the chunk of each rank's slice gathers to positions spread over the sequence); chunks of 24 tokens, so the last
chunk is shorter. Tolerance 1e-6 relative to each tensor's largest magnitude, fp32: every token's loss is the same
arithmetic, the output weight's and the embedding's gradients are sums over chunks in another order (a few ulps).
A wrong label alignment or a missing TP reduction moves them by far more than 1e-3 (the shifted-labels control).
"""

from __future__ import annotations

import math

import pytest
import torch

from hetu_ext.testing.multiproc import run_ranks

CHUNK = 24
SEQ, BATCH, VOCAB = 64, 2, 1000
CASES = [(1, False, False), (2, False, True), (2, True, True)]
"""(TP, sequence parallelism, untied output layer)."""


def _step(tp: int, sp: bool, untie: bool, chunk: int, shift: int = 0) -> dict:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from hetu_ext.megatron.model import TrainingNumerics, build_gpt_stage, transformer_config
    from hetu_ext.megatron.weights import init_weights
    from hetu_ext.model import ModelSpec

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(5)
    spec = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                     vocab_size=VOCAB, seq_length=SEQ, swiglu=True, normalization="RMSNorm",
                     position_embedding_type="rope", add_bias_linear=False, untie_embeddings_and_output_weights=untie)
    numerics = TrainingNumerics(hidden_dropout=0.0, attention_dropout=0.0, sequence_parallel=sp,
                                loss_chunk_tokens=chunk)
    model = build_gpt_stage(spec, transformer_config(spec, numerics, tp=tp, pp=1, on_cpu=True),
                            pre_process=True, post_process=True)
    init_weights(model, seed=7, std=0.02, num_layers=2)
    calls = []
    model.output_layer.register_forward_hook(lambda *_: calls.append(1))
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.roll(tokens, -1 - shift, dims=1)
    position_ids = torch.arange(SEQ)[None].expand(BATCH, SEQ)
    loss = model(tokens, position_ids, None, labels=labels)  # (b, s)
    forward_calls = len(calls)
    (loss * torch.linspace(0.5, 1.5, SEQ)).sum().backward()
    backward_calls = len(calls) - forward_calls
    with torch.no_grad():
        model.eval()
        eval_loss = model(tokens, position_ids, None, labels=labels)
    return {"class": type(model).__name__, "loss": loss.detach(), "eval": eval_loss,
            "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None},
            "params": sum(1 for p in model.parameters() if p.requires_grad),
            "calls": (forward_calls, backward_calls)}


def _body(rank: int, world: int) -> dict:
    from hetu_ext.megatron.host import enable_cpu_support

    enable_cpu_support(True)
    out = {}
    for tp, sp, untie in CASES:
        out[(tp, sp, untie)] = {chunk: _step(tp, sp, untie, chunk) for chunk in (0, CHUNK)}
    out["shifted"] = _step(2, True, True, CHUNK, shift=1)
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_body, 2, timeout=300)


@pytest.mark.parametrize("case", CASES, ids=["tp1-tied", "tp2-untied", "tp2-sp"])
def test_chunked_loss_equals_the_whole_microbatch(ranks, case):
    """Per-token losses (training and evaluation) and every parameter's gradient of the chunked loss equal
    Megatron's whole-microbatch loss within 1e-6 on every rank; the chunked path ran (ChunkedLossGPTModel, one
    output-layer call per chunk forward and one more per chunk in backward: the recomputation)."""
    tp, sp, _ = case
    local = SEQ // tp if sp else SEQ
    chunks = math.ceil(local / CHUNK)
    for rank, got in enumerate(ranks):
        plain, chunked = got[case][0], got[case][CHUNK]
        assert (plain["class"], chunked["class"]) == ("GPTModel", "ChunkedLossGPTModel")
        assert plain["calls"] == (1, 0) and chunked["calls"] == (chunks, chunks), (rank, chunked["calls"])
        assert _rel(chunked["loss"], plain["loss"]) <= 1e-6
        assert _rel(chunked["eval"], plain["eval"]) <= 1e-6
        assert set(chunked["grads"]) == set(plain["grads"]) and len(plain["grads"]) == plain["params"]
        for name, grad in plain["grads"].items():
            assert _rel(chunked["grads"][name], grad) <= 1e-6, (rank, name, _rel(chunked["grads"][name], grad))


def test_shifted_labels_are_a_control(ranks):
    """Negative control: labels shifted by one token change the losses and the output layer's gradient by far
    more than the tolerance, so the comparison above can fail."""
    got, want = ranks[0]["shifted"], ranks[0][(2, True, True)][CHUNK]
    assert _rel(got["loss"], want["loss"]) > 1e-3
    assert _rel(got["grads"]["output_layer.weight"], want["grads"]["output_layer.weight"]) > 1e-3


def test_auto_chunks_only_microbatches_whose_logits_exceed_a_gib():
    """``--hetu-loss-chunk-tokens auto``: Megatron's path (0) while a microbatch's fp32 logits on the rank fit
    1 GiB (every CPU test; TinyLlama's vocabulary at 4K tokens), chunks of 1 GiB of logits above it (Llama 3's
    vocabulary at 8K tokens: 2,048 tokens; under TP 2 with sequence parallelism 2,048 of each rank's 4,096, which
    the output layer gathers to 4,096 over half the vocabulary); an explicit N at least the rank's tokens runs
    whole."""
    from hetu_ext.megatron.chunked_loss import parse_loss_chunk, resolve_chunk

    assert resolve_chunk("auto", 512, 2, 1024) == 0
    assert resolve_chunk("auto", 4096, 1, 32000) == 0
    assert resolve_chunk("auto", 8192, 1, 131072) == 2048
    assert resolve_chunk("auto", 4096, 1, 65536, gathered=2) == 2048
    assert resolve_chunk(24, 32, 1, 8) == 24 and resolve_chunk(64, 32, 1, 8) == 0 and resolve_chunk(0, 32, 1, 8) == 0
    assert parse_loss_chunk("auto") == "auto" and parse_loss_chunk("1024") == 1024
    for bad in ("-1", "x", "1.5"):
        with pytest.raises(ValueError, match="must be auto or a token count"):
            parse_loss_chunk(bad)
