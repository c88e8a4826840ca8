"""The score-free core attention (hetu_ext/megatron/attention.py, flex_packs.py) against Megatron's own.

Reference: Megatron-core's ``DotProductAttention`` (baddbmm scores, fp32 softmax, bmm), built from the same
TransformerConfig. Shapes: every per-rank attention shape the gold tests run (hidden 32 or 64, 4 heads of 8 or 16,
MHA and GQA with 2 groups, TP 1 and 2 as per-rank heads 4/2 and groups 2/1, sequences of 32, 64 and 128,
microbatches of 1 and 2). Tolerance 1e-6 on fp32 outputs and query/key/value gradients, each relative to the
tensor's largest magnitude (0.5-5 here): the two compute the same softmax in another summation order (measured
1e-7 to 4e-7, i.e. a few float32 ulps; absolute 1.9e-6 on GQA's key gradients, sums over 2 heads of magnitude ~5);
a missing causal mask, a wrong scale or GQA group mapping moves them by > 1e-2 (the negative controls below).
"""

from __future__ import annotations

import pytest
import torch

from hetu_ext.testing.multiproc import run_ranks

# (s, b, heads, groups, head dim): per-rank shapes of the gold runs (tests/helpers.py's gpt_argv, packed_argv,
# LLAMA; test_llama_training's MEMORY_SPEC), TP 2 as half the heads and groups
GOLD_SHAPES = [(32, 2, 4, 4, 8), (32, 2, 2, 2, 8), (32, 2, 4, 2, 8), (32, 2, 2, 1, 8), (64, 1, 4, 4, 8),
               (64, 1, 4, 2, 8), (64, 1, 2, 1, 8), (128, 2, 4, 2, 16), (128, 2, 2, 1, 16), (128, 1, 4, 4, 16)]
TOL = 1e-6


def _config(heads: int, groups: int, head_dim: int, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    overrides = {"attention_dropout": 0.0, **overrides}
    return TransformerConfig(num_layers=2, hidden_size=heads * head_dim, num_attention_heads=heads,
                             num_query_groups=groups, kv_channels=head_dim,
                             masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
                             gradient_accumulation_fusion=False, bias_activation_fusion=False,
                             persist_layer_norm=False, **overrides)


def _pair(config, layer_number: int = 1):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from hetu_ext.megatron.attention import ScoreFreeAttention

    pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
    return tuple(cls(config, layer_number, AttnMaskType.causal, "self", pg_collection=pgs)
                 for cls in (DotProductAttention, ScoreFreeAttention))


def _inputs(s: int, b: int, heads: int, groups: int, head_dim: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(s, b, heads, head_dim, generator=gen)
    k, v = (torch.randn(s, b, groups, head_dim, generator=gen) for _ in range(2))
    return [x.requires_grad_() for x in (q, k, v)]


def _run(module, inputs, mask=None):
    for x in inputs:
        x.grad = None
    out = module(*inputs, mask)
    out.backward(torch.ones_like(out) / out.numel() ** 0.5 + torch.linspace(-1, 1, out.numel()).view_as(out))
    return out.detach(), [x.grad.clone() for x in inputs]


def _max_diff(a, b) -> float:
    """The largest difference of the outputs and of each input gradient, relative to that tensor's largest
    magnitude in ``a`` (the reference)."""
    (oa, ga), (ob, gb) = a, b
    return max(float((x - y).abs().max() / x.abs().max()) for x, y in zip((oa, *ga), (ob, *gb)))


def _equality_body(rank: int, world: int) -> dict:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from hetu_ext.megatron.host import enable_cpu_support

    enable_cpu_support(True)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(5)
    out = {}
    for shape in GOLD_SHAPES:
        s, b, heads, groups, d = shape
        megatron, sdpa = _pair(_config(heads, groups, d))
        inputs = _inputs(*shape)
        reference = _run(megatron, inputs)
        causal_mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)  # Megatron-LM's dataset mask: True = hidden
        out[shape] = {"none": _max_diff(reference, _run(sdpa, inputs)),
                      "mask": _max_diff(reference, _run(sdpa, inputs, causal_mask)),
                      "control": _max_diff(reference, _run(sdpa, inputs, torch.zeros_like(causal_mask)))}
    # query-key layer scaling (layer 3): Megatron divides the scale by 3 and its softmax multiplies it back
    config = _config(4, 2, 8, apply_query_key_layer_scaling=True)
    megatron, sdpa = _pair(config, layer_number=3)
    inputs = _inputs(32, 2, 4, 2, 8)
    out["qk_scaling"] = _max_diff(_run(megatron, inputs), _run(sdpa, inputs))
    # sliding-window attention: named, and computed by Megatron's path (equal bit for bit)
    megatron, sdpa = _pair(_config(4, 2, 8, window_size=(4, 0)))
    out["window_reason"] = sdpa.megatron_reason
    out["window"] = _max_diff(_run(megatron, inputs), _run(sdpa, inputs))
    parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def equality():
    return run_ranks(_equality_body, 1, timeout=240)[0]


def test_sdpa_equals_megatrons_dot_product_attention_on_the_gold_shapes(equality):
    """Outputs and query/key/value gradients within 1e-6 on every gold shape, with and without Megatron-LM's
    explicit causal mask; a mask that hides nothing (attention to the future) differs by > 1e-2."""
    for shape in GOLD_SHAPES:
        got = equality[shape]
        assert got["none"] <= TOL and got["mask"] <= TOL, (shape, got)
        assert got["control"] > 1e-2, (shape, got)


def test_query_key_layer_scaling_and_window_fallback(equality):
    """Query-key layer scaling is one net scale (1e-6); sliding-window attention is named as what needs
    Megatron's path, which then runs (bit-equal)."""
    assert equality["qk_scaling"] <= TOL
    assert equality["window_reason"].startswith("window_size")
    assert equality["window"] == 0.0


def _dropout_body(rank: int, world: int) -> dict:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from hetu_ext.megatron.host import enable_cpu_support

    enable_cpu_support(True)
    parallel_state.initialize_model_parallel()
    out = {}
    for p, shape in ((0.1, (32, 2, 4, 2, 8)), (0.5, (64, 1, 2, 1, 8))):
        megatron, sdpa = _pair(_config(*shape[2:], attention_dropout=p))
        inputs = _inputs(*shape)
        runs = {}
        for name, module in (("megatron", megatron), ("sdpa", sdpa)):
            model_parallel_cuda_manual_seed(11)  # the tracker's stream (and, on CPU, the default generator)
            runs[name] = _run(module, inputs)
        model_parallel_cuda_manual_seed(11)
        sdpa.eval()
        plain = _run(sdpa, inputs)
        out[p] = {"equal": _max_diff(runs["megatron"], runs["sdpa"]), "dropped": _max_diff(plain, runs["sdpa"])}
    parallel_state.destroy_model_parallel()
    return out


def test_dropout_draws_as_megatron_draws():
    """Dropout > 0 through SDPA's dropout_p (torch's math kernel on CPU) under Megatron's model-parallel RNG
    tracker: with the tracker seeded alike, output and gradients equal Megatron's DotProductAttention with its
    dropout (1e-6; on CPU both draw the same Bernoulli mask from the same stream), and differ from eval mode (no
    dropout) by > 1e-2. Catches dropout drawn from another generator, a missing 1 / (1 - p) and dropout in eval."""
    got = run_ranks(_dropout_body, 1, timeout=120)[0]
    for p, row in got.items():
        assert row["equal"] <= TOL and row["dropped"] > 1e-2, (p, row)


# ------------------------------------------------------------------------------------------- THD packs, flex


@pytest.mark.parametrize("lengths", [[5, 11, 1, 7], [300], [128, 128, 256], [1] * 40, [129, 1000, 60]])
def test_document_block_mask_equals_create_block_mask(lengths):
    """The block mask built from document boundaries (flex_packs.document_block_mask) equals, block for block
    (partial and full blocks) and element for element, what torch's create_block_mask evaluates from the
    document-causal mask_mod over the whole padded pack."""
    from torch.nn.attention.flex_attention import create_block_mask

    from hetu_ext.megatron import flex_packs

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    padded = flex_packs.shape_class(sum(lengths))
    docs = flex_packs.padded_document_ids(cu, padded)
    ours = flex_packs.document_block_mask(docs)

    def document_causal(b, h, q_idx, kv_idx):
        return (docs[q_idx] == docs[kv_idx]) & (q_idx >= kv_idx)

    torch_mask = create_block_mask(document_causal, B=None, H=None, Q_LEN=padded, KV_LEN=padded, device="cpu")
    assert torch.equal(ours.to_dense(), torch_mask.to_dense())
    for name in ("kv_num_blocks", "full_kv_num_blocks"):
        assert torch.equal(getattr(ours, name), getattr(torch_mask, name)), name


def test_packed_flex_equals_sdpa_per_document():
    """Flex over the padded pack with the cached block mask (eager on CPU; the same mask and call compiled on
    CUDA) equals SDPA per document within 1e-6, GQA included; the same layout reuses its mask."""
    from hetu_ext.megatron import flex_packs

    gen = torch.Generator().manual_seed(1)
    lengths = [5, 11, 1, 70, 30]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(lengths), 4, 8, generator=gen)
    k, v = (torch.randn(sum(lengths), 2, 8, generator=gen) for _ in range(2))
    got = flex_packs.packed_flex_attention(q, k, v, cu, scale=0.3, compiled=False)
    want = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        *(x[a:b].transpose(0, 1)[None] for x in (q, k, v)), is_causal=True, scale=0.3, enable_gqa=True)[0]
        .transpose(0, 1) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    assert float((got - want).abs().max() / want.abs().max()) <= TOL
    assert flex_packs.cached_block_mask(cu, 1024) is flex_packs.cached_block_mask(cu, 1024)
    assert [flex_packs.shape_class(t) for t in (1, 1024, 1025, 32768)] == [1024, 1024, 2048, 32768]


# --------------------------------------------------------------------------------------- the trainer's model


def _model_body(rank: int, world: int) -> dict:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from hetu_ext.megatron.activations import SavedTensorMeter
    from hetu_ext.megatron.attention import PackedDotProductAttention, ScoreFreeAttention
    from hetu_ext.megatron.host import enable_cpu_support
    from hetu_ext.megatron.model import TrainingNumerics, build_gpt_stage, transformer_config
    from hetu_ext.model import ModelSpec

    enable_cpu_support(True)
    parallel_state.initialize_model_parallel()
    out = {}
    for kind in ("sdpa", "megatron"):
        for s in (128, 256):
            model_parallel_cuda_manual_seed(3)
            torch.manual_seed(3)
            spec = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                             ffn_hidden_size=128, vocab_size=256, seq_length=s, swiglu=True, normalization="RMSNorm",
                             position_embedding_type="rope", add_bias_linear=False)
            numerics = TrainingNumerics(hidden_dropout=0.0, attention_dropout=0.0, attention=kind)
            model = build_gpt_stage(spec, transformer_config(spec, numerics, tp=1, pp=1, on_cpu=True),
                                    pre_process=True, post_process=True)
            core = model.decoder.layers[0].self_attention.core_attention
            out[(kind, "class")] = type(core).__name__
            tokens = torch.randint(0, 256, (1, s), generator=torch.Generator().manual_seed(0))
            meter = SavedTensorMeter(model)
            with meter.measuring():
                loss = model(tokens, torch.arange(s)[None], None, labels=tokens).sum()
            loss.backward()
            out[(kind, s)] = (float(loss), meter.peak / s)
    parallel_state.destroy_model_parallel()
    out["classes"] = (ScoreFreeAttention.__name__, PackedDotProductAttention.__name__)
    return out


def test_trainer_builds_sdpa_by_default_with_no_seq_term():
    """build_gpt_stage's default core attention is ScoreFreeAttention (``--hetu-attention megatron`` the local
    spec's); the Llama-style model's loss equals Megatron's path within 1e-6 relative; what autograd keeps per
    token stays within 5% from 128 to 256 tokens with SDPA, while Megatron's grows by the ``s x s`` scores."""
    got = run_ranks(_model_body, 1, timeout=180)[0]
    assert (got[("sdpa", "class")], got[("megatron", "class")]) == got["classes"]
    for s in (128, 256):
        (a, _), (b, _) = got[("sdpa", s)], got[("megatron", s)]
        assert abs(a - b) <= 1e-6 * abs(b), (s, a, b)
    sdpa_growth = got[("sdpa", 256)][1] / got[("sdpa", 128)][1]
    megatron_growth = got[("megatron", 256)][1] / got[("megatron", 128)][1]
    assert sdpa_growth < 1.05 < 1.2 < megatron_growth, (sdpa_growth, megatron_growth)


def test_memory_report_counts_scores_only_where_they_are_kept():
    """The first step's memory report (activations.keeps_scores) adds the inventory's ``5 a s`` scores term for
    Megatron's attention, and for SDPA only with dropout > 0 on CPU (torch's math kernel); with it the prediction
    grows with the sequence, without it the bytes per token are the same at 128 and 4096 tokens."""
    from hetu_ext.megatron.activations import keeps_scores, predicted_bytes
    from hetu_ext.megatron.model import TrainingNumerics
    from hetu_ext.model import ModelSpec
    from hetu_ext.plan import uniform_plan

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert keeps_scores(TrainingNumerics(attention="megatron", attention_dropout=0.0), cuda)
    assert not keeps_scores(TrainingNumerics(attention="sdpa", attention_dropout=0.0), cpu)
    assert keeps_scores(TrainingNumerics(attention="sdpa", attention_dropout=0.1), cpu)
    assert not keeps_scores(TrainingNumerics(attention="sdpa", attention_dropout=0.1), cuda)
    per_token = {}
    for s in (128, 4096):
        spec = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256, seq_length=s)
        plan = uniform_plan(world_size=1, tp=1, pp=1, num_layers=2, num_microbatches=1)
        for scores in (True, False):
            kept, _ = predicted_bytes(spec, plan, 0, micro_batch_size=1, half=True, recompute="none",
                                      sequence_parallel=False, attention_scores=scores)
            per_token[(s, scores)] = kept / s
    assert per_token[(128, False)] == per_token[(4096, False)]
    assert per_token[(4096, True)] > 2 * per_token[(128, True)]


def test_hetu_compile_is_refused_in_one_line_on_cpu():
    """--hetu-compile on a CPU run: torch.compile is disabled there, so the launcher prints one line naming the
    flag and the fix and exits 2 (no traceback), instead of silently running uncompiled."""
    from helpers import MODEL, assert_one_error_line, run

    proc = run([*MODEL, "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
                "--train-iters", "1", "--hetu-compile"], timeout=300)
    assert_one_error_line(proc, "--hetu-compile needs torch.compile")
