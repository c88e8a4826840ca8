"""FISEdit's fidelity where it means something: single-object edits on the toy model (toy.py), measured against the
dense edit and the original, with the changed object's true region known from the generator.

    python -m hetu_ext.diffusion.fidelity [--model DIR] [--set tune|check] [--count 24] [--grid [--grid-price K]]

Per edit (source caption -> target caption, both held out from training; one object's colour or shape changes):

* ``mask_iou``: IoU of the automatic mask (latent grid) with the changed object's region (old or new object's
  pixels, at least half covered, at latent size);
* ``err_in``: ||FISEdit - dense edit|| / ||dense edit - original|| of the final latents inside the mask (how much
  of the edit's change FISEdit gets wrong there; 0 = the dense edit);
* ``err_out``: RMS(FISEdit - original) outside the mask / RMS(dense edit - original) inside it (how far FISEdit
  moves the rest of the image, per element, relative to the edit's size; 0 = the original);
* ``psnr_out``: PSNR (dB) of the decoded FISEdit image vs the decoded original outside the mask (mask upsampled to
  image size); ``psnr_in``: vs the decoded dense edit inside it. The edit decodes with the generation's GroupNorm
  statistics in the VAE decoder (FISEditConfig.decoder_stats, default "cached"), the original and the dense edit
  with their own, and the edit's image takes the original's pixels outside the mask (FISEditConfig.paste_outside,
  default on: then ``psnr_out`` is infinite by construction); ``psnr_out_fresh``: ``psnr_out`` with the edit's
  latents decoded by the VAE as it is, nothing pasted (what the decoder alone does outside the mask);
  ``psnr_out_margin``: the edit decoded with cached statistics, nothing pasted, outside the mask grown by one latent
  pixel (2 image pixels).

``--grid`` tunes the mask settings (dense steps, mask steps, threshold, smoothing, morphology) by median IoU from
the dense edit's and the generation's latents (the FISEdit mask is made from exactly those), without running FISEdit;
``--grid-price K`` then runs FISEdit with the K best of them and the K widest masks among those of median IoU >=
``--grid-min-iou`` and ranks them by median err_in (a mask that takes in the object's border trades IoU for err_in).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from hetu_ext.diffusion import toy
from hetu_ext.diffusion.config import FISEditConfig
from hetu_ext.diffusion.mask import dilate

TOY_MODEL = Path(__file__).resolve().parent / "toy_model"
"""The shipped toy pipeline (made by `python -m hetu_ext.diffusion.train_toy`, see its training.json)."""
STEPS = 50
GUIDANCE = 7.5


@dataclass
class EditFigures:
    source: str
    target: str
    mask_fraction: float
    mask_iou: float
    err_in: float
    err_out: float
    psnr_out: float
    psnr_in: float
    psnr_out_margin: float
    psnr_out_fresh: float
    dense_s: float
    fisedit_s: float
    mask_s: float


def latent_errors(fis: torch.Tensor, dense: torch.Tensor, orig: torch.Tensor, mask: torch.Tensor) -> tuple[float,
                                                                                                          float]:
    """(err_in, err_out) of final latents (1, C, h, w) for a (h, w) bool mask; see the module docstring."""
    inside, outside = mask.bool(), ~mask.bool()
    edit = (dense - orig)[..., inside]
    if not inside.any() or float(edit.norm()) == 0.0:
        return float("nan"), float("nan")
    err_in = float((fis - dense)[..., inside].norm() / edit.norm())
    rms_edit = float(edit.pow(2).mean().sqrt())
    err_out = float((fis - orig)[..., outside].pow(2).mean().sqrt()) / rms_edit if outside.any() else 0.0
    return err_in, err_out


@torch.no_grad()
def latent_footprint(vae, edit: toy.Edit) -> tuple[float, float, float]:
    """Where an edit changes the autoencoder's latents: the shares of the energy of (latents of the target's
    rendering - latents of the source's) in the changed object's region, in the ring one latent pixel around it,
    and beyond. A local autoencoder puts almost nothing beyond: then only the UNet can spread an edit."""
    images = torch.from_numpy(np.stack([toy.render(edit.source), toy.render(edit.target)])).permute(0, 3, 1, 2)
    encoded = vae.encode(images.to(vae.device, vae.dtype) * 2.0 - 1.0)
    latents = encoded.latents if hasattr(encoded, "latents") else encoded.latent_dist.mean
    energy = (latents[1] - latents[0]).float().pow(2).sum(0).cpu()
    region = torch.from_numpy(edit.region(energy.shape[-1]))
    near = dilate(region, 1)
    total = float(energy.sum())
    return (float(energy[region].sum()) / total, float(energy[near & ~region].sum()) / total,
            float(energy[~near].sum()) / total)


def image_mask(mask: torch.Tensor, size: int = toy.IMAGE) -> np.ndarray:
    """Latent-grid mask -> image-size bool array (each latent pixel covers a square of image pixels)."""
    scale = size // mask.shape[-1]
    return np.kron(mask.cpu().numpy().astype(np.uint8), np.ones((scale, scale), dtype=np.uint8)).astype(bool)


@torch.no_grad()
def decode(pipe, latents: torch.Tensor):
    """Final latents -> PIL image through the pipeline's VAE as it is (its own GroupNorm statistics)."""
    vae = pipe.pipe.vae
    sample = vae.decode(latents.to(vae.device, vae.dtype) / vae.config.scaling_factor).sample
    return pipe.pipe.image_processor.postprocess(sample, output_type="pil")[0]


def measure(pipe, edit: toy.Edit, *, steps: int = STEPS, guidance: float = GUIDANCE, seed: int = 0,
            dense_first: bool = True) -> EditFigures:
    """Generate the source caption (caching), then the FISEdit edit and the dense edit of the target caption in the
    given order (each timed end to end; the mask is made inside the FISEdit edit, its time also reported)."""
    source, target = edit.prompts
    original = pipe.generate(source, num_inference_steps=steps, guidance_scale=guidance, seed=seed)
    orig_latents = pipe.generated_latents
    runs = {}
    for kind in (("dense", "fisedit") if dense_first else ("fisedit", "dense")):
        start = time.perf_counter()
        runs[kind] = pipe.dense_edit(target) if kind == "dense" else pipe.edit(target)
        runs[kind + "_s"] = time.perf_counter() - start
    fis, dense = runs["fisedit"], runs["dense"]
    err_in, err_out = latent_errors(fis.latents, dense.latents, orig_latents, fis.mask)
    region = edit.region(fis.mask.shape[-1])
    mask = fis.mask.numpy()
    pixels = image_mask(fis.mask, np.asarray(original).shape[0])
    grown = dilate(fis.mask, 1)
    margin = image_mask(grown, np.asarray(original).shape[0])
    return EditFigures(source=source, target=target, mask_fraction=float(mask.mean()),
                       mask_iou=toy.mask_iou(mask, region), err_in=err_in, err_out=err_out,
                       psnr_out=toy.psnr(fis.image, original, ~pixels),
                       psnr_in=toy.psnr(fis.image, dense.image, pixels),
                       psnr_out_margin=toy.psnr(fis.decoded, original, ~margin),
                       psnr_out_fresh=toy.psnr(decode(pipe, fis.latents), original, ~pixels), dense_s=runs["dense_s"],
                       fisedit_s=runs["fisedit_s"], mask_s=pipe.engine.mask_seconds)


def summary(figures: list[EditFigures]) -> dict[str, float]:
    """Medians over edits (speed-up: median of the per-edit dense / FISEdit ratios). An undefined figure (an empty
    mask has no inside) counts as the worst: err_* +inf, psnr_* -inf."""
    def med(name: str) -> float:
        worst = float("-inf") if name.startswith("psnr") else float("inf")
        return float(statistics.median(worst if math.isnan(v := getattr(f, name)) else v for f in figures))

    out = {name: med(name) for name in ("mask_fraction", "mask_iou", "err_in", "err_out", "psnr_out", "psnr_in",
                                        "psnr_out_margin", "psnr_out_fresh", "dense_s", "fisedit_s", "mask_s")}
    out["speedup"] = float(statistics.median(f.dense_s / f.fisedit_s for f in figures))
    out["edits"] = len(figures)
    return out


def load(model: str | Path = TOY_MODEL, config: FISEditConfig | None = None):
    from hetu_ext.diffusion.pipeline import FISEditPipeline

    pipe = FISEditPipeline.from_pretrained(model, config)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# ---- tuning the mask settings by IoU (no FISEdit run needed) ---------------------------------------------------
def _trajectory(pipe, prompt: str, run: dict) -> list[torch.Tensor]:
    """Latents entering each UNet step (before CFG doubling) of the pipeline's loop, the engine idle."""
    inputs = [run["latents"].clone()]

    def keep(p, i, t, tensors):
        inputs.append(tensors["latents"].detach().clone())
        return {}

    pipe.pipe(prompt, output_type="latent", callback_on_step_end=keep, callback_on_step_end_tensor_inputs=["latents"],
              **run)
    return inputs[:-1]


def grid(pipe, edits: list[toy.Edit], *, steps: int = STEPS, guidance: float = GUIDANCE, seed: int = 0) -> list[dict]:
    """Median IoU of every mask setting over the edits, best first. The engine's mask for (dense_steps d, mask
    steps k) is made from the latents entering steps 1..k of the generation and of the edit; the edit's first d
    steps are dense, so they are the dense edit's."""
    from hetu_ext.diffusion.mask import difference_map, mask_from_difference

    dense_options, fractions = (5, 10, 15), (0.5, 1.0)
    thresholds = [("otsu", 0.5)] + [("fixed", v) for v in (0.1, 0.2, 0.3, 0.4, 0.5)]
    radii = list(itertools.product((0, 1), (0, 1), (0, 1), (0, 1)))  # smooth, close, open, dilate
    scores: dict[tuple, list[float]] = {}
    for edit in edits:
        source, target = edit.prompts
        pipe.generate(source, num_inference_steps=steps, guidance_scale=guidance, seed=seed)
        run = pipe.loop_settings
        gen, new = _trajectory(pipe, source, run), _trajectory(pipe, target, run)
        region = edit.region(gen[0].shape[-1])
        for d, frac in itertools.product(dense_options, fractions):
            k = max(1, round(d * frac))
            diff = difference_map(gen[1:k + 1], new[1:k + 1])
            for (kind, value), (smoothed, closed, opened, dilated) in itertools.product(thresholds, radii):
                mask = mask_from_difference(diff, threshold=kind, fixed_threshold=value, open_radius=opened,
                                            dilate_radius=dilated, smooth_radius=smoothed, close_radius=closed)
                key = (d, k, kind, value if kind == "fixed" else None, smoothed, closed, opened, dilated)
                scores.setdefault(key, []).append(toy.mask_iou(mask.numpy(), region))
    rows = [{"dense_steps": d, "mask_steps": k, "threshold": kind, "fixed_threshold": value, "smooth_radius": sm,
             "close_radius": c, "open_radius": o, "dilate_radius": r, "median_iou": statistics.median(v),
             "min_iou": min(v), "mean_iou": statistics.fmean(v)}
            for (d, k, kind, value, sm, c, o, r), v in scores.items()]
    return sorted(rows, key=lambda row: (-row["median_iou"], -row["mean_iou"], row["dense_steps"]))


MASK_KEYS = ("dense_steps", "mask_steps", "threshold", "fixed_threshold", "smooth_radius", "close_radius",
             "open_radius", "dilate_radius")


def price_settings(model: str | Path, rows: list[dict], edits: list[toy.Edit], *, min_iou: float, count: int,
                   steps: int = STEPS, guidance: float = GUIDANCE) -> list[dict]:
    """FISEdit run on `edits` with mask settings from `grid`'s rows whose median IoU is >= `min_iou`: the `count`
    best by IoU and the `count` that make the largest masks (lowest fixed threshold, then most closing and
    dilation: a mask that takes in the object's border recomputes more of what the edit changes). Each row gains
    the FISEdit medians (`summary`); sorted by median err_in. The defaults are the first row's settings."""
    able = [row for row in rows if row["median_iou"] >= min_iou]
    widest = sorted(able, key=lambda r: (r["fixed_threshold"] if r["threshold"] == "fixed" else 1.0,
                                         -r["close_radius"] - r["dilate_radius"], -r["median_iou"]))
    chosen: dict[tuple, dict] = {}
    for row in able[:count] + widest[:count]:
        chosen.setdefault(tuple(row[k] for k in MASK_KEYS), row)
    priced = []
    for row in chosen.values():
        settings = {k: row[k] for k in MASK_KEYS if row[k] is not None}
        pipe = load(model, FISEditConfig(**settings))
        figures = summary([measure(pipe, edit, steps=steps, guidance=guidance) for edit in edits])
        priced.append({**row, **{f"fisedit_{k}": v for k, v in figures.items()
                                 if k in ("mask_iou", "err_in", "err_out", "mask_fraction")}})
        print(json.dumps(priced[-1]), flush=True)
    return sorted(priced, key=lambda row: row["fisedit_err_in"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(TOY_MODEL))
    parser.add_argument("--set", choices=("tune", "check"), default="check")
    parser.add_argument("--count", type=int, default=24)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--guidance", type=float, default=GUIDANCE)
    parser.add_argument("--dense-steps", type=int, default=FISEditConfig().dense_steps)
    parser.add_argument("--mask-steps", type=int, default=None)
    parser.add_argument("--threshold", choices=("otsu", "fixed"), default=FISEditConfig().threshold)
    parser.add_argument("--fixed-threshold", type=float, default=FISEditConfig().fixed_threshold)
    parser.add_argument("--smooth-radius", type=int, default=FISEditConfig().smooth_radius)
    parser.add_argument("--close-radius", type=int, default=FISEditConfig().close_radius)
    parser.add_argument("--open-radius", type=int, default=FISEditConfig().open_radius)
    parser.add_argument("--dilate-radius", type=int, default=FISEditConfig().dilate_radius)
    parser.add_argument("--no-keep-outside", dest="keep_outside", action="store_false")
    parser.add_argument("--decoder-stats", choices=("cached", "fresh"), default=FISEditConfig().decoder_stats)
    parser.add_argument("--no-paste-outside", dest="paste_outside", action="store_false")
    parser.add_argument("--key-values", choices=("active", "cached"), default=FISEditConfig().key_values)
    parser.add_argument("--grid", action="store_true", help="tune mask settings by IoU instead")
    parser.add_argument("--grid-price", type=int, default=0, metavar="K",
                        help="with --grid: then run FISEdit with up to 2K settings of median IoU >= --grid-min-iou "
                             "(the K best by IoU, the K widest masks) and rank them by median err_in")
    parser.add_argument("--grid-min-iou", type=float, default=0.65)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    tune, check = toy.edit_sets(args.count)
    edits = tune if args.set == "tune" else check
    if args.grid:
        rows = grid(load(args.model), edits, steps=args.steps, guidance=args.guidance)
        for row in rows[:15]:
            print(json.dumps(row))
        if args.grid_price:
            print("priced (lowest median err_in first):")
            for row in price_settings(args.model, rows, edits, min_iou=args.grid_min_iou, count=args.grid_price,
                                      steps=args.steps, guidance=args.guidance):
                print(json.dumps(row))
        return 0
    config = FISEditConfig(dense_steps=args.dense_steps, mask_steps=args.mask_steps, threshold=args.threshold,
                           fixed_threshold=args.fixed_threshold, open_radius=args.open_radius,
                           smooth_radius=args.smooth_radius, close_radius=args.close_radius,
                           dilate_radius=args.dilate_radius, keep_outside=args.keep_outside,
                           decoder_stats=args.decoder_stats, paste_outside=args.paste_outside,
                           key_values=args.key_values)
    pipe = load(args.model, config)
    figures = []
    print(f"{'iou':>5} {'err_in':>7} {'err_out':>8} {'psnr_out':>8} {'psnr_in':>7} {'margin':>6} {'fresh':>6} "
          f"{'mask%':>6}  edit")
    for i, edit in enumerate(edits):
        f = measure(pipe, edit, steps=args.steps, guidance=args.guidance, dense_first=i % 2 == 0)
        figures.append(f)
        print(f"{f.mask_iou:>5.2f} {f.err_in:>7.3f} {f.err_out:>8.4f} {f.psnr_out:>8.1f} {f.psnr_in:>7.1f} "
              f"{f.psnr_out_margin:>6.1f} {f.psnr_out_fresh:>6.1f} "
              f"{100 * f.mask_fraction:>6.1f}  {f.source} -> {f.target}", flush=True)
    print(json.dumps({"config": asdict(config), "set": args.set, "summary": summary(figures)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
