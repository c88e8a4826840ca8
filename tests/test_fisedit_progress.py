"""FISEdit's denoising loops show a tqdm progress bar each, as diffusers' pipelines do (issue 12, item 12): the
launcher's generation and edit were ~100 s of silence on a CPU (the pipeline switched diffusers' bar off)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from test_fisedit_pipeline import model_dir  # noqa: F401  (the tiny local StableDiffusionPipeline)


def test_generate_and_edit_each_show_a_progress_bar(model_dir: Path, capfd) -> None:  # noqa: F811
    from hetu_ext.diffusion import FISEditConfig
    from hetu_ext.diffusion.pipeline import FISEditPipeline

    pipe = FISEditPipeline.from_pretrained(model_dir, FISEditConfig(dense_steps=1, min_sparse_size=4,
                                                                    stats_block_size=4))
    capfd.readouterr()
    pipe.generate("a cat", num_inference_steps=3, guidance_scale=1.0)
    err = capfd.readouterr().err
    assert "FISEdit generate" in err and "3/3" in err, err
    pipe.edit("a dog", mask=None)
    err = capfd.readouterr().err
    assert "FISEdit edit" in err and "3/3" in err and "generate" not in err, err
    pipe.set_progress_bar_config(disable=True)
    pipe.edit("a dog")
    assert "FISEdit" not in capfd.readouterr().err


def test_unet_level_loop_takes_a_progress_bar(capfd) -> None:
    import torch
    from diffusers import DDIMScheduler

    from hetu_ext.diffusion.loop import denoise

    def unet(x, t, encoder_hidden_states):  # a stand-in UNet: predicts zero noise
        return type("Out", (), {"sample": torch.zeros_like(x)})()

    kwargs = {"latents": torch.randn(1, 4, 8, 8), "prompt_embeds": torch.randn(1, 2, 8), "num_inference_steps": 4}
    denoise(unet, DDIMScheduler(num_train_timesteps=1000), **kwargs)
    assert "4/4" not in capfd.readouterr().err  # no bar unless asked
    denoise(unet, DDIMScheduler(num_train_timesteps=1000), **kwargs, progress_bar={"desc": "edit"})
    err = capfd.readouterr().err
    assert "edit" in err and "4/4" in err, err
