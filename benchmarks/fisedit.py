"""FISEdit on CPU: cost (MACs, latency) on an SD-1.5-shaped UNet with random weights, and fidelity with speed on the
toy model the project trained (hetu_ext/diffusion/toy_model), dense edit vs FISEdit.

    python -m benchmarks.fisedit [--latent 64] [--ratios 2.5,5,10,20,40] [--steps 5 --dense-steps 1] [--repeats 3]
                                 [--toy-edits 24] [--toy-model DIR] [--skip-sd] [--skip-toy]

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
pairs (--repeats >= 3), the order alternating (dense first in even pairs, FISEdit first in odd ones); the row's
times are medians, its speed-up the median of the pairs' ratios. The mask is given (each ratio exact), so the
automatic mask's computation (difference map of the dense steps' latents, Otsu, morphology: what the engine runs
when no mask is given) is timed on this edit's latents and added to FISEdit's time (column mask_s). Target:
speedup >= 3x at 5%. Random weights make every edit global, so the err columns here (max |FISEdit - dense edit|
of the final latents inside / outside the mask over max |dense edit - original| there) are cost-row diagnostics,
not fidelity.

Toy rows (fidelity): --toy-edits single-object edits of held-out captions (hetu_ext/diffusion/fidelity.py's check
set), 50 DDIM steps with the engine's defaults (10 dense, automatic mask), CFG 7.5, through the diffusers pipeline
(text encoder and VAE decode included), dense and FISEdit alternating per edit; medians of mask IoU with the changed
object's true region, err_in, err_out, PSNR outside the mask (psnr_out: the pipeline's image, which takes the
original's pixels outside the mask by default, so inf; psnr_margin: the edit decoded with the generation's GroupNorm
statistics, nothing pasted, outside the mask grown by one latent pixel; psnr_fresh: decoded by the VAE as it is,
nothing pasted); a second row with keep_outside off. In the JSON rows psnr_out null means infinite (identical
pixels); the other toy keys: mask_iou, err_in, err_out, psnr_out_margin, psnr_out_fresh_decoder.
A quiet-machine check prints the load average before and after. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time

import torch

from benchmarks.common import print_result

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


def load_check(when: str) -> tuple[float, float, float]:
    """Print the load average against the core count; a machine busier than half its cores gives noisy seconds."""
    load = os.getloadavg()
    cores = os.cpu_count() or 1
    verdict = "quiet" if load[0] <= 0.5 * cores else "BUSY: absolute seconds are noisy; ratios come from pairs"
    print(f"quiet-machine check ({when}): load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {cores} cores: "
          f"{verdict}", flush=True)
    return load


def timed_mask(engine, dense_inputs: list[torch.Tensor], device: torch.device) -> float:
    """Seconds the engine's automatic mask takes for this edit: the difference map of the latents entering the
    dense steps (generation's cache vs this edit's), Otsu's threshold and the morphology, default settings."""
    from hetu_ext.diffusion.mask import difference_map, mask_from_difference

    cfg = engine.config
    start = time.perf_counter()
    cached = [engine.state.cache.get(s, "latent", device) for s in range(1, cfg.k + 1)]
    diff = difference_map(cached, dense_inputs[1:cfg.k + 1])
    mask_from_difference(diff, threshold=cfg.threshold, fixed_threshold=cfg.fixed_threshold,
                         open_radius=cfg.open_radius, dilate_radius=cfg.dilate_radius, smooth_radius=cfg.smooth_radius,
                         close_radius=cfg.close_radius)
    return time.perf_counter() - start


def measure_ratio(engine, sched, unet, ratio: float, edited: torch.Tensor, original: torch.Tensor, loop: dict,
                  dense_step: int, args: argparse.Namespace) -> dict:
    """One table row: MACs of a sparse step, latency of both edits in pairs of alternating order, fidelity."""
    from hetu_ext.diffusion.loop import denoise
    from hetu_ext.diffusion.macs import count_macs

    mask = square_mask(args.latent, ratio)
    edit_macs = count_macs(lambda: engine.edit(sched, prompt_embeds=edited, mask=mask, **loop))
    sparse_step = (edit_macs - args.dense_steps * dense_step) / (args.steps - args.dense_steps)
    times: dict[str, list[float]] = {"dense": [], "fisedit": [], "mask": []}
    outs: dict[str, torch.Tensor] = {}
    for pair in range(args.repeats):
        for kind in (("dense", "fisedit") if pair % 2 == 0 else ("fisedit", "dense")):
            start = time.perf_counter()
            if kind == "dense":
                inputs = [loop["latents"]]
                outs[kind] = denoise(unet, sched, prompt_embeds=edited, step_end=lambda i, x: inputs.append(x) or x,
                                     **loop)
                times[kind].append(time.perf_counter() - start)
            else:
                outs[kind] = engine.edit(sched, prompt_embeds=edited, mask=mask, **loop)
                times[kind].append(time.perf_counter() - start)
        times["mask"].append(timed_mask(engine, inputs, loop["latents"].device))
    fis_times = [f + m for f, m in zip(times["fisedit"], times["mask"], strict=True)]
    dense_s, fis_s = statistics.median(times["dense"]), statistics.median(fis_times)
    mask_s = statistics.median(times["mask"])
    speedup = statistics.median(d / f for d, f in zip(times["dense"], fis_times, strict=True))
    fractions = engine.active_fractions()
    shares = "/".join(f"{100 * fractions.get(f'{s}x{s}', 1.0):.0f}" for s in
                      (args.latent, args.latent // 2, args.latent // 4, args.latent // 8))
    row = {"model": "sd15-shaped, random weights", "latent": args.latent, "mask_ratio": ratio,
           "dense_macs": 50 * dense_step, "sparse_macs": int(10 * dense_step + 40 * sparse_step),
           "dense_s": round(dense_s, 3), "fisedit_s": round(fis_s, 3), "speedup": round(speedup, 3),
           "mask_s": round(mask_s, 4)}
    err_in = rel_err(outs["fisedit"], outs["dense"], original, mask)
    err_out = rel_err(outs["fisedit"], outs["dense"], original, ~mask)
    reduction = dense_step / max(sparse_step, 1)
    print(f"{100 * ratio:>6.1f} {shares:>26} {row['dense_macs'] / 1e9:>12.0f} {row['sparse_macs'] / 1e9:>13.0f} "
          f"{reduction:>10.1f}x {0.8 / ratio:>6.1f}x {dense_s:>8.2f} {fis_s:>9.2f} {mask_s:>7.3f} "
          f"{row['speedup']:>7.2f}x {err_in:>7.3f} {err_out:>8.3f}   pairs d/f: "
          + " ".join(f"{d:.1f}/{f:.1f}" for d, f in zip(times["dense"], fis_times, strict=True)), flush=True)
    return row


def toy_rows(args: argparse.Namespace) -> list[dict]:
    """Fidelity and speed on the trained toy model: the check set's edits, engine defaults, keep_outside on/off."""
    from hetu_ext.diffusion import FISEditConfig, fidelity, toy
    from hetu_ext.diffusion.macs import count_macs

    _, check = toy.edit_sets(args.toy_edits)
    print(f"\ntoy model {args.toy_model}: {len(check)} held-out single-object edits, {fidelity.STEPS} DDIM steps "
          f"({FISEditConfig().dense_steps} dense), CFG {fidelity.GUIDANCE}, engine defaults, automatic masks; "
          "medians over edits")
    print(f"{'keep_outside':>12} {'mask%':>6} {'dense_MMACs':>12} {'sparse_MMACs':>13} {'dense_s':>8} "
          f"{'fisedit_s':>9} {'mask_s':>7} {'speedup':>8} {'mask_iou':>8} {'err_in':>7} {'err_out':>8} "
          f"{'psnr_out':>8} {'psnr_margin':>11} {'psnr_fresh':>10}")
    rows = []
    for keep in (True, False):
        pipe = fidelity.load(args.toy_model, FISEditConfig(keep_outside=keep))
        figures = [fidelity.measure(pipe, edit, dense_first=i % 2 == 0) for i, edit in enumerate(check)]
        edit = check[0]
        pipe.generate(edit.prompts[0], num_inference_steps=fidelity.STEPS, guidance_scale=fidelity.GUIDANCE)
        dense_macs = count_macs(lambda: pipe.dense_edit(edit.prompts[1]))
        sparse_macs = count_macs(lambda: pipe.edit(edit.prompts[1]))
        s = fidelity.summary(figures)
        row = {"model": "toy (trained)", "keep_outside": keep, "latent": 16, "mask_ratio": round(s["mask_fraction"], 4),
               "dense_macs": dense_macs, "sparse_macs": sparse_macs, "dense_s": round(s["dense_s"], 3),
               "fisedit_s": round(s["fisedit_s"], 3), "speedup": round(s["speedup"], 3),
               "mask_s": round(s["mask_s"], 4), "mask_iou": round(s["mask_iou"], 4), "err_in": round(s["err_in"], 4),
               "err_out": round(s["err_out"], 4),
               "psnr_out": round(s["psnr_out"], 2) if math.isfinite(s["psnr_out"]) else None,  # None: identical
               "psnr_out_margin": round(s["psnr_out_margin"], 2),
               "psnr_out_fresh_decoder": round(s["psnr_out_fresh"], 2), "edits": len(figures)}
        print(f"{str(keep):>12} {100 * row['mask_ratio']:>6.1f} {dense_macs / 1e6:>12.1f} {sparse_macs / 1e6:>13.1f} "
              f"{row['dense_s']:>8.3f} {row['fisedit_s']:>9.3f} {row['mask_s']:>7.4f} {row['speedup']:>7.2f}x "
              f"{row['mask_iou']:>8.3f} {row['err_in']:>7.3f} {row['err_out']:>8.4f} {s['psnr_out']:>8.1f} "
              f"{row['psnr_out_margin']:>11.1f} {row['psnr_out_fresh_decoder']:>10.1f}",
              flush=True)
        rows.append(row)
    print("  (MACs: the whole pipeline loop of the first edit, text encoder and VAE decode included)")
    return rows


def main() -> None:
    from hetu_ext.diffusion import FISEditConfig

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
    parser.add_argument("--toy-edits", type=int, default=24, help="held-out edits on the toy model (>= 20)")
    parser.add_argument("--toy-model", default=None, help="toy pipeline folder (default: the shipped one)")
    parser.add_argument("--skip-sd", action="store_true", help="no SD-shaped cost rows")
    parser.add_argument("--skip-toy", action="store_true", help="no toy-model rows")
    args = parser.parse_args()
    if args.repeats < 3:
        raise SystemExit(f"error: --repeats {args.repeats} < 3: each row is the median of >= 3 dense/FISEdit pairs")
    torch.set_num_threads(args.threads)
    if args.toy_model is None:
        from hetu_ext.diffusion.fidelity import TOY_MODEL

        args.toy_model = str(TOY_MODEL)
    load_check("start")
    rows = [] if args.skip_sd else sd_rows(args)
    if not args.skip_toy:
        rows += toy_rows(args)
    load_check("end")
    print_result({"rows": rows})


def sd_rows(args: argparse.Namespace) -> list[dict]:
    from diffusers import DDIMScheduler

    from hetu_ext.diffusion import FISEditConfig, FISEditEngine
    from hetu_ext.diffusion.macs import count_macs

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
              f"{'step_reduct':>11} {'target':>7} {'dense_s':>8} {'fisedit_s':>9} {'mask_s':>7} {'speedup':>8} "
              f"{'err_in':>7} {'err_out':>8}")
    print(header)
    rows = [measure_ratio(engine, sched, unet, ratio, edited, original, loop, dense_step, args)
            for ratio in ratios]
    engine.detach()
    return rows


if __name__ == "__main__":
    main()
