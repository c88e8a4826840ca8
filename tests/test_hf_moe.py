"""Hugging Face Mixtral and Qwen2-MoE in and out (issue 49): tiny models made locally from transformers' config
classes (random weights, ``save_pretrained``; nothing downloaded), imported with ``python -m hetu_ext.checkpoint
import-hf``, loaded through the reshard engine into Megatron-core's GPTModel with MoE layers (one process, the local
spec: every expert its own MLP) and compared with transformers' own forward: logits within 1e-5 (fp32; the two
compute the same sums in other orders). Exported back with ``convert --to hf``, every tensor of the files
``save_pretrained`` wrote is identical.

What this catches (measured negative controls, Mixtral / Qwen2-MoE, max abs logit difference; the match is 1.8e-7):
an expert's gate and up projections swapped (7.7e-3 / 8.7e-3), two router rows swapped (5.7e-2 / 1.7e-2), the
other top-k normalisation (Mixtral's renormalised top-k against Qwen2-MoE's plain top-k, ``norm_topk_prob: false``,
Megatron-core's ``--moe-router-pre-softmax``: 4.9e-2 / 1.8e-2), Qwen2-MoE's shared-expert gate zeroed (3.4e-3).
"""

from __future__ import annotations

import pytest
import torch

from helpers import import_hf_model

from hetu_ext.checkpoint.cli import main as cli

ARCHS = ["mixtral", "qwen2_moe"]
SEQ = 16


def _hf_model(arch: str):
    import transformers

    common = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                  num_hidden_layers=2, vocab_size=1000, max_position_embeddings=64, tie_word_embeddings=False,
                  rms_norm_eps=1e-6, num_experts_per_tok=2)
    if arch == "mixtral":
        config = transformers.MixtralConfig(**common, num_local_experts=4)
    else:
        config = transformers.Qwen2MoeConfig(**common, num_experts=4, moe_intermediate_size=32,
                                             shared_expert_intermediate_size=80)
    config._attn_implementation = "eager"
    torch.manual_seed(5)
    model = (transformers.MixtralForCausalLM if arch == "mixtral" else transformers.Qwen2MoeForCausalLM)(config)
    with torch.no_grad():  # transformers initialises norms to 1 and biases to 0: make them matter
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


@pytest.fixture(scope="module", params=ARCHS)
def imported(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    model = _hf_model(request.param)
    tokens, logits = import_hf_model(model, tmp, SEQ)
    return tmp, tokens, logits


def test_imported_moe_model_gives_transformers_logits(imported):
    """The imported checkpoint in Megatron-core's GPTModel (its routing settings from the config: Qwen2-MoE's
    pre-softmax top-k) gives transformers' logits within 1e-5."""
    import dataclasses
    import sys
    from pathlib import Path

    from hetu_ext.checkpoint import LocalStorage
    from hetu_ext.checkpoint.hf_llama import read_config, spec_from_hf
    from hetu_ext.checkpoint.load import load_pieces
    from hetu_ext.megatron.state import state_pieces
    from hetu_ext.megatron_lm.checkpoint import GridPlacement

    sys.path.insert(0, str(Path(__file__).parent))
    from test_inventory import _megatron_model

    tmp, tokens, want = imported
    spec = dataclasses.replace(spec_from_hf(read_config(tmp / "hf"), seq_length=SEQ))
    model = _megatron_model(spec).eval()
    load_pieces(LocalStorage(tmp / "hetu"), state_pieces(GridPlacement(model=model, optimizer=None)))
    with torch.no_grad():
        got = model(tokens, torch.arange(SEQ).expand_as(tokens), None)[..., :spec.vocab_size]
    diff = float((got - want).abs().max())
    print(f"max abs logit difference {diff:.2e} (logits up to {float(want.abs().max()):.2f})")
    assert got.shape == want.shape and diff <= 1e-5, diff


def test_exported_moe_model_is_the_original(imported):
    """``convert --to hf`` writes every tensor ``save_pretrained`` wrote (the router, each expert's three
    projections, Qwen2-MoE's shared expert and gate), bit for bit, and the imported config."""
    import json

    from safetensors.torch import load_file

    tmp, _, _ = imported
    assert cli(["convert", str(tmp / "hetu"), str(tmp / "back"), "--to", "hf"]) == 0
    original, back = load_file(str(tmp / "hf" / "model.safetensors")), load_file(str(tmp / "back" / "model.safetensors"))
    assert sorted(back) == sorted(original)
    assert [k for k in original if not torch.equal(back[k], original[k])] == []
    assert json.loads((tmp / "back" / "config.json").read_text())["architectures"] == \
        json.loads((tmp / "hf" / "config.json").read_text())["architectures"]


def test_unmapped_moe_settings_are_one_line(tmp_path, capsys):
    """Qwen2-MoE with dense layers between its MoE ones, Mixtral with router jitter: refused by name, exit 2."""
    import json

    for config, needle in (({"architectures": ["Qwen2MoeForCausalLM"], "mlp_only_layers": [1]}, "mlp_only_layers"),
                           ({"architectures": ["MixtralForCausalLM"], "router_jitter_noise": 0.1},
                            "router_jitter_noise")):
        (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8, "num_attention_heads": 2, **config}))
        assert cli(["import-hf", str(tmp_path), str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err
