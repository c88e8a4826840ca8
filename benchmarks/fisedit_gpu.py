"""FISEdit on a GPU: fp16 SD-1.5-shaped UNet, 64x64 and 96x96 latents, end-to-end edit latency with CUDA events.

    python benchmarks/fisedit_gpu.py [--latents 64,96] [--ratios 2.5,5,10,20,40] [--steps 50 --dense-steps 10]

FISEdit's setting: 50 DDIM steps, the first 10 dense, classifier-free guidance 7.5 (UNet batch 2), random
weights (seed 0), a centred square mask of each ratio. Per latent size and ratio: a dense edit and a FISEdit edit,
interleaved, median of --repeats, timed by CUDA events around the whole loop (mask and cache prefetch included).
Sparse convolution kernels compared: "gemm" (block 1) and "conv" (window batches, block --conv-block); the faster
per row is reported. Target (paper, A100): >= 4.4x at its setting. `--tiny` runs a tiny UNet on CPU with
perf_counter timing to smoke-test the script without a GPU. Ends with one JSON line: the CPU benchmark's rows
without MACs (they do not depend on the device; benchmarks/fisedit.py counts them) plus "kernel".
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fisedit import square_mask  # noqa: E402


def build(latent: int, tiny: bool, device: str, dtype: torch.dtype) -> torch.nn.Module:
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    if tiny:
        unet = UNet2DConditionModel(sample_size=latent, block_out_channels=(32, 64), layers_per_block=1,
                                    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=768,
                                    attention_head_dim=8, norm_num_groups=8)
    else:
        unet = UNet2DConditionModel(sample_size=latent, cross_attention_dim=768)
    return unet.to(device=device, dtype=dtype).eval()


class Timer:
    """CUDA events on a GPU, perf_counter otherwise; seconds."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def __call__(self, fn) -> float:
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        begin.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return begin.elapsed_time(end) / 1000.0


def bench_latent(latent: int, args: argparse.Namespace, device: str, dtype: torch.dtype) -> list[dict]:
    from diffusers import DDIMScheduler

    from hetu_ext.diffusion import FISEditConfig, FISEditEngine
    from hetu_ext.diffusion.loop import denoise

    unet = build(latent, args.tiny, device, dtype)
    sched = DDIMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085,
                          beta_end=0.012, clip_sample=False, set_alpha_to_one=False)
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 4, latent, latent, generator=gen).to(device, dtype)
    prompt = torch.randn(1, 77, 768, generator=gen).to(device, dtype)
    negative = torch.randn(1, 77, 768, generator=gen).to(device, dtype)
    edited = prompt.clone()
    edited[:, 5:9] += torch.randn(1, 4, 768, generator=gen).to(device, dtype)
    loop = dict(latents=latents, negative_prompt_embeds=negative, num_inference_steps=args.steps,
                guidance_scale=7.5)
    timer = Timer(device == "cuda")
    engines = {"gemm": FISEditEngine(unet, FISEditConfig(dense_steps=args.dense_steps))}
    engines["gemm"].generate(sched, prompt_embeds=prompt, **loop)
    cache_mib = engines["gemm"].cache_bytes / 2**20
    engines["gemm"].detach()
    rows = []
    for ratio in args.ratios:
        mask = square_mask(latent, ratio).to(device)
        best: dict | None = None
        for kernel, block in (("gemm", 1), ("conv", args.conv_block)):
            config = FISEditConfig(dense_steps=args.dense_steps, conv_kernel=kernel, block_size=block,
                                   stats_block_size=max(8, block))
            engine = FISEditEngine(unet, config)
            with torch.no_grad():
                engine.generate(sched, prompt_embeds=prompt, **loop)
                engine.edit(sched, prompt_embeds=edited, mask=mask, **loop)  # warm-up
                times: dict[str, list[float]] = {"dense": [], "fisedit": []}
                run_dense = partial(denoise, unet, sched, prompt_embeds=edited, **loop)
                run_fisedit = partial(engine.edit, sched, prompt_embeds=edited, mask=mask, **loop)
                for _ in range(args.repeats):
                    times["dense"].append(timer(run_dense))
                    times["fisedit"].append(timer(run_fisedit))
            shares = engine.active_fractions()
            engine.detach()
            dense_s, fis_s = statistics.median(times["dense"]), statistics.median(times["fisedit"])
            row = {"latent": latent, "mask_ratio": ratio, "kernel": f"{kernel}/b{block}",
                   "dense_s": round(dense_s, 4), "fisedit_s": round(fis_s, 4), "speedup": round(dense_s / fis_s, 3)}
            print(f"{latent:>6} {100 * ratio:>6.1f} {row['kernel']:>8} {dense_s:>9.3f} {fis_s:>10.3f} "
                  f"{row['speedup']:>7.2f}x  active {', '.join(f'{k} {100 * v:.0f}%' for k, v in shares.items())}",
                  flush=True)
            if best is None or row["speedup"] > best["speedup"]:
                best = row
        rows.append(best)
    print(f"latent {latent}: cache {cache_mib:.0f} MiB on the host for {args.steps - args.dense_steps} sparse steps")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--latents", default="64,96")
    parser.add_argument("--ratios", default="2.5,5,10,20,40", help="mask ratios in percent")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--dense-steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--conv-block", type=int, default=8)
    parser.add_argument("--tiny", action="store_true", help="tiny UNet on CPU: a smoke test of this script")
    args = parser.parse_args()
    args.ratios = [float(r) / 100 for r in args.ratios.split(",")]
    cuda = torch.cuda.is_available() and not args.tiny
    if not cuda and not args.tiny:
        raise SystemExit("error: no CUDA device; run on a GPU, or pass --tiny for a CPU smoke test")
    device, dtype = ("cuda", torch.float16) if cuda else ("cpu", torch.float32)
    import diffusers

    name = torch.cuda.get_device_name() if cuda else "cpu (smoke test)"
    print(f"config: {'tiny' if args.tiny else 'SD-1.5-shaped'} UNet, random weights, {dtype}, {name}, steps "
          f"{args.steps} ({args.dense_steps} dense), CFG 7.5 (batch 2), repeats {args.repeats}; torch "
          f"{torch.__version__}, diffusers {diffusers.__version__}")
    print(f"{'latent':>6} {'mask%':>6} {'kernel':>8} {'dense_s':>9} {'fisedit_s':>10} {'speedup':>8}")
    rows = []
    for latent in (int(v) for v in args.latents.split(",")):
        rows += bench_latent(latent, args, device, dtype)
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
