"""Export to Hugging Face: a hetu checkpoint of Megatron-core's GPT, converted with
``python -m hetu_ext.checkpoint convert --to hf-gpt2``, loads into transformers' GPT2LMHeadModel and gives the
same logits as the Megatron model that saved it. Tolerance 1e-5 absolute on logits up to 0.65 (fp32; the two
implementations order their sums differently; measured 1.8e-7); exporting the fused QKV without reordering it
per head moved them by 0.2."""

from __future__ import annotations

import pytest
import torch
from test_ckpt_resume import SCHEDULE
from helpers import gpt_argv

from hetu_ext.checkpoint.cli import main
from hetu_ext.testing.multiproc import run_ranks


def logits_body(rank: int, world: int, argv: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    from hetu_ext.cli.args import parse_run_config
    from hetu_ext.cli.train import build_run

    trainer = build_run(parse_run_config(argv))
    trainer.train(log=lambda line: None)
    tokens = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(32).unsqueeze(0).expand(2, -1)
    trainer.model.eval()
    with torch.no_grad():
        logits = trainer.model(tokens, positions, None)
    return tokens, logits.detach().clone()


def test_export_to_hf_gpt2_gives_the_same_logits(sample_prefix, tmp_path):
    GPT2LMHeadModel = pytest.importorskip("transformers").GPT2LMHeadModel  # the [diffusion] extra installs it

    ckpt = tmp_path / "ckpt"
    tokens, want = run_ranks(logits_body, 1, gpt_argv(1, 1, sample_prefix, SCHEDULE + (
        "--train-iters", "2", "--save", str(ckpt))), timeout=120)[0]
    assert main(["convert", str(ckpt), str(tmp_path / "hf"), "--to", "hf-gpt2"]) == 0
    model = GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        got = model(input_ids=tokens).logits
    assert got.shape == want.shape
    assert float((got - want).abs().max()) <= 1e-5, float((got - want).abs().max())
