"""A UNet-level denoising loop (the one diffusers' StableDiffusionPipeline runs), for given text embeddings."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


@torch.no_grad()
def denoise(unet: nn.Module, scheduler: Any, *, latents: torch.Tensor, prompt_embeds: torch.Tensor,
            num_inference_steps: int, negative_prompt_embeds: torch.Tensor | None = None,
            guidance_scale: float = 7.5, progress_bar: dict[str, Any] | None = None,
            step_end: Callable[[int, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Run `num_inference_steps` scheduler steps from `latents` (B, 4, h, w) of unit variance; one UNet call per
    step, with classifier-free guidance (batch doubled) when `negative_prompt_embeds` is given and
    `guidance_scale > 1`. prompt_embeds: (B, L, D). `progress_bar`: tqdm arguments for a bar over the steps (as
    diffusers' `set_progress_bar_config` takes them; None: no bar). `step_end(i, latents)`, called after each
    scheduler step, returns the latents the loop continues with (as diffusers' `callback_on_step_end`).
    Returns the final latents (B, 4, h, w)."""
    if latents.shape[0] != prompt_embeds.shape[0]:
        raise ValueError(f"latents batch {latents.shape[0]} != prompt_embeds batch {prompt_embeds.shape[0]}; "
                         "give one text embedding per latent")
    guided = negative_prompt_embeds is not None and guidance_scale > 1.0
    embeds = torch.cat([negative_prompt_embeds, prompt_embeds]) if guided else prompt_embeds
    scheduler.set_timesteps(num_inference_steps, device=latents.device)
    latents = latents * scheduler.init_noise_sigma
    timesteps = scheduler.timesteps
    if progress_bar is not None:
        from tqdm.auto import tqdm

        timesteps = tqdm(timesteps, **progress_bar)
    for i, t in enumerate(timesteps):
        model_in = torch.cat([latents, latents]) if guided else latents
        model_in = scheduler.scale_model_input(model_in, t)
        noise = unet(model_in, t, encoder_hidden_states=embeds).sample
        if guided:
            uncond, cond = noise.chunk(2)
            noise = uncond + guidance_scale * (cond - uncond)
        latents = scheduler.step(noise, t, latents).prev_sample
        if step_end is not None:
            latents = step_end(i, latents)
    return latents
