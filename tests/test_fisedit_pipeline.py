"""FISEdit with a full diffusers StableDiffusionPipeline loaded from a local folder (tiny random weights, a tiny
CLIP text model and a tokenizer built from a vocabulary written here: nothing is downloaded), and the launcher."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


def _tokenizer(folder: Path):
    from transformers import CLIPTokenizer

    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = {tok: i for i, tok in enumerate(["<|startoftext|>", "<|endoftext|>", *letters,
                                             *(f"{c}</w>" for c in letters)])}
    folder.mkdir(parents=True)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    return CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), model_max_length=16)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    root = tmp_path_factory.mktemp("tiny_sd")
    tokenizer = _tokenizer(root / "tok_src")
    torch.manual_seed(0)
    text = CLIPTextModel(CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=16,
                                        projection_dim=16, bos_token_id=0, eos_token_id=1, pad_token_id=1))
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), latent_channels=4,
                        norm_num_groups=4, layers_per_block=1, sample_size=32)
    unet = UNet2DConditionModel(sample_size=16, block_out_channels=(16, 32), layers_per_block=1,
                                down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=16,
                                attention_head_dim=4, norm_num_groups=8)
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=text, tokenizer=tokenizer, unet=unet,
                                   scheduler=DDIMScheduler(num_train_timesteps=1000), safety_checker=None,
                                   feature_extractor=None, requires_safety_checker=False)
    pipe.save_pretrained(root / "model")
    return root / "model"


def test_pipeline_generate_then_edit(model_dir: Path) -> None:
    """The pipeline's own loop under the engine: an edit with the same prompt and an empty mask reproduces the
    generated image pixel for pixel (the cache is complete and exact); a real edit changes the image, reports its
    automatic mask at latent size, and runs its sparse steps on part of each map."""
    from hetu_ext.diffusion import FISEditConfig
    from hetu_ext.diffusion.pipeline import FISEditPipeline

    config = FISEditConfig(dense_steps=2, min_sparse_size=4, stats_block_size=4, threshold="fixed",
                           fixed_threshold=0.6, open_radius=0, dilate_radius=0, max_active_fraction=1.0)
    pipe = FISEditPipeline.from_pretrained(model_dir, config)
    original = pipe.generate("a cat", num_inference_steps=5, guidance_scale=5.0)
    assert original.size == (32, 32) and pipe.engine.cache_bytes > 0
    same = pipe.edit("a cat", mask=torch.zeros(32, 32, dtype=torch.bool))
    assert np.array_equal(np.asarray(same.image), np.asarray(original))
    edited = pipe.edit("a dog")
    assert edited.mask.shape == (16, 16) and 0 < int(edited.mask.sum()) < 256, int(edited.mask.sum())
    assert 0 < min(edited.active_fractions.values()) < 1, edited.active_fractions
    assert not np.array_equal(np.asarray(edited.image), np.asarray(original))


def _launcher():
    spec = importlib.util.spec_from_file_location("fisedit_launch", ROOT / "launch" / "fisedit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_launcher_writes_three_pngs(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    code = _launcher().main(["--model", str(model_dir), "--prompt", "a cat", "--edit", "a dog", "--out", str(out),
                             "--steps", "4", "--dense-steps", "1", "--guidance", "1.0"])
    assert code == 0
    assert sorted(p.name for p in out.iterdir()) == ["edited.png", "mask.png", "original.png"]


def test_launcher_refuses_a_folder_without_weights(model_dir: Path, tmp_path: Path, capsys) -> None:
    """Exit code 2, one error line naming the missing weights and the fix, nothing written, nothing downloaded."""
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "model_index.json").write_text((model_dir / "model_index.json").read_text())
    out = tmp_path / "out"
    code = _launcher().main(["--model", str(empty), "--prompt", "a", "--edit", "b", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "no weights in unet/" in err and "save_pretrained" in err
    assert not out.exists()
