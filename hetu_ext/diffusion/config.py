"""FISEdit's typed configuration: schedule, mask, sparse compute and cache budget of one engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Threshold = Literal["otsu", "fixed"]
KeyValues = Literal["active", "cached"]
GroupNormStats = Literal["corrected", "cached"]
DecoderStats = Literal["cached", "fresh"]
ConvKernel = Literal["gemm", "conv"]


@dataclass(kw_only=True)
class FISEditConfig:
    """How an edit reuses the generation's cache. Defaults: 15 dense steps (of 50), then sparse ones (FISEdit's
    schedule; its paper runs 10 dense)."""

    # The mask defaults (15 dense steps, all of them making the mask, fixed threshold 0.3 on the unsmoothed map,
    # closing 1, no opening or dilation) were tuned on the toy model's tune set of 24 held-out edits (`python -m
    # hetu_ext.diffusion.fidelity --grid --grid-price 4 --set tune`): of the settings with median mask IoU >= 0.65,
    # the lowest median err_in (0.060, IoU 0.66; the IoU-best settings: 0.85, err_in 0.100). On the check set: IoU
    # 0.62, err_in 0.059 (benchmarks/results/fisedit_toy.txt).
    dense_steps: int = 15
    """Leading steps of an edit run densely (fresh, no cache). The mask is made after them; 0 needs a user mask."""

    mask_steps: int | None = None
    """k: the mask is the latent difference (edit vs cached) summed over the edit's first k steps (None: all
    dense steps)."""

    threshold: Threshold = "fixed"
    """How the normalised difference map becomes a mask: Otsu's between-class variance or `fixed_threshold`."""

    fixed_threshold: float = 0.3
    """Threshold on the difference map normalised to [0, 1] when `threshold == "fixed"`."""

    smooth_radius: int = 0
    """The difference map is averaged over a (2r+1)^2 window before thresholding (a latent pixel's own change can
    be small inside a changed object: latent channels encode edges and texture); 0 = none."""

    close_radius: int = 1
    """Morphological closing radius (latent pixels): fills holes and gaps in the thresholded mask; 0 = none."""

    open_radius: int = 0
    """Morphological opening radius (latent pixels) that removes specks from the thresholded mask; 0 = none."""

    dilate_radius: int = 0
    """Dilation radius (latent pixels) that grows the cleaned mask to cover the edit's border; 0 = none."""

    block_size: int = 1
    """Side of a sparse block in pixels of each layer's own feature map (capped at the map side): the granularity
    of what is recomputed. Measured on CPU for a 5% square mask, GEMM kernel / dense conv time with blocks 1, 2, 4:
    64x64x320 maps 0.09, 0.11, 0.13; 16x16x1280 maps 0.13, 0.13, 0.27 (coarser blocks recompute more pixels and
    the kernel gathers per pixel anyway), hence 1. The "conv" kernel wants >= 4 (0.10 at 64x64x320, block 4)."""

    stats_block_size: int = 8
    """Side of the blocks whose GroupNorm statistics are cached (pixels of the layer's map); a statistics block
    containing any active pixel gets fresh statistics. Coarser = smaller cache, finer = fresher statistics."""

    conv_kernel: ConvKernel = "gemm"
    """Sparse convolution: "gemm" (im2col of the active pixels + one GEMM; fastest measured on CPU, equal to the
    dense conv up to fp rounding) or "conv" (each active block's input window with its halo through F.conv2d as a
    batch; bit-exact to torch's conv as measured, best with block_size >= 4)."""

    min_sparse_size: int = 8
    """Feature maps with a side smaller than this run dense (sparsity does not pay for its gathers there). 8 keeps
    SD's 8x8 maps sparse: measured on CPU, their dense 1280-channel convs (weight-bound) took ~40% of a sparse step."""

    max_active_fraction: float = 0.6
    """A map size whose active block fraction exceeds this runs dense for the edit (exact, no gather cost).
    Measured on CPU (GEMM kernel / dense conv time): 64x64x320 maps 0.11 at 5% active, 0.45 at 20%, 0.88 at 40%;
    16x16x1280 maps (weight-bound) 0.10, 0.29, 0.33. 0.6 keeps MACs reduced for masks up to 40%; for latency
    alone on 64x64 maps, ~0.4 is the break-even."""

    key_values: KeyValues = "active"
    """Self-attention keys/values: "active" (FISEdit: from the active tokens only) or "cached" (all tokens, the
    inactive ones from the generation's cache; costs 2 x tokens x channels of cache per attention layer)."""

    group_norm: GroupNormStats = "corrected"
    """GroupNorm statistics in sparse steps: "cached" (FISEdit: the generation's statistics) or "corrected" (the
    generation's per-block statistics with the active blocks' fresh ones swapped in: same cost, and exact when
    every block is active)."""

    keep_outside: bool = True
    """After each sparse step, the latents outside the mask are set to the generation's latents after that step (the
    loop calls `FISEditEngine.step_end`; the UNet-level `generate`/`edit` and `FISEditPipeline` do). The sparse
    steps already take the generation's noise prediction there, but the dense steps moved those latents, and a
    scheduler step amplifies that drift by up to 1/sqrt(alpha_bar) (x4.5 after 10 of 50 SD steps): with it the
    edit is the original outside the mask exactly. False: the drift stays (FISEdit's latents follow the edit's
    dense steps outside the mask)."""

    decoder_stats: DecoderStats = "cached"
    """GroupNorm statistics of the VAE decoder when `FISEditPipeline.edit` decodes: "cached" (the generation's
    decode's, recorded per layer and group; FISEdit's cached-statistics rule applied to the decoder) or "fresh"
    (the decoder as is). The decoder's GroupNorms normalise over the whole image, so with "fresh" a change inside
    the mask shifts every pixel: on the toy model, latents identical outside the mask decoded 20-26 dB apart
    there (PSNR); with "cached" only the convolutions' receptive field carries the change out of the mask."""

    paste_outside: bool = True
    """`FISEditPipeline.edit`'s image takes the generation's decoded pixels outside the mask (upsampled to image
    size): the latents there are the generation's (`keep_outside`), but the VAE decoder is not local (GroupNorm
    statistics over the whole image, receptive field of most of a 32x32 image), so decoding moves them anyway: on
    the toy model by 15-35 dB PSNR even with cached decoder statistics. Off: the decoded edit as it is."""

    cache_budget_bytes: int | None = None
    """Most bytes of cached feature maps; layers with the fewest MACs saved per byte are left out (they run dense
    in the steps they miss). None = cache every sparse-eligible layer."""

    def __post_init__(self) -> None:
        if self.dense_steps < 0:
            raise ValueError(f"dense_steps must be >= 0, got {self.dense_steps}; use 0 only with a user mask")
        if self.mask_steps is not None and not 1 <= self.mask_steps <= max(self.dense_steps, 1):
            raise ValueError(f"mask_steps must be in [1, dense_steps={self.dense_steps}], got {self.mask_steps}: the "
                             "mask is made from the dense steps; lower mask_steps or raise dense_steps")
        if self.threshold not in ("otsu", "fixed"):
            raise ValueError(f"threshold must be 'otsu' or 'fixed', got {self.threshold!r}")
        if not 0.0 < self.fixed_threshold < 1.0:
            raise ValueError(f"fixed_threshold must be in (0, 1) (the map is normalised), got {self.fixed_threshold}")
        for name in ("smooth_radius", "close_radius", "open_radius", "dilate_radius"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1 pixel, got {self.block_size}")
        if self.stats_block_size < 1 or self.stats_block_size % self.block_size:
            raise ValueError(f"stats_block_size must be a positive multiple of block_size={self.block_size}, got "
                             f"{self.stats_block_size}: a statistics block must hold whole compute blocks")
        if self.conv_kernel not in ("gemm", "conv"):
            raise ValueError(f"conv_kernel must be 'gemm' or 'conv', got {self.conv_kernel!r}")
        if self.min_sparse_size < 1:
            raise ValueError(f"min_sparse_size must be >= 1 pixel, got {self.min_sparse_size}")
        if not 0.0 < self.max_active_fraction <= 1.0:
            raise ValueError(f"max_active_fraction must be in (0, 1], got {self.max_active_fraction}")
        if self.key_values not in ("active", "cached"):
            raise ValueError(f"key_values must be 'active' or 'cached', got {self.key_values!r}")
        if self.group_norm not in ("corrected", "cached"):
            raise ValueError(f"group_norm must be 'corrected' or 'cached', got {self.group_norm!r}")
        if self.decoder_stats not in ("cached", "fresh"):
            raise ValueError(f"decoder_stats must be 'cached' or 'fresh', got {self.decoder_stats!r}")
        if self.cache_budget_bytes is not None and self.cache_budget_bytes < 0:
            raise ValueError(f"cache_budget_bytes must be >= 0 or None, got {self.cache_budget_bytes}")

    @property
    def k(self) -> int:
        """Steps whose latent differences make the mask."""
        return self.mask_steps if self.mask_steps is not None else self.dense_steps
