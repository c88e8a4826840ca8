"""Hugging Face Llama-family checkpoints in and out: tiny Llama, Mistral and Qwen2 models made locally with
transformers (random weights, ``save_pretrained``; nothing downloaded), imported with ``python -m
hetu_ext.checkpoint import-hf``, loaded through the reshard engine into Megatron-core's GPTModel under TP 2 and
into the plan runtime's stages (a TP 2 x PP 2 pipeline beside a TP-1 one), and compared with transformers' own
forward: logits within 1e-5 (fp32; the two compute the same sums in other
orders). Exported back with ``convert --to hf-llama``, every tensor is identical to the original.

What this catches: q/k/v rows grouped the wrong way for GQA (logits off by O(1)), gate and up swapped, a bias of
Qwen2's qkv dropped, RoPE's pairing convention (interleaved vs halves), the norm epsilon.
"""

from __future__ import annotations

import pytest
import torch

from helpers import import_hf_model

from hetu_ext.checkpoint.cli import main as cli
from hetu_ext.testing.multiproc import run_ranks

ARCHS = ["llama", "mistral", "qwen2"]
SEQ = 16


def _hf_model(arch: str):
    import transformers

    common = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                  num_hidden_layers=2, vocab_size=1000, max_position_embeddings=64, tie_word_embeddings=False,
                  rms_norm_eps=1e-6)
    config = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
              "qwen2": transformers.Qwen2Config}[arch](**common)
    config.attn_implementation = "eager"
    torch.manual_seed(5)
    model = {"llama": transformers.LlamaForCausalLM, "mistral": transformers.MistralForCausalLM,
             "qwen2": transformers.Qwen2ForCausalLM}[arch](config).eval()
    with torch.no_grad():  # transformers initialises norms to 1 and biases to 0: make them matter
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture(scope="module", params=ARCHS)
def imported(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    model = _hf_model(request.param)
    tokens, logits = import_hf_model(model, tmp, SEQ)
    return tmp, tokens, logits, {k: v.clone() for k, v in model.state_dict().items()}


def _logits_body(rank: int, world: int, hf_dir: str, hetu_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    """The imported checkpoint loaded (reshard engine) into Megatron-core's GPTModel at TP ``world``; logits."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from hetu_ext.checkpoint import LocalStorage
    from hetu_ext.checkpoint.hf_llama import read_config, spec_from_hf
    from hetu_ext.checkpoint.load import load_pieces
    from hetu_ext.megatron.host import enable_cpu_support
    from hetu_ext.megatron.model import TrainingNumerics, build_gpt_stage, transformer_config
    from hetu_ext.megatron.state import state_pieces
    from hetu_ext.megatron_lm.checkpoint import GridPlacement

    enable_cpu_support(True)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    model_parallel_cuda_manual_seed(0)
    spec = spec_from_hf(read_config(hf_dir), seq_length=SEQ)
    numerics = TrainingNumerics(hidden_dropout=0.0, attention_dropout=0.0)
    model = build_gpt_stage(spec, transformer_config(spec, numerics, tp=world, pp=1, on_cpu=True),
                            pre_process=True, post_process=True).eval()
    load_pieces(LocalStorage(hetu_dir), state_pieces(GridPlacement(model=model, optimizer=None)))
    with torch.no_grad():
        local = model(tokens, torch.arange(SEQ).expand_as(tokens), None)  # (b, s, V_padded / tp)
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.contiguous())
    return torch.cat(parts, dim=-1)[..., :spec.vocab_size]


def test_imported_model_gives_transformers_logits(imported):
    tmp, tokens, want, _ = imported
    got = run_ranks(_logits_body, 2, str(tmp / "hf"), str(tmp / "hetu"), tokens, timeout=180)[0]
    diff = float((got - want).abs().max())
    print(f"max abs logit difference {diff:.2e} (logits up to {float(want.abs().max()):.2f})")
    assert got.shape == want.shape and diff <= 1e-5, diff


# a TP 2 x PP 2 pipeline beside a TP-1 one: a heterogeneous plan of the plan runtime (stage models with their own
# groups, layers numbered from each stage's offset, Megatron's schedule with the plan's point-to-point)
PLAN = ("pipelines: [{num_microbatches: 1, stages: [{ranks: [0, 1], layers: [0, 1]}, {ranks: [2, 3], layers: [1, 2]}]},"
        " {num_microbatches: 1, stages: [{ranks: [4], layers: [0, 2]}]}]")


def _plan_logits_body(rank: int, world: int, hf_dir: str, hetu_dir: str, tokens: torch.Tensor, plan_text: str):
    """The imported checkpoint loaded into every stage of ``plan_text`` (hetu_ext's trainer's placement and load
    path); each pipeline runs the tokens forward through Megatron's schedule; its last stage's TP rank 0 returns
    the logits (gathered over its TP group), the other ranks None."""
    import torch.distributed as dist
    import yaml

    from hetu_ext.checkpoint import LocalStorage
    from hetu_ext.checkpoint.hf_llama import read_config, spec_from_hf
    from hetu_ext.checkpoint.load import load_pieces
    from hetu_ext.config import TrainingConfig
    from hetu_ext.megatron.host import init_distributed
    from hetu_ext.megatron.model import TrainingNumerics
    from hetu_ext.megatron.plan_runtime import build_plan_placement
    from hetu_ext.megatron.state import state_pieces
    from hetu_ext.plan.core.io import plan_from_dict

    host = init_distributed(force_cpu=True)
    spec = spec_from_hf(read_config(hf_dir), seq_length=SEQ)
    plan = plan_from_dict(yaml.safe_load(plan_text))
    training = TrainingConfig(micro_batch_size=tokens.size(0), train_iters=1, lr=0.0)
    placement = build_plan_placement(training, spec, plan, host, TrainingNumerics(hidden_dropout=0.0,
                                     attention_dropout=0.0), with_optimizer=False)
    load_pieces(LocalStorage(hetu_dir), state_pieces(placement))
    positions = torch.arange(SEQ).expand_as(tokens)
    kept = {}

    def forward_step(data_iterator, model):
        output = model(tokens, positions, None)  # last stage: (b, s, V_padded / tp) logits

        def keep(out):
            kept["logits"] = out.detach()
            return out.sum() * 0, torch.tensor(1), {}
        return output, keep

    placement.model.eval()
    with torch.no_grad():
        placement.forward_backward(forward_step_func=forward_step, data_iterator=iter([None]),
                                   model=[placement.model], num_microbatches=1, seq_length=SEQ,
                                   micro_batch_size=tokens.size(0), forward_only=True, **placement.schedule_kwargs)
    if not placement.is_last_stage:
        return None
    tp = placement.schedule_kwargs["pg_collection"].tp
    parts = [torch.empty_like(kept["logits"]) for _ in range(tp.size())]
    dist.all_gather(parts, kept["logits"].contiguous(), group=tp)
    return torch.cat(parts, dim=-1)[..., :spec.vocab_size] if placement.tp_rank == 0 else None


def test_imported_model_runs_under_a_heterogeneous_plan(imported):
    """Issue 32's parity under TP 2 x PP 2 and a heterogeneous plan: every pipeline's logits (one TP 2 x PP 2,
    one TP 1) within 1e-5 of transformers'."""
    tmp, tokens, want, _ = imported
    results = run_ranks(_plan_logits_body, 5, str(tmp / "hf"), str(tmp / "hetu"), tokens, PLAN, timeout=240)
    logits = [r for r in results if r is not None]
    assert len(logits) == 2  # one per pipeline
    for got in logits:
        diff = float((got - want).abs().max())
        print(f"max abs logit difference {diff:.2e}")
        assert got.shape == want.shape and diff <= 1e-5, diff


def test_exported_model_is_the_original(imported):
    from safetensors.torch import load_file

    tmp, _, _, original = imported
    assert cli(["convert", str(tmp / "hetu"), str(tmp / "back"), "--to", "hf-llama"]) == 0
    back = load_file(str(tmp / "back" / "model.safetensors"))
    assert sorted(back) == sorted(original)
    assert all(torch.equal(back[k], original[k]) for k in original), [k for k in original
                                                                      if not torch.equal(back[k], original[k])]


def test_unmapped_architecture_is_one_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"architectures": ["GPTNeoXForCausalLM"]}')
    assert cli(["import-hf", str(tmp_path), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "GPTNeoXForCausalLM" in err[0] and "LlamaForCausalLM" in err[0], err


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_config_of_a_model_trained_here_is_the_same_model(arch, tmp_path):
    """``convert --to hf-llama`` of a model trained from scratch (no Hugging Face config recorded) writes the
    config of the model its flags describe: read back, it is the same model, and transformers builds from it a
    model whose tensors have the original's names and shapes. A setting neither architecture holds is refused."""
    import dataclasses

    import transformers

    from hetu_ext.checkpoint.hf_llama import hf_config_of, read_config, spec_from_hf
    from hetu_ext.checkpoint.manifest import CheckpointError

    original = _hf_model(arch)
    original.save_pretrained(str(tmp_path))
    spec = spec_from_hf(read_config(tmp_path))
    config = hf_config_of(spec)
    assert spec_from_hf(config) == spec
    built = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[arch](**config)
    model = getattr(transformers, config["architectures"][0])(built)
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in
                                                                   original.state_dict().items()}
    with pytest.raises(CheckpointError, match="--normalization LayerNorm"):
        hf_config_of(dataclasses.replace(spec, normalization="LayerNorm"))


def test_llama31_rope_scaling_is_mapped(tmp_path):
    """Llama 3.1's RoPE scaling (rope_type llama3) imports as --use-rope-scaling with its factor: logits within
    1e-5 of transformers' at TP 2. Not vacuous: the same weights without the scaling are measurably off (the
    long-wavelength frequencies are divided by the factor even at these short positions). Exported back, the
    config keeps the scaling."""
    import transformers

    from hetu_ext.checkpoint.hf_llama import hf_config_of, read_config, spec_from_hf

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    tiny = _hf_model("llama")
    base = {**tiny.config.to_dict(), "rope_theta": 500000.0, "rope_parameters": {"rope_type": "default",
                                                                                  "rope_theta": 500000.0}}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**base)).eval()  # Llama 3's base period
    model.load_state_dict(tiny.state_dict())
    config = transformers.LlamaConfig(**{**base, "rope_scaling": scaling,
                                         "rope_parameters": {**scaling, "rope_theta": 500000.0}})
    scaled = transformers.LlamaForCausalLM(config).eval()
    scaled.load_state_dict(model.state_dict())
    scaled.save_pretrained(str(tmp_path / "hf"))
    spec = spec_from_hf(read_config(tmp_path / "hf"))
    assert spec.rope_scaling and spec.rope_scaling_factor == 8.0 and spec.rotary_base == 500000
    assert spec_from_hf(hf_config_of(spec)) == spec
    assert cli(["import-hf", str(tmp_path / "hf"), str(tmp_path / "hetu")]) == 0
    tokens = torch.randint(0, 1000, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, unscaled = scaled(tokens).logits.float(), model(tokens).logits.float()
    got = run_ranks(_logits_body, 2, str(tmp_path / "hf"), str(tmp_path / "hetu"), tokens, timeout=180)[0]
    diff, effect = float((got - want).abs().max()), float((unscaled - want).abs().max())
    print(f"max abs logit difference {diff:.2e}; the scaling's effect {effect:.2e}")
    assert diff <= 1e-5 < effect, (diff, effect)
