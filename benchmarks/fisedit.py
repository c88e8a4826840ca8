"""FISEdit on CPU: MACs and end-to-end latency of an edit, dense vs FISEdit, on an SD-1.5-shaped UNet.

    python benchmarks/fisedit.py [--latent 64] [--ratios 2.5,5,10,20,40] [--steps 5 --dense-steps 1] [--repeats 3]

diffusers' UNet2DConditionModel with SD-1.5's shape (320/640/1280/1280 channels, 2 layers per block, 768-wide
text, 859.5 M parameters) and random weights (seed 0); DDIM; prompt embeddings random (1, 77, 768), the edit adds
noise to 4 of the 77 tokens. The mask is given (a centred square covering the mask ratio of the latent pixels),
so each ratio is exact; its active share per map size is printed.

MACs per edit use FISEdit's schedule, 50 steps of which the first 10 dense: dense = 50 x a dense step, sparse =
10 x dense + 40 x a sparse step, each step counted by torch's FLOP counter with attention added analytically
(torch counts 0 for SDPA on CPU). Target: dense/sparse-step MACs >= 0.8 / mask ratio for ratios >= 10%.

Latency: the same schedule scaled to --steps (default 5 steps, 1 dense: the same 1:4 share as 10:40, since a
50-step CPU run takes minutes per edit) timed end to end: a dense edit (the engine attached but idle: its
wrappers call the original modules) and a FISEdit edit (dense steps, mask, sparse steps), interleaved, median of
--repeats. Target: speedup >= 3x at 5%. Fidelity columns: max |FISEdit - dense edit| of the final latents inside
and outside the mask, over max |dense edit - original| there (how much of the edit's change is off).
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time

import torch


def square_mask(latent: int, ratio: float) -> torch.Tensor:
    side = max(1, round(latent * math.sqrt(ratio)))
    top = (latent - side) // 2
    mask = torch.zeros(latent, latent, dtype=torch.bool)
    mask[top:top + side, top:top + side] = True
    return mask


def build(latent: int, seed: int) -> torch.nn.Module:
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    return UNet2DConditionModel(sample_size=latent, cross_attention_dim=768).eval()


def rel_err(fis: torch.Tensor, dense: torch.Tensor, orig: torch.Tensor, where: torch.Tensor) -> float:
    change = (dense - orig).abs()[..., where].max()
    return float((fis - dense).abs()[..., where].max() / change.clamp_min(1e-12)) if where.any() else 0.0


def measure_ratio(engine, sched, unet, ratio: float, edited: torch.Tensor, original: torch.Tensor, loop: dict,
                  dense_step: int, args: argparse.Namespace) -> dict:
    """One table row: MACs of a sparse step, interleaved latency of both edits, fidelity; returns the JSON row."""
    from hetu_ext.diffusion.loop import denoise
    from hetu_ext.diffusion.macs import count_macs

    mask = square_mask(args.latent, ratio)
    edit_macs = count_macs(lambda: engine.edit(sched, prompt_embeds=edited, mask=mask, **loop))
    sparse_step = (edit_macs - args.dense_steps * dense_step) / (args.steps - args.dense_steps)
    times: dict[str, list[float]] = {"dense": [], "fisedit": []}
    outs: dict[str, torch.Tensor] = {}
    for _ in range(args.repeats):
        for kind in ("dense", "fisedit"):
            start = time.perf_counter()
            if kind == "dense":
                outs[kind] = denoise(unet, sched, prompt_embeds=edited, **loop)
            else:
                outs[kind] = engine.edit(sched, prompt_embeds=edited, mask=mask, **loop)
            times[kind].append(time.perf_counter() - start)
    dense_s, fis_s = statistics.median(times["dense"]), statistics.median(times["fisedit"])
    fractions = engine.active_fractions()
    shares = "/".join(f"{100 * fractions.get(f'{s}x{s}', 1.0):.0f}" for s in
                      (args.latent, args.latent // 2, args.latent // 4, args.latent // 8))
    row = {"latent": args.latent, "mask_ratio": ratio, "dense_macs": 50 * dense_step,
           "sparse_macs": int(10 * dense_step + 40 * sparse_step), "dense_s": round(dense_s, 3),
           "fisedit_s": round(fis_s, 3), "speedup": round(dense_s / fis_s, 3)}
    err_in = rel_err(outs["fisedit"], outs["dense"], original, mask)
    err_out = rel_err(outs["fisedit"], outs["dense"], original, ~mask)
    reduction = dense_step / max(sparse_step, 1)
    print(f"{100 * ratio:>6.1f} {shares:>26} {row['dense_macs'] / 1e9:>12.0f} {row['sparse_macs'] / 1e9:>13.0f} "
          f"{reduction:>10.1f}x {0.8 / ratio:>6.1f}x {dense_s:>8.2f} {fis_s:>9.2f} {row['speedup']:>7.2f}x "
          f"{err_in:>7.3f} {err_out:>8.3f}", flush=True)
    return row


def main() -> None:
    from diffusers import DDIMScheduler

    from hetu_ext.diffusion import FISEditConfig, FISEditEngine
    from hetu_ext.diffusion.macs import count_macs

    parser = argparse.ArgumentParser()
    parser.add_argument("--latent", type=int, default=64)
    parser.add_argument("--ratios", default="2.5,5,10,20,40", help="mask ratios in percent")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dense-steps", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--block-size", type=int, default=FISEditConfig().block_size)
    parser.add_argument("--conv-kernel", default=FISEditConfig().conv_kernel)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ratios = [float(r) / 100 for r in args.ratios.split(",")]
    import diffusers

    print(f"config: SD-1.5-shaped UNet (random weights, seed {args.seed}), latent {args.latent}x{args.latent}, "
          f"batch 1, no CFG, DDIM; latency schedule {args.steps} steps ({args.dense_steps} dense), MACs schedule "
          f"50 steps (10 dense); block {args.block_size}, conv kernel {args.conv_kernel}; repeats {args.repeats}; "
          f"threads {args.threads}; torch {torch.__version__}, diffusers {diffusers.__version__}, "
          f"{platform.processor() or platform.machine()}")
    unet = build(args.latent, args.seed)
    config = FISEditConfig(dense_steps=args.dense_steps, block_size=args.block_size, conv_kernel=args.conv_kernel,
                           stats_block_size=max(8, args.block_size))
    engine = FISEditEngine(unet, config)
    sched = DDIMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085,
                          beta_end=0.012, clip_sample=False, set_alpha_to_one=False)
    gen = torch.Generator().manual_seed(args.seed)
    latents = torch.randn(1, 4, args.latent, args.latent, generator=gen)
    prompt = torch.randn(1, 77, 768, generator=gen)
    edited = prompt.clone()
    edited[:, 5:9] += torch.randn(1, 4, 768, generator=gen)
    loop = dict(latents=latents, num_inference_steps=args.steps)
    start = time.perf_counter()
    original = engine.generate(sched, prompt_embeds=prompt, **loop)
    print(f"generation with caching: {time.perf_counter() - start:.1f} s, cache {engine.cache_bytes / 2**20:.1f} MiB "
          f"for {args.steps - args.dense_steps} sparse steps")

    sample = torch.randn(1, 4, args.latent, args.latent)
    dense_step = count_macs(lambda: unet(sample, 500, encoder_hidden_states=edited))
    sizes = "/".join(str(args.latent // f) for f in (1, 2, 4, 8))
    header = (f"{'mask%':>6} {f'active% ({sizes} maps)':>26} {'dense_GMACs':>12} {'sparse_GMACs':>13} "
              f"{'step_reduct':>11} {'target':>7} {'dense_s':>8} {'fisedit_s':>9} {'speedup':>8} "
              f"{'err_in':>7} {'err_out':>8}")
    print(header)
    rows = [measure_ratio(engine, sched, unet, ratio, edited, original, loop, dense_step, args)
            for ratio in ratios]
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
