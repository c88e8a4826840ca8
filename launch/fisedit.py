"""Generate an image, edit its prompt, regenerate with FISEdit; writes original.png, edited.png and mask.png.

    python launch/fisedit.py --model DIR --prompt "a cat on a sofa" --edit "a dog on a sofa" [--out runs/fisedit]

DIR is a local StableDiffusionPipeline folder (save_pretrained layout); nothing is downloaded. The project's own
trained toy model is hetu_ext/diffusion/toy_model (32x32 images of coloured shapes; prompts name every quadrant:
"red circle top left and no object top right and no object bottom left and blue square bottom right"). Bad input
exits with code 2 and one `error:` line, before anything is written; the three PNGs appear together or not at all.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

from hetu_ext.diffusion.config import FISEditConfig  # no torch: the flags' defaults are the engine's

DEFAULTS = FISEditConfig()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="local StableDiffusionPipeline folder")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--edit", required=True, help="the edited prompt")
    parser.add_argument("--out", default="runs/fisedit", help="folder for original.png, edited.png, mask.png")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--dense-steps", type=int, default=DEFAULTS.dense_steps)
    parser.add_argument("--mask-steps", type=int, default=None)
    parser.add_argument("--guidance", type=float, default=7.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--mask", default=None, help="PNG whose non-black pixels are the region to edit")
    parser.add_argument("--threshold", choices=("otsu", "fixed"), default=DEFAULTS.threshold,
                        help="how the difference map becomes a mask (default: the engine's, tuned on the toy model)")
    parser.add_argument("--fixed-threshold", type=float, default=DEFAULTS.fixed_threshold)
    parser.add_argument("--smooth-radius", type=int, default=DEFAULTS.smooth_radius,
                        help="average the difference map over a (2r+1)^2 window before thresholding")
    parser.add_argument("--open-radius", type=int, default=DEFAULTS.open_radius, help="opening removes specks")
    parser.add_argument("--close-radius", type=int, default=DEFAULTS.close_radius, help="closing fills holes")
    parser.add_argument("--dilate-radius", type=int, default=DEFAULTS.dilate_radius,
                        help="grow the mask by this many latent pixels")
    parser.add_argument("--key-values", choices=("active", "cached"), default=DEFAULTS.key_values)
    parser.add_argument("--cache-budget-mib", type=float, default=None)
    parser.add_argument("--no-keep-outside", dest="keep_outside", action="store_false",
                        help="let the latents outside the mask drift with the dense steps (default: kept original)")
    parser.add_argument("--no-paste-outside", dest="paste_outside", action="store_false",
                        help="decode the whole edit (default: the original's pixels outside the mask, since the "
                             "VAE decoder is not local)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--fp16", action="store_true", help="half precision (GPU)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (one per denoising loop)")
    return parser.parse_args(argv)


def _load_mask(path: str) -> object:
    import numpy as np
    import torch
    from PIL import Image

    if not Path(path).is_file():
        raise ValueError(f"--mask {path}: no such file; give a PNG whose non-black pixels mark the edit region")
    array = np.asarray(Image.open(path).convert("L"))
    return torch.from_numpy(array > 0)


def _write_atomically(out: Path, images: dict[str, object]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    staged = {}
    with tempfile.TemporaryDirectory(dir=out, prefix=".fisedit-") as tmp:
        for name, image in images.items():
            staged[name] = Path(tmp) / name
            image.save(staged[name])
        for name, path in staged.items():
            os.replace(path, out / name)


def run(args: argparse.Namespace) -> dict[str, float]:
    import torch
    from PIL import Image

    from hetu_ext.diffusion.pipeline import FISEditPipeline, check_model_dir

    check_model_dir(args.model)
    budget = None if args.cache_budget_mib is None else int(args.cache_budget_mib * 2**20)
    config = FISEditConfig(dense_steps=args.dense_steps, mask_steps=args.mask_steps, threshold=args.threshold,
                           fixed_threshold=args.fixed_threshold, smooth_radius=args.smooth_radius,
                           open_radius=args.open_radius, close_radius=args.close_radius,
                           dilate_radius=args.dilate_radius, key_values=args.key_values,
                           cache_budget_bytes=budget, keep_outside=args.keep_outside,
                           paste_outside=args.paste_outside)
    mask = _load_mask(args.mask) if args.mask else None
    if args.steps <= args.dense_steps:
        raise ValueError(f"--steps {args.steps} <= --dense-steps {args.dense_steps} leaves no sparse step; "
                         "lower --dense-steps")
    print(f"loading the pipeline from {args.model} ...", flush=True)
    pipe = FISEditPipeline.from_pretrained(args.model, config, device=args.device,
                                           dtype=torch.float16 if args.fp16 else torch.float32)
    pipe.set_progress_bar_config(disable=args.no_progress)
    start = time.perf_counter()
    original = pipe.generate(args.prompt, num_inference_steps=args.steps, guidance_scale=args.guidance,
                             height=args.height, width=args.width, seed=args.seed)
    generate_s = time.perf_counter() - start
    start = time.perf_counter()
    result = pipe.edit(args.edit, mask=mask)
    edit_s = time.perf_counter() - start
    mask_png = Image.fromarray(result.mask.numpy().astype("uint8") * 255).resize(result.image.size, Image.NEAREST)
    _write_atomically(Path(args.out), {"original.png": original, "edited.png": result.image, "mask.png": mask_png})
    shares = ", ".join(f"{k} {100 * v:.1f}%" for k, v in result.active_fractions.items())
    print(f"generate {generate_s:.2f} s (dense, caching {pipe.engine.cache_bytes / 2**20:.1f} MiB); edit "
          f"{edit_s:.2f} s; mask {100 * float(result.mask.float().mean()):.1f}% of latent pixels; active {shares}")
    print(f"wrote {args.out}/original.png, edited.png, mask.png")
    return {"generate_s": generate_s, "edit_s": edit_s}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        run(args)
    except (ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
