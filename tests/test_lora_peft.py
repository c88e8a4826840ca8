"""Acceptance 2: each tenant's adapter exported in the PEFT format, loaded with ``peft`` onto the exported GPT-2,
gives Megatron-core's logits with that adapter (1e-5).

Trained 3 steps first, so every B factor is non-zero (B starts at zero: an untrained adapter would compare the
base with itself). fp32 on both sides; the differences are summation order only (measured: printed).
"""

from __future__ import annotations

import pytest
import torch
import yaml

from hetu_ext.testing.multiproc import run_ranks

pytest.importorskip("peft")

TENANTS = [
    {"name": "alpha", "lengths": {"mode": "distribution", "type": "lognormal", "min_seq_len": 4, "max_seq_len": 60,
                                  "mean_seq_len": 20, "lognormal_sigma": 0.6},
     "documents": 200, "samples": 4, "lora": {"rank": 4, "alpha": 8, "targets": ["qkv", "proj", "fc1", "fc2"]}},
    {"name": "beta", "lengths": {"mode": "distribution", "type": "lognormal", "min_seq_len": 4, "max_seq_len": 60,
                                 "mean_seq_len": 30, "lognormal_sigma": 0.6},
     "documents": 200, "samples": 3, "lora": {"rank": 2, "alpha": 6, "targets": ["qkv", "fc2"]}},
]
HEADS = 4


def export_body(rank: int, world_size: int, argv: list[str], out: str) -> dict | None:
    """Train, export the base (GPT-2) and each tenant's adapter (PEFT); Megatron's logits per tenant."""
    from hetu_ext.checkpoint.hf import write_gpt2
    from hetu_ext.lora.adapters import gather_adapters
    from hetu_ext.lora.install import routing_of
    from hetu_ext.lora.peft import write_peft
    from hetu_ext.cli.args import parse_run_config
    from hetu_ext.cli.train import build_run
    from hetu_ext.megatron.weights import gather_weights

    trainer = build_run(parse_run_config(argv))
    trainer.train(log=lambda line: None)
    base = gather_weights(trainer.model, **trainer.placement.shard_kwargs)
    params = {}
    for key, t in base.items():
        if key.startswith("decoder.layers."):
            params.update({(f"param/{key}", (i,)): t[i] for i in range(t.shape[0])})
        else:
            params[(f"param/{key}", ())] = t
    write_gpt2(f"{out}/gpt2", params, num_attention_heads=HEADS)
    adapters = gather_adapters(trainer.model)
    tokens = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(3))
    position_ids = torch.arange(40)[None]
    logits = {}
    trainer.model.eval()
    with torch.no_grad():
        for k, tenant in enumerate(trainer.plugin.tenants):
            write_peft(f"{out}/{tenant.name}", adapters, tenant, num_attention_heads=HEADS, base=f"{out}/gpt2")
            routing_of(trainer.model).set(torch.full_like(tokens, k))
            logits[tenant.name] = trainer.model(tokens, position_ids, None).float()
    return {"logits": logits, "tokens": tokens,
            "b_nonzero": all(float(v.abs().max()) > 0 for k, v in adapters.items() if ".lora_B." in k)}


def test_peft_round_trip_logits(tmp_path):
    from peft import PeftModel
    from transformers import GPT2LMHeadModel

    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(yaml.safe_dump({"tenants": TENANTS}))
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", str(HEADS), "--ffn-hidden-size",
            "64", "--seq-length", "64", "--micro-batch-size", "1", "--train-iters", "3", "--lr", "1e-2",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "5", "--hetu-lora-tenants", str(tenants)]
    result = run_ranks(export_body, 1, argv, str(tmp_path), timeout=240)[0]
    assert result["b_nonzero"]
    for name, expected in result["logits"].items():
        model = GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2", torch_dtype=torch.float32).eval()
        with torch.no_grad():
            base = model(result["tokens"]).logits
            peft = PeftModel.from_pretrained(model, tmp_path / name).eval()
            got = peft(input_ids=result["tokens"]).logits
        diff = float((got - expected).abs().max())
        print(f"{name}: max |logits diff| {diff:.2e} (adapter's effect {float((expected - base).abs().max()):.2e})")
        assert diff <= 1e-5, (name, diff)
        assert float((expected - base).abs().max()) > 1e-3  # the adapter changes the logits


LLAMA_SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "96",
               "--swiglu", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--position-embedding-type", "rope",
               "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
               "--untie-embeddings-and-output-weights", "--tokenizer-type", "NullTokenizer", "--vocab-size", "999"]
"""test_hf_llama's tiny Llama (1,000 ids: NullTokenizer's 999 + EOD) in Megatron-LM's flags."""


def llama_body(rank: int, world_size: int, argv: list[str]) -> dict:
    """Fine-tune tenants over the imported base (saving the adapters); Megatron's logits per tenant."""
    from hetu_ext.lora.install import routing_of
    from hetu_ext.cli.args import parse_run_config
    from hetu_ext.cli.train import build_run

    trainer = build_run(parse_run_config(argv))
    trainer.train(log=lambda line: None)
    tokens = torch.randint(0, 1000, (1, 40), generator=torch.Generator().manual_seed(3))
    logits = {}
    trainer.model.eval()
    with torch.no_grad():
        for k, tenant in enumerate(trainer.plugin.tenants):
            routing_of(trainer.model).set(torch.full_like(tokens, k))
            logits[tenant.name] = trainer.model(tokens, torch.arange(40)[None], None).float()[..., :1000]
    return {"logits": logits, "tokens": tokens}


def test_llama_peft_round_trip_logits(tmp_path):
    """Issue 32: tenants fine-tuned over an imported Hugging Face Llama (adapters on the grouped qkv, whose B rows
    split into q/k/v_proj, and on the gated fc1, whose B's gate axis splits into gate/up_proj, each sharing the
    fused A), saved, exported with ``export-peft`` (the model read from the checkpoint's recorded flags), loaded by
    peft onto transformers' model of the original directory: logits within 1e-5 of Megatron-core's."""
    from peft import PeftModel
    from test_hf_llama import _hf_model
    from transformers import LlamaForCausalLM

    from hetu_ext.checkpoint.cli import main as checkpoint_cli
    from hetu_ext.lora.checkpoint import export_peft

    _hf_model("llama").save_pretrained(str(tmp_path / "hf"))
    assert checkpoint_cli(["import-hf", str(tmp_path / "hf"), str(tmp_path / "base")]) == 0
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(yaml.safe_dump({"tenants": TENANTS}))
    argv = [*LLAMA_SHAPE, "--seq-length", "64", "--micro-batch-size", "1", "--train-iters", "3", "--lr", "1e-2",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "5", "--hetu-lora-tenants", str(tenants),
            "--pretrained-checkpoint", str(tmp_path / "base"), "--save", str(tmp_path / "adapters")]
    result = run_ranks(llama_body, 1, argv, timeout=240)[0]
    export_peft(str(tmp_path / "adapters"), str(tmp_path / "peft"), base=str(tmp_path / "hf"))
    for name, expected in result["logits"].items():
        model = LlamaForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
        with torch.no_grad():
            base = model(result["tokens"]).logits
            got = PeftModel.from_pretrained(model, tmp_path / "peft" / name).eval()(input_ids=result["tokens"]).logits
        diff = float((got - expected).abs().max())
        print(f"{name}: max |logits diff| {diff:.2e} (adapter's effect {float((expected - base).abs().max()):.2e})")
        assert diff <= 1e-5, (name, diff)
        assert float((expected - base).abs().max()) > 1e-3  # the trained adapter changes the logits
