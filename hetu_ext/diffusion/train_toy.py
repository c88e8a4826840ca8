"""Train the toy text-to-image model (hetu_ext/diffusion/toy.py's world) on CPU and save it as a diffusers
StableDiffusionPipeline folder that `FISEditPipeline.from_pretrained(DIR)` loads.

    python -m hetu_ext.diffusion.train_toy --out DIR [--seed 0] [--vae-steps 600] [--unet-steps 1500] [--threads 1]

Three stages, seeded, one progress bar each: (1) the autoencoder (diffusers' AutoencoderTiny, 32x32x3 <-> 16x16x4)
learns to reconstruct rendered training images (MSE); its latent scaling factor is set to 1 / std of the training
latents; (2) every training layout is encoded; (3) the CLIP text encoder and the UNet learn
epsilon-prediction under Stable Diffusion's noise schedule (scaled linear, 1000 steps; Min-SNR-5 loss weights),
10% of captions dropped to "" so classifier-free guidance works. The 10% held-out 2- and 3-object captions
(toy.split) are never shown.
The UNet's learning rate is constant after a 50-step warm-up and the weights saved are a moving average, so
`--save-every N` checkpoints are the models of shorter runs. Writes DIR/training.json (arguments as a command,
versions, losses, seconds, the weights' SHA-256) and prints the checksum: the same seed, step counts, threads and
torch build give the same checksum.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch


def weights_checksum(*modules: torch.nn.Module) -> str:
    """SHA-256 over every parameter and buffer of the modules (names and bytes, in order)."""
    digest = hashlib.sha256()
    for module in modules:
        for name, tensor in module.state_dict().items():
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _lr(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def _images(layouts, toy) -> torch.Tensor:
    """(N, 3, H, W) in [-1, 1]."""
    return torch.from_numpy(np.stack([toy.render(lay) for lay in layouts])).permute(0, 3, 1, 2) * 2.0 - 1.0


def _bar(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, mininterval=2.0)


def train_vae(vae, layouts, toy, args, rng: random.Random) -> list[float]:
    opt = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr, weight_decay=0.0)
    losses = []
    vae.train()
    with _bar(args.vae_steps, "VAE", args.progress) as bar:
        for step in range(args.vae_steps):
            for group in opt.param_groups:
                group["lr"] = _lr(step, args.vae_steps, args.vae_lr, 20)
            x = _images(rng.choices(layouts, k=args.batch), toy)
            loss = torch.nn.functional.mse_loss(vae.decode(vae.encode(x).latents).sample, x)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            bar.set_postfix(loss=f"{np.mean(losses[-20:]):.4f}")
            bar.update()
    vae.eval()
    return losses


@torch.no_grad()
def encode_all(vae, layouts, toy, args) -> torch.Tensor:
    out = []
    with _bar(len(layouts), "encode", args.progress) as bar:
        for start in range(0, len(layouts), 256):
            chunk = layouts[start:start + 256]
            out.append(vae.encode(_images(chunk, toy)).latents)
            bar.update(len(chunk))
    return torch.cat(out)


def train_unet(unet, text_encoder, tokenizer, latents, captions, args, rng: random.Random,
               gen: torch.Generator, save) -> list[float]:
    """Epsilon-prediction; learning rate warmed up over 50 steps, then constant, so the run's first N steps are
    those of a run with --unet-steps N; the weights saved are an exponential moving average (decay --ema) of the
    trained ones. `save(step, ema_unet, ema_text_encoder, losses)` runs every --save-every steps and at the end."""
    import copy

    from diffusers import DDPMScheduler

    noise_sched = DDPMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085,
                                beta_end=0.012)
    params = list(unet.parameters()) + list(text_encoder.parameters())
    opt = torch.optim.AdamW(params, lr=args.unet_lr, weight_decay=0.0)
    ids_all = tokenizer(captions + [""], padding="max_length", max_length=tokenizer.model_max_length,
                        truncation=True, return_tensors="pt").input_ids
    empty = ids_all[-1]
    losses = []
    ema_unet, ema_text = copy.deepcopy(unet).eval(), copy.deepcopy(text_encoder).eval()
    ema_params = list(ema_unet.parameters()) + list(ema_text.parameters())
    unet.train()
    text_encoder.train()
    with _bar(args.unet_steps, "UNet + text encoder", args.progress) as bar:
        for step in range(args.unet_steps):
            for group in opt.param_groups:
                group["lr"] = args.unet_lr * min(1.0, (step + 1) / 50)
            index = torch.tensor([rng.randrange(len(captions)) for _ in range(args.batch)])
            ids = ids_all[index].clone()
            drop = torch.tensor([rng.random() < args.caption_dropout for _ in range(args.batch)])
            ids[drop] = empty
            x0 = latents[index]
            noise = torch.randn(x0.shape, generator=gen)
            t = torch.randint(0, 1000, (args.batch,), generator=gen)
            noisy = noise_sched.add_noise(x0, noise, t)
            pred = unet(noisy, t, encoder_hidden_states=text_encoder(ids)[0]).sample
            loss = torch.nn.functional.mse_loss(pred, noise, reduction="none").mean(dim=(1, 2, 3))
            if args.min_snr_gamma > 0:  # Min-SNR-gamma weighting (Hang et al. 2023) for epsilon prediction
                snr = noise_sched.alphas_cumprod[t] / (1 - noise_sched.alphas_cumprod[t])
                loss = loss * torch.clamp(snr, max=args.min_snr_gamma) / snr
            loss = loss.mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            with torch.no_grad():
                decay = min(args.ema, (step + 1) / (step + 10))
                for mean, param in zip(ema_params, params, strict=True):
                    mean.lerp_(param, 1.0 - decay)
            losses.append(loss.item())
            bar.set_postfix(loss=f"{np.mean(losses[-50:]):.4f}")
            bar.update()
            if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.unet_steps:
                save(step + 1, ema_unet, ema_text, losses)
    save(args.unet_steps, ema_unet, ema_text, losses)
    return losses


def train(args: argparse.Namespace) -> dict:
    from diffusers import StableDiffusionPipeline

    from hetu_ext.diffusion import toy

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    out = Path(args.out)
    start = time.perf_counter()
    layouts = toy.split(args.split_seed).train
    if args.layouts:
        layouts = random.Random(args.seed).sample(layouts, min(args.layouts, len(layouts)))
    captions = [toy.caption(lay) for lay in layouts]
    tokenizer = toy.write_tokenizer(out / ".tokenizer_src")
    vae, text_encoder, unet = toy.make_vae(), toy.make_text_encoder(len(tokenizer)), toy.make_unet()

    vae_losses = train_vae(vae, layouts, toy, args, rng)
    latents = encode_all(vae, layouts, toy, args)
    scale = float(1.0 / latents.std())
    vae.register_to_config(scaling_factor=scale)
    latents = latents * scale
    import diffusers
    import transformers

    def save(step: int, ema_unet, ema_text, losses: list[float]) -> None:
        pipe = StableDiffusionPipeline(vae=vae, text_encoder=ema_text, tokenizer=tokenizer, unet=ema_unet,
                                       scheduler=toy.make_scheduler(), safety_checker=None, feature_extractor=None,
                                       requires_safety_checker=False)
        pipe.save_pretrained(out)
        # AutoencoderTiny registers block_out_channels itself (for the pipeline's scale factor) and then warns on
        # load that the saved key is unexpected: leave it out of the file, the model sets it again.
        vae_config = out / "vae" / "config.json"
        vae_config.write_text(json.dumps({k: v for k, v in json.loads(vae_config.read_text()).items()
                                          if k != "block_out_channels"}, indent=2, sort_keys=True) + "\n")
        argv = {k: v for k, v in vars(args).items() if k not in ("out", "progress", "save_every")}
        argv["unet_steps"] = step
        record.update({"command": "python -m hetu_ext.diffusion.train_toy " + " ".join(
                           f"--{k.replace('_', '-')} {v}" for k, v in argv.items()) + " --out DIR",
                       "args": argv, "weights_sha256": weights_checksum(vae, ema_text, ema_unet),
                       "seconds": round(time.perf_counter() - start, 1),
                       "unet_loss_last100": float(np.mean(losses[-100:])) if losses else None})
        (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")

    record = {"train_layouts": len(layouts), "vae_scaling_factor": scale,
              "vae_loss_last50": float(np.mean(vae_losses[-50:])) if vae_losses else None,
              "versions": {"python": platform.python_version(), "torch": torch.__version__,
                           "diffusers": diffusers.__version__, "transformers": transformers.__version__}}
    train_unet(unet, text_encoder, tokenizer, latents, captions, args, rng, gen, save)
    for path in sorted((out / ".tokenizer_src").iterdir()):
        path.unlink()
    (out / ".tokenizer_src").rmdir()
    return record


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the pipeline (created)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split-seed", type=int, default=0, help="which captions are held out (toy.split)")
    parser.add_argument("--vae-steps", type=int, default=600)
    parser.add_argument("--unet-steps", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--vae-lr", type=float, default=2e-3)
    parser.add_argument("--unet-lr", type=float, default=1e-3)
    parser.add_argument("--ema", type=float, default=0.995, help="decay of the saved weights' moving average")
    parser.add_argument("--save-every", type=int, default=0, help="also save the pipeline every N UNet steps "
                        "(the save at step N equals a run with --unet-steps N)")
    parser.add_argument("--caption-dropout", type=float, default=0.1)
    parser.add_argument("--min-snr-gamma", type=float, default=5.0, help="weight each sample's loss by "
                        "min(SNR, gamma) / SNR, which speeds up learning the layout (0: plain MSE)")
    parser.add_argument("--layouts", type=int, default=0, help="train on this many layouts (0: all training ones)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for name in ("vae_steps", "unet_steps", "batch", "threads"):
        if getattr(args, name) < (0 if name.endswith("steps") else 1):
            print(f"error: --{name.replace('_', '-')} must be >= 1 (steps >= 0), got {getattr(args, name)}",
                  file=sys.stderr)
            return 2
    record = train(args)
    print(f"saved {args.out} in {record['seconds']} s; weights sha256 {record['weights_sha256']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
