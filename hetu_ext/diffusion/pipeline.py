"""FISEdit for a diffusers `StableDiffusionPipeline` loaded from a local folder: the pipeline's own loop runs; the
engine on its UNet caches during `generate` and goes sparse during `edit`."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hetu_ext.diffusion.config import FISEditConfig
from hetu_ext.diffusion.engine import FISEditEngine
from hetu_ext.hostlog import DropMessages

logger = logging.getLogger(__name__)

_WEIGHT_FILES = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin", "model.safetensors",
                 "pytorch_model.bin", "diffusion_pytorch_model.safetensors.index.json",
                 "model.safetensors.index.json", "pytorch_model.bin.index.json")
_PARTS = ("unet", "vae", "text_encoder")


def check_model_dir(model_dir: str | Path) -> Path:
    """A local StableDiffusionPipeline folder with weights, or ValueError naming what is missing (no downloads)."""
    path = Path(model_dir)
    fix = ("give a folder written by StableDiffusionPipeline.save_pretrained (or a downloaded snapshot) holding "
           "model_index.json and unet/, vae/, text_encoder/ weights; nothing is downloaded")
    if not path.is_dir():
        raise ValueError(f"--model {model_dir}: not a directory; {fix}")
    if not (path / "model_index.json").is_file():
        raise ValueError(f"--model {model_dir}: no model_index.json; {fix}")
    for part in _PARTS:
        if not any((path / part / name).is_file() for name in _WEIGHT_FILES):
            raise ValueError(f"--model {model_dir}: no weights in {part}/ (looked for {', '.join(_WEIGHT_FILES[:4])}"
                             f", ...); {fix}")
    if not (path / "tokenizer").is_dir():
        raise ValueError(f"--model {model_dir}: no tokenizer/ folder; {fix}")
    return path


def paste_outside(edited: Any, original: Any, mask: torch.Tensor) -> Any:
    """The edited PIL image inside the latent-size bool `mask` (upsampled to image size), the original outside."""
    import numpy as np
    from PIL import Image

    new, old = np.asarray(edited), np.asarray(original)
    scale = new.shape[0] // mask.shape[0]
    inside = np.kron(mask.numpy().astype(np.uint8), np.ones((scale, scale), dtype=np.uint8)).astype(bool)
    return Image.fromarray(np.where(inside[..., None], new, old))


class DecoderStats:
    """Forward hooks on the VAE decoder's GroupNorms: `record` keeps each layer's per-group mean and variance of a
    decode, `replay` normalises a later decode with them (FISEditConfig.decoder_stats == "cached"); `off` leaves
    the decoder as it is."""

    def __init__(self, decoder: torch.nn.Module) -> None:
        self.mode = "off"
        self.stats: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._hooks = [module.register_forward_hook(self._hook(name)) for name, module in decoder.named_modules()
                       if isinstance(module, torch.nn.GroupNorm)]

    def _hook(self, name: str):
        def hook(module: torch.nn.GroupNorm, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
            if self.mode == "off":
                return None
            x = args[0]
            groups = x.float().reshape(x.shape[0], module.num_groups, -1)
            if self.mode == "record":
                self.stats[name] = (groups.mean(-1, keepdim=True), groups.var(-1, unbiased=False, keepdim=True))
                return None
            if name not in self.stats or self.stats[name][0].shape[0] != x.shape[0]:
                raise ValueError(f"decoder layer {name}: no recorded statistics for a batch of {x.shape[0]}; decode "
                                 "the generation (generate) before an edit, with the same batch")
            mean, var = self.stats[name]
            if torch.equal(groups.mean(-1, keepdim=True), mean) and torch.equal(
                    groups.var(-1, unbiased=False, keepdim=True), var):
                return None  # the same statistics: the layer's own output, bit for bit
            out = ((groups - mean) / torch.sqrt(var + module.eps)).reshape(x.shape)
            if module.affine:
                shape = (1, -1) + (1,) * (x.dim() - 2)  # (B, C, H, W) maps; (B, C, L) in attention
                out = out * module.weight.float().reshape(shape) + module.bias.float().reshape(shape)
            return out.to(output.dtype)

        return hook

    def remove(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()


@dataclass
class EditResult:
    """One edit: the image, the latent-size mask that was recomputed (None for `dense_edit`), the final latents."""

    image: Any
    mask: torch.Tensor | None
    active_fractions: dict[str, float]
    latents: torch.Tensor | None = None
    """(1, C, h, w) final latents of the loop (before the VAE's scaling and decoding), on the host."""
    decoded: Any = None
    """The decoded image before `paste_outside` (the same as `image` when it is off)."""


class FISEditPipeline:
    """`generate(prompt)` then any number of `edit(new_prompt)` calls reusing the generation's cache."""

    def __init__(self, pipe: Any, config: FISEditConfig | None = None) -> None:
        self.pipe = pipe
        self.engine = FISEditEngine(pipe.unet, config)
        self.decoder_stats = DecoderStats(pipe.vae.decoder)
        self._run: dict[str, Any] | None = None
        self._progress_bar: dict[str, Any] = {}
        self.generated_image: Any = None
        """The last generation's image (PIL)."""
        self.generated_latents: torch.Tensor | None = None
        """The last generation's final latents (host), as `EditResult.latents`."""

    def set_progress_bar_config(self, **kwargs: Any) -> None:
        """tqdm arguments for the denoising loops' progress bars, as diffusers' pipelines take them
        (``disable=True`` hides them); each loop's bar is labelled "FISEdit generate" / "FISEdit edit" unless
        ``desc`` is given."""
        self._progress_bar = dict(kwargs)

    def _denoise(self, what: str, prompt: str, decoder: str = "off") -> tuple[Any, torch.Tensor]:
        """The pipeline's own loop (one tqdm bar per loop, diffusers' own) under the engine's current mode; the
        engine's `step_end` runs as diffusers' step-end callback; the VAE decoder's GroupNorm statistics in mode
        `decoder` (DecoderStats). Returns the image and the final latents."""
        final: list[torch.Tensor] = []

        def on_step_end(pipe: Any, i: int, t: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            latents = self.engine.step_end(i, tensors["latents"])
            final[:] = [latents]
            return {"latents": latents}

        self.pipe.set_progress_bar_config(**{"desc": f"FISEdit {what}", **self._progress_bar})
        self.decoder_stats.mode = decoder
        try:
            image = self.pipe(prompt, output_type="pil", callback_on_step_end=on_step_end,
                              callback_on_step_end_tensor_inputs=["latents"], **self._run).images[0]
        finally:
            self.decoder_stats.mode = "off"
        return image, final[0].detach().cpu()

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, config: FISEditConfig | None = None, *,
                        device: str = "cpu", dtype: torch.dtype = torch.float32) -> FISEditPipeline:
        from diffusers import StableDiffusionPipeline

        path = check_model_dir(model_dir)
        # The pipeline's type hint names AutoencoderKL; diffusers documents AutoencoderTiny (TAESD, the toy model's
        # autoencoder) as a drop-in for it, so its "Expected types for vae" warning is noise here.
        loader = logging.getLogger("diffusers.pipelines.pipeline_utils")
        quiet = DropMessages((r"(?s)^Expected types for vae:.*AutoencoderTiny",))
        loader.addFilter(quiet)
        try:
            pipe = StableDiffusionPipeline.from_pretrained(str(path), local_files_only=True, safety_checker=None,
                                                           requires_safety_checker=False, torch_dtype=dtype)
        finally:
            loader.removeFilter(quiet)
        return cls(pipe.to(device), config)

    def generate(self, prompt: str, *, num_inference_steps: int = 50, guidance_scale: float = 7.5,
                 height: int | None = None, width: int | None = None, seed: int = 0) -> Any:
        """Dense generation that fills the cache; returns a PIL image."""
        pipe = self.pipe
        scale = pipe.vae_scale_factor
        height = height or pipe.unet.config.sample_size * scale
        width = width or pipe.unet.config.sample_size * scale
        if height % (8 * scale) or width % (8 * scale):
            raise ValueError(f"height and width must be multiples of {8 * scale} (the UNet downsamples the "
                             f"{scale}x smaller latents 3 times), got {height}x{width}")
        generator = torch.Generator(device="cpu").manual_seed(seed)
        shape = (1, pipe.unet.config.in_channels, height // scale, width // scale)
        latents = torch.randn(shape, generator=generator, dtype=torch.float32).to(pipe.device, pipe.unet.dtype)
        self._run = {"latents": latents, "num_inference_steps": num_inference_steps,
                     "guidance_scale": guidance_scale, "height": height, "width": width}
        with self.engine.recording(num_inference_steps):
            image, self.generated_latents = self._denoise("generate", prompt, decoder="record")
        self.generated_image = image
        logger.info("FISEdit cache: %.1f MiB", self.engine.cache_bytes / 2**20)
        return image

    def edit(self, prompt: str, *, mask: torch.Tensor | None = None) -> EditResult:
        """The generation's loop with a new prompt: dense steps, then the mask (given, or from the latents), then
        sparse steps reusing the cache. `mask`: (H, W) bool at latent or image size."""
        if self._run is None:
            raise ValueError("edit before generate: call generate(prompt) first, it fills the cache the edit reuses")
        with self.engine.editing(mask):
            image, latents = self._denoise(
                "edit", prompt, decoder="replay" if self.engine.config.decoder_stats == "cached" else "off")
        last = self.engine.last_mask
        if last is None:
            raise ValueError(f"the edit ran no sparse step: num_inference_steps={self._run['num_inference_steps']} "
                             f"<= dense_steps={self.engine.config.dense_steps}; lower dense_steps")
        decoded = image
        if self.engine.config.paste_outside:
            image = paste_outside(image, self.generated_image, last.cpu())
        return EditResult(image=image, mask=last.cpu(), active_fractions=self.engine.active_fractions(),
                          latents=latents, decoded=decoded)

    @property
    def loop_settings(self) -> dict[str, Any]:
        """The last generation's loop arguments (latents, steps, guidance, size): an edit must run with them."""
        if self._run is None:
            raise ValueError("no generation yet: call generate(prompt) first")
        return {k: (v.clone() if torch.is_tensor(v) else v) for k, v in self._run.items()}

    def dense_edit(self, prompt: str) -> EditResult:
        """The reference FISEdit is judged against: the generation's loop (same latents, steps, guidance) with the
        new prompt, every step dense (the engine idle; its wrappers call the original modules), cache untouched."""
        if self._run is None:
            raise ValueError("dense_edit before generate: call generate(prompt) first, it fixes the latents and steps")
        image, latents = self._denoise("dense edit", prompt)
        return EditResult(image=image, mask=None, active_fractions={}, latents=latents)
