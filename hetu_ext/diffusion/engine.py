"""FISEdit on diffusers' own `UNet2DConditionModel`: attach, generate (dense, caching), edit (dense, then sparse).

Attaching swaps every `nn.Conv2d` and `nn.GroupNorm` of the UNet for a parameter-sharing wrapper
(`sparse_ops.py`) and puts forward hooks on the UNet, each `Transformer2DModel` and (for cached keys/values) the
self-attention key/value projections. Nothing of diffusers is copied: in sparse steps diffusers' own blocks run,
the transformer blocks on the gathered active tokens. `detach()` restores the original modules and hooks.

Invariant in sparse steps: every tensor passed between units is full-size, fresh on active blocks and equal to
the generation's values elsewhere. Hence any unit can run dense at any step (a missing cache entry, a map too
small to pay), and an all-inactive mask returns the cached noise prediction exactly.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from hetu_ext.diffusion.config import FISEditConfig
from hetu_ext.diffusion.mask import difference_map, mask_from_difference, resize_mask
from hetu_ext.diffusion.sparse_ops import SparseConv2d, SparseGroupNorm
from hetu_ext.diffusion.state import RunState
from hetu_ext.diffusion.transformer_hooks import attach_transformer
from hetu_ext.errors import HetuExtError

logger = logging.getLogger(__name__)


def _set_child(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, module)


class FISEditEngine:
    """Cache-enabled sparse inference for one UNet. Use `recording()` around a generation and `editing()` around an
    edit (any denoising loop that calls the UNet once per step, e.g. a diffusers pipeline), or `generate`/`edit`."""

    def __init__(self, unet: nn.Module, config: FISEditConfig | None = None) -> None:
        from diffusers import UNet2DConditionModel

        if not isinstance(unet, UNet2DConditionModel):
            raise TypeError(f"FISEditEngine needs a diffusers UNet2DConditionModel, got {type(unet).__name__}")
        self.unet = unet
        self.config = config or FISEditConfig()
        self.state = RunState(self.config)
        self._swapped: list[tuple[str, nn.Module]] = []
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._diffs: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        self._user_mask: torch.Tensor | None = None
        self._total_steps = 0
        self.mask_seconds = 0.0
        """Seconds the last edit spent making its mask (difference map, threshold, morphology; or resizing a given
        mask), inside the edit's time."""
        self._attach()

    # ---- attach / detach -----------------------------------------------------------------------------------
    def _attach(self) -> None:
        from diffusers.models.transformers.transformer_2d import Transformer2DModel

        unet, st = self.unet, self.state
        if any(isinstance(m, (SparseConv2d, SparseGroupNorm)) for m in unet.modules()):
            raise ValueError("this UNet already has a FISEditEngine attached (two engines would wrap and hook it "
                             "twice); call detach() on the first engine before attaching another")
        transformers = {n: m for n, m in unet.named_modules() if isinstance(m, Transformer2DModel)}
        for name, module in list(unet.named_modules()):
            owner = next((t for t in transformers if name in (f"{t}.proj_in", f"{t}.proj_out")), None)
            if isinstance(module, nn.Conv2d) and self._conv_supported(module):
                fill = "none" if owner and name.endswith("proj_in") else "cache"
                unit = owner or name
                key = f"{unit}#out" if fill == "cache" else f"{name}#none"
                self._swap(name, SparseConv2d(module, ctx=st, unit=unit, key=key, fill=fill))
            elif isinstance(module, nn.GroupNorm) and module.num_channels % module.num_groups == 0:
                self._swap(name, SparseGroupNorm(module, ctx=st, key=f"{name}#gn"))
        for name, module in transformers.items():
            self._hooks += attach_transformer(name, module, st)
        self._hooks.append(unet.register_forward_pre_hook(self._before_step, with_kwargs=True))
        self._hooks.append(unet.register_forward_hook(self._after_step))
        logger.info("FISEdit attached: %d modules wrapped, %d transformers hooked", len(self._swapped),
                    len(transformers))

    @staticmethod
    def _conv_supported(conv: nn.Conv2d) -> bool:
        return (conv.groups == 1 and conv.dilation == (1, 1) and conv.padding_mode == "zeros"
                and isinstance(conv.padding, tuple))

    def _swap(self, name: str, wrapper: nn.Module) -> None:
        original = self.unet.get_submodule(name)
        _set_child(self.unet, name, wrapper)
        self._swapped.append((name, original))

    def detach(self) -> None:
        """Put the original modules back and remove every hook; the UNet is as it was before attaching."""
        for name, original in reversed(self._swapped):
            _set_child(self.unet, name, original)
        for handle in self._hooks:
            handle.remove()
        self._swapped.clear()
        self._hooks.clear()
        self.state.phase = "off"

    # ---- the per-step hooks --------------------------------------------------------------------------------
    def _before_step(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        st = self.state
        sample = args[0] if args else kwargs["sample"]
        timestep = args[1] if len(args) > 1 else kwargs["timestep"]
        t = float(timestep.flatten()[0]) if torch.is_tensor(timestep) else float(timestep)
        if st.phase == "record":
            st.timesteps.append(t)
            st.cache.put(st.step, "latent", sample)
            return
        if st.phase == "off":
            return
        self._check_edit_step(sample, t)
        cfg = self.config
        if 1 <= st.step <= cfg.k and self._user_mask is None:
            self._diffs[0].append(st.cache.get(st.step, "latent", sample.device))
            self._diffs[1].append(sample.detach())
        if st.step == cfg.dense_steps:
            start = time.perf_counter()
            st.set_mask(self._make_mask(sample))
            if sample.is_cuda:
                torch.cuda.synchronize(sample.device)
            self.mask_seconds = time.perf_counter() - start
            st.phase = "sparse"
        if st.phase == "sparse":
            st.cache.prefetch(st.step, sample.device)
            st.cache.prefetch(st.step + 1, sample.device)

    def _check_edit_step(self, sample: torch.Tensor, t: float) -> None:
        st = self.state
        if st.step >= len(st.timesteps):
            raise ValueError(f"the edit runs more UNet steps ({st.step + 1}) than the generation recorded "
                             f"({len(st.timesteps)}); edit with the generation's num_inference_steps")
        if t != st.timesteps[st.step]:
            raise ValueError(f"edit step {st.step} has timestep {t} but the generation had {st.timesteps[st.step]};"
                             " edit with the generation's scheduler and num_inference_steps")
        cached = st.cache.get(st.step, "latent", sample.device)
        if cached.shape != sample.shape:
            raise ValueError(f"edit UNet input {tuple(sample.shape)} differs from the generation's "
                             f"{tuple(cached.shape)}; use the same size, batch and guidance (CFG doubles the batch)")
        if st.step == 0 and not torch.equal(cached, sample):
            raise ValueError("the edit must start from the generation's initial latents (the cache is only valid "
                             "for them); pass the same latents or generator seed")

    def _make_mask(self, sample: torch.Tensor) -> torch.Tensor:
        height, width = sample.shape[-2:]
        if self._user_mask is not None:
            return resize_mask(self._user_mask.to(sample.device), height, width)
        cfg = self.config
        diff = difference_map(*self._diffs)
        return mask_from_difference(diff, threshold=cfg.threshold, fixed_threshold=cfg.fixed_threshold,
                                    open_radius=cfg.open_radius, dilate_radius=cfg.dilate_radius,
                                    smooth_radius=cfg.smooth_radius, close_radius=cfg.close_radius)

    def _after_step(self, module: nn.Module, args: tuple, output: Any) -> None:
        st = self.state
        if st.phase == "off":
            return
        st.finish_record_step(self._total_steps or st.step + 1)
        st.cache.release(st.step)
        st.step += 1

    def step_end(self, i: int, latents: torch.Tensor) -> torch.Tensor:
        """The loop's latents after scheduler step `i` -> the latents it continues with. Recording: keeps those of
        the steps an edit runs sparse. Editing, sparse steps, `keep_outside`: the recorded ones outside the mask.
        Anything else: unchanged. Pass it as `denoise(step_end=...)` or call it from diffusers' callback_on_step_end
        (stored under step i + 1, whose cache the step's pre-hook has already prefetched to the device)."""
        st = self.state
        if st.phase == "record" and i >= self.config.dense_steps:
            st.cache.put(i + 1, "loop_latents", latents)
        elif st.phase == "sparse" and st.mask is not None and self.config.keep_outside and i >= self.config.dense_steps:
            kept = st.cache.get(i + 1, "loop_latents", latents.device)
            if kept.shape != latents.shape:
                raise ValueError(f"step_end got latents {tuple(latents.shape)} but the generation's were "
                                 f"{tuple(kept.shape)}; pass the loop's latents (before any CFG doubling)")
            latents = torch.where(st.mask.to(latents.device), latents, kept.to(latents.dtype))
        return latents

    # ---- runs ----------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def recording(self, num_inference_steps: int) -> Iterator[None]:
        """Around a dense generation of `num_inference_steps` UNet calls: caches what the edit's sparse steps need
        (replacing the previous generation's cache)."""
        if not self._swapped:
            raise HetuExtError("this FISEditEngine was detached; make a new one")
        if num_inference_steps <= self.config.dense_steps:
            logger.warning("num_inference_steps %d <= dense_steps %d: edits will run fully dense",
                           num_inference_steps, self.config.dense_steps)
        st = self.state
        st.start_record()
        st.phase, st.step, self._total_steps = "record", 0, num_inference_steps
        try:
            yield
        finally:
            st.phase = "off"
            if torch.cuda.is_available() and next(self.unet.parameters()).is_cuda:
                torch.cuda.synchronize()  # device-to-host copies into pinned memory are asynchronous
        if len(st.timesteps) != num_inference_steps:
            raise ValueError(f"recording() was told {num_inference_steps} steps but the UNet ran "
                             f"{len(st.timesteps)} times; pass the loop's number of UNet calls")

    @contextlib.contextmanager
    def editing(self, mask: torch.Tensor | None = None) -> Iterator[None]:
        """Around an edit: the same loop as the generation with new text embeddings. `mask` (H, W) bool at latent
        size or a whole multiple of it (e.g. image size) replaces the automatic mask."""
        st = self.state
        if not st.timesteps:
            raise ValueError("edit before generate: run a generation under recording() first, it fills the cache")
        if mask is None and self.config.dense_steps < 1:
            raise ValueError("dense_steps=0 leaves no dense step to make the mask from; pass a mask or set "
                             "dense_steps >= 1")
        if mask is not None:  # fail before any step runs, not at the first sparse one
            resize_mask(mask, *st.cache.get(0, "latent", torch.device("cpu")).shape[-2:])
        self._user_mask = mask
        self._diffs = ([], [])
        st.start_edit()
        st.phase, st.step = "dense", 0
        try:
            yield
        finally:
            st.phase = "off"
            self._diffs = ([], [])

    @property
    def last_mask(self) -> torch.Tensor | None:
        """The latent-size bool mask of the last edit (None before its first sparse step)."""
        return self.state.mask

    @property
    def cache_bytes(self) -> int:
        """Bytes the cache holds on the host (feature maps, GroupNorm statistics, latents)."""
        return self.state.cache.nbytes

    def active_fractions(self) -> dict[str, float]:
        return self.state.active_fractions()

    def generate(self, scheduler: Any, **loop: Any) -> torch.Tensor:
        """Dense generation at the UNet level (see `denoise` for the arguments); fills the cache."""
        from hetu_ext.diffusion.loop import denoise

        with self.recording(loop["num_inference_steps"]):
            return denoise(self.unet, scheduler, step_end=self.step_end, **loop)

    def edit(self, scheduler: Any, *, mask: torch.Tensor | None = None, **loop: Any) -> torch.Tensor:
        """Edit at the UNet level: `loop` as for `generate` with the new `prompt_embeds` and the same latents."""
        from hetu_ext.diffusion.loop import denoise

        with self.editing(mask):
            return denoise(self.unet, scheduler, step_end=self.step_end, **loop)
