"""FISEdit on a model that has learnt something (issue 18): the shipped toy text-to-image pipeline
(hetu_ext/diffusion/toy_model, made by `python -m hetu_ext.diffusion.train_toy`) follows its captions, and FISEdit's
single-object edits on it meet the fidelity bounds; training is reproducible from its seed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from hetu_ext.diffusion import toy  # noqa: E402
from hetu_ext.diffusion.fidelity import TOY_MODEL  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EDITS = 7
FOLLOW_SHARE = 0.9
needs_model = pytest.mark.skipif(not (TOY_MODEL / "model_index.json").is_file(),
                                 reason=f"no trained toy model at {TOY_MODEL}: make it with python -m "
                                        "hetu_ext.diffusion.train_toy --out hetu_ext/diffusion/toy_model")


def test_vocabulary_tokenizer_and_split(tmp_path: Path) -> None:
    """Every caption word is one token of the offline tokenizer; held-out captions are never trained on; the tune
    and check edit sets are disjoint, held out on both sides, and change exactly one object's colour or shape."""
    tokenizer = toy.write_tokenizer(tmp_path / "tok")
    ids = tokenizer("red circle top left and blue square bottom right").input_ids
    assert len(ids) == 2 + 9 and ids[0] == 0 and ids[-1] == 1
    assert toy.caption(((0, "red", "circle"), (3, "blue", "square"))) == (
        "red circle top left and no object top right and no object bottom left and blue square bottom right")
    data = toy.split()
    assert not set(data.train) & set(data.held_out) and len(data.held_out) > 2000
    tune, check = toy.edit_sets(24)
    assert len(tune) == len(check) == 24 and not {e.source for e in tune} & {e.source for e in check}
    held = set(data.held_out)
    for edit in tune + check:
        assert edit.source in held and edit.target in held
        changed = [(a, b) for a, b in zip(edit.source, edit.target, strict=True) if a != b]
        assert len(changed) == 1 and changed[0][0][0] == changed[0][1][0] == edit.cell
        assert edit.region(16).sum() >= 12
        source, target = (tokenizer(p, padding="max_length", max_length=toy.MAX_TOKENS).input_ids
                          for p in edit.prompts)
        assert len(source) == toy.MAX_TOKENS and sum(a != b for a, b in zip(source, target, strict=True)) == 1


@pytest.fixture(scope="module")
def toy_pipe():
    if not (TOY_MODEL / "model_index.json").is_file():
        pytest.skip(f"no trained toy model at {TOY_MODEL}")
    from hetu_ext.diffusion.fidelity import load

    return load(TOY_MODEL)


@needs_model
def test_toy_model_follows_held_out_captions() -> None:
    """Images generated for 12 captions never seen in training (2-3 objects each, 34 objects): where the caption
    puts an object, the palette colour nearest to the mean of that object's pixels is the named one (chance: 1 in 7
    with the background), and the quadrants the caption says have no object are empty; each for at least 90% of
    them (measured: 34/34 and 14/14)."""
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(str(TOY_MODEL), local_files_only=True, safety_checker=None,
                                                   requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    layouts = toy.split().held_out[::100][:12]
    images = pipe([toy.caption(lay) for lay in layouts], num_inference_steps=25, guidance_scale=7.5,
                  generator=torch.Generator().manual_seed(0)).images
    named, empty = [], []
    for layout, image in zip(layouts, images, strict=True):
        named += [toy.nearest_colour(image, cell, shape) == colour for cell, colour, shape in layout]
        empty += [toy.cell_is_empty(image, cell) for cell in set(range(4)) - {o[0] for o in layout}]
    print(f"named colour in the named quadrant: {sum(named)}/{len(named)}; unnamed quadrants empty: "
          f"{sum(empty)}/{len(empty)}")
    assert sum(named) >= FOLLOW_SHARE * len(named), (sum(named), len(named))
    assert sum(empty) >= FOLLOW_SHARE * len(empty), (sum(empty), len(empty))


def test_fisedit_on_held_out_edits(toy_pipe) -> None:
    """The first EDITS of the check set's held-out edits with the engine's defaults (50 steps, automatic mask),
    medians held to the issue's bounds: mask IoU with the changed object >= 0.6, err_in (FISEdit against the dense
    edit inside the mask, relative to the edit) <= 0.1, err_out (outside, against the original) <= 0.02, and the
    decoded image >= 35 dB PSNR against the original outside the mask, measured on the edit's latents decoded as they
    are (nothing pasted). Medians over the 24 of the check set: benchmarks/results/fisedit_toy.txt."""
    from hetu_ext.diffusion.fidelity import measure, summary

    _, check = toy.edit_sets(24)
    s = summary([measure(toy_pipe, edit) for edit in check[:EDITS]])
    print(s)
    assert s["mask_iou"] >= 0.6 and s["err_in"] <= 0.1 and s["err_out"] <= 0.02, s
    assert s["psnr_out_fresh"] >= 35.0 and s["psnr_out"] >= 35.0, s
    assert 0.0 < s["mask_fraction"] < 0.25, s


@needs_model
def test_shipped_autoencoder_is_local() -> None:
    """A one-object edit moves the shipped autoencoder's latents near the object only (what FISEdit's premise needs
    of the autoencoder): over 12 held-out edits of the check set, the median share of the latent change's energy
    more than one latent pixel away from the object is below 2% (measured 0.09%; the first toy model's
    AutoencoderKL, with GroupNorms: 13.5%)."""
    from diffusers import AutoencoderTiny

    from hetu_ext.diffusion.fidelity import latent_footprint

    vae = AutoencoderTiny.from_pretrained(str(TOY_MODEL / "vae"), local_files_only=True)
    _, check = toy.edit_sets(24)
    shares = np.array([latent_footprint(vae, edit) for edit in check[:12]])
    print("median energy share in the region, the ring, beyond:", np.median(shares, axis=0))
    assert np.median(shares[:, 2]) < 0.02 and np.median(shares[:, 0]) > 0.7, shares


@needs_model
def test_launcher_runs_on_the_shipped_model(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("fisedit_launch", ROOT / "launch" / "fisedit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "out"
    source = ((0, "red", "circle"), (3, "blue", "square"))
    code = module.main(["--model", str(TOY_MODEL), "--prompt", toy.caption(source),
                        "--edit", toy.caption(((0, "green", "circle"), source[1])), "--out", str(out),
                        "--steps", "20", "--dense-steps", "4", "--no-progress"])
    assert code == 0
    from PIL import Image

    mask = np.asarray(Image.open(out / "mask.png")) > 0
    assert mask[:16, :16].mean() > 0.2 and mask[16:, 16:].mean() == 0  # the edited circle's quadrant, not the square


def test_training_is_reproducible(tmp_path: Path) -> None:
    """A few steps of each stage twice with the same seed: the same weights' checksum; another seed: another one.
    (The shipped model's full run and its checksum are in its training.json.)"""
    from hetu_ext.diffusion.train_toy import parse_args, train

    sums = []
    for run, seed in (("a", 0), ("b", 0), ("c", 1)):
        args = parse_args(["--out", str(tmp_path / run), "--seed", str(seed), "--vae-steps", "2", "--unet-steps",
                           "2", "--layouts", "64", "--batch", "4", "--no-progress"])
        sums.append(train(args)["weights_sha256"])
    assert sums[0] == sums[1] != sums[2]
    from hetu_ext.diffusion.pipeline import check_model_dir

    check_model_dir(tmp_path / "a")  # a StableDiffusionPipeline folder FISEditPipeline.from_pretrained takes
    if (TOY_MODEL / "training.json").is_file():
        shipped = json.loads((TOY_MODEL / "training.json").read_text())
        assert len(shipped["weights_sha256"]) == 64 and shipped["args"]["seed"] == 0
