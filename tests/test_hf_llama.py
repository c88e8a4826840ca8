"""Hugging Face Llama-family checkpoints in and out: tiny Llama, Mistral and Qwen2 models made locally with
transformers (random weights, ``save_pretrained``; nothing downloaded), imported with ``python -m
hetu_ext.checkpoint import-hf``, loaded through the reshard engine into Megatron-core's GPTModel under TP 2, and
compared with transformers' own forward: logits within 1e-5 (fp32; the two compute the same sums in other
orders). Exported back with ``convert --to hf-llama``, every tensor is identical to the original.

What this catches: q/k/v rows grouped the wrong way for GQA (logits off by O(1)), gate and up swapped, a bias of
Qwen2's qkv dropped, RoPE's pairing convention (interleaved vs halves), the norm epsilon.
"""

from __future__ import annotations

import pytest
import torch

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
    model.save_pretrained(str(tmp / "hf"))
    assert cli(["import-hf", str(tmp / "hf"), str(tmp / "hetu")]) == 0
    tokens = torch.randint(0, 1000, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(tokens).logits.float()
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
