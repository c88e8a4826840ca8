"""Sparse kernels and the in-place module wrappers that run them: convolution on active blocks, GroupNorm with
cached (or corrected) statistics.

Wrappers share the wrapped module's parameters (the same `Parameter` objects under the same names, so
`state_dict()` is unchanged while attached) and keep the original module to call in dense phases and to put back
on detach. In dense phases they call the original module itself: dense results stay bit-identical to diffusers.
"""

from __future__ import annotations

from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from hetu_ext.diffusion.mask import ActiveSet

Phase = Literal["off", "record", "dense", "sparse"]


class StepContext(Protocol):
    """What a wrapper asks the engine during one UNet call."""

    phase: Phase

    def active(self, unit: str | None, height: int, width: int) -> ActiveSet | None:
        """The active blocks of a `height x width` output of `unit` if it runs sparse at this step, else None.
        `unit=None`: the answer for the map size alone (statistics, which are always cached)."""

    def record(self, unit: str | None, key: str, value: torch.Tensor, macs: int) -> None:
        """Cache `value` under `key` for this step if the cache plan keeps `unit` (always for `unit=None`)."""

    def cached(self, key: str, device: torch.device) -> torch.Tensor:
        """This step's cached tensor under `key` (do not modify it)."""

    def stats_block(self, height: int, width: int) -> int | None:
        """Block side for GroupNorm statistics of a `height x width` map, None if that size never runs sparse."""

    def stats_set(self, active: ActiveSet) -> ActiveSet:
        """The GroupNorm statistics blocks holding any pixel of `active`."""

    group_norm: str
    conv_kernel: str


def conv_output_size(conv: nn.Conv2d, height: int, width: int) -> tuple[int, int]:
    (kh, kw), (sh, sw), (ph, pw) = conv.kernel_size, conv.stride, conv.padding
    return (height + 2 * ph - kh) // sh + 1, (width + 2 * pw - kw) // sw + 1


def _output_buffer(x: torch.Tensor, base: torch.Tensor | None, cout: int, active: ActiveSet) -> torch.Tensor:
    """A copy of ``base`` on ``x``'s device and dtype (the sparse result is scattered into it), or an
    uninitialised (B, Cout, Ho, Wo) tensor when there is no base."""
    if base is None:
        return x.new_empty(x.shape[0], cout, active.height, active.width)
    return base.to(device=x.device, dtype=x.dtype, copy=True)


def sparse_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, stride: tuple[int, int],
                  padding: tuple[int, int], active: ActiveSet, base: torch.Tensor | None) -> torch.Tensor:
    """Convolve only the active output blocks: gather each block's input window with its halo from the zero-padded
    input, convolve the windows as a batch (no padding), scatter into a copy of `base` (uninitialised when None).

    x: (B, Cin, H, W); base: (B, Cout, Ho, Wo); returns (B, Cout, Ho, Wo). Each active output pixel sees exactly the
    inputs (and zero padding) the dense convolution sees, so it equals the dense result (bit-exact where the conv
    backend sums in the same order for both batch shapes)."""
    batch, channels, height, width = x.shape
    cout = weight.shape[0]
    out = _output_buffer(x, base, cout, active)
    nb = active.blocks.numel()
    if nb == 0:
        return out
    kernel = (weight.shape[2], weight.shape[3])
    index = active.window_index(height, width, kernel, stride, padding)  # (nb, Lh, Lw)
    lh, lw = index.shape[1:]
    if padding != (0, 0):
        x = F.pad(x, (padding[1], padding[1], padding[0], padding[0]))
    windows = x.flatten(2)[:, :, index.flatten()]  # (B, Cin, nb * Lh * Lw)
    windows = windows.view(batch, channels, nb, lh, lw).transpose(1, 2).reshape(batch * nb, channels, lh, lw)
    y = F.conv2d(windows, weight, bias, stride)  # (B * nb, Cout, block, block)
    y = y.view(batch, nb, cout, -1).transpose(1, 2).reshape(batch, cout, -1)
    out.flatten(2).index_copy_(2, active.tokens, y)
    return out


def sparse_conv2d_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *,
                       stride: tuple[int, int], padding: tuple[int, int], active: ActiveSet,
                       base: torch.Tensor | None) -> torch.Tensor:
    """Convolve only the active output pixels as one GEMM: gather each pixel's kernel taps (im2col on the active
    pixels only, zero where the dense conv reads padding), multiply by the (Cin * kh * kw, Cout) weight view,
    scatter into a copy of `base` (uninitialised when None). Same inputs as the dense conv; the sum order differs, so
    equal to it up to fp rounding (~1e-6 relative in fp32). Shapes as `sparse_conv2d`."""
    batch, channels, height, width = x.shape
    cout, _, kh, kw = weight.shape
    out = _output_buffer(x, base, cout, active)
    count = active.tokens.numel()
    if count == 0:
        return out
    ids, valid = active.tap_index(height, width, (kh, kw), stride, padding)
    cols = x.flatten(2)[:, :, ids]  # (B, Cin, n * kh * kw)
    if valid is not None:
        cols = cols * valid.to(cols.dtype)
    cols = cols.view(batch, channels, count, kh * kw).transpose(1, 2).reshape(batch * count, channels * kh * kw)
    matrix = weight.reshape(cout, -1).t()  # (Cin * kh * kw, Cout), a view
    y = torch.addmm(bias, cols, matrix) if bias is not None else cols @ matrix  # (B * n, Cout)
    out.flatten(2).index_copy_(2, active.tokens, y.view(batch, count, cout).transpose(1, 2))
    return out


class SparseConv2d(nn.Module):
    """An `nn.Conv2d` that, in sparse steps, computes only the active blocks and takes the rest from the cache
    (`fill="cache"`) or leaves it uninitialised (`fill="none"`: outputs only ever read on active tokens)."""

    def __init__(self, original: nn.Conv2d, *, ctx: StepContext, unit: str, key: str,
                 fill: Literal["cache", "none"]) -> None:
        super().__init__()
        self.weight = original.weight
        self.bias = original.bias
        object.__setattr__(self, "original", original)  # not a submodule: its parameters are ours already
        object.__setattr__(self, "ctx", ctx)
        self.unit, self.key, self.fill = unit, key, fill

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx, conv = self.ctx, self.original
        out_h, out_w = conv_output_size(conv, x.shape[2], x.shape[3])
        if ctx.phase == "sparse":
            active = ctx.active(self.unit, out_h, out_w)
            if active is not None:
                base = ctx.cached(self.key, x.device) if self.fill == "cache" else None
                kernel = sparse_conv2d_gemm if ctx.conv_kernel == "gemm" else sparse_conv2d
                return kernel(x, self.weight, self.bias, stride=conv.stride, padding=conv.padding, active=active,
                              base=base)
        y = conv(x)
        if ctx.phase == "record" and self.fill == "cache":
            kh, kw = conv.kernel_size
            macs = y.numel() * conv.in_channels * kh * kw // conv.groups
            ctx.record(self.unit, self.key, y, macs)
        return y


def block_stats(x: torch.Tensor, groups: int, tokens: torch.Tensor | None, block: int) -> torch.Tensor:
    """Per-block GroupNorm statistics: (2, B, G, nb) fp32 holding each block's mean and M2 (sum of squared
    deviations from the block mean). `tokens` = block-major pixel ids of the blocks (None = all, in grid order)."""
    batch, channels, height, width = x.shape
    if tokens is None:
        gh, gw = height // block, width // block
        v = x.view(batch, groups, channels // groups, gh, block, gw, block).permute(0, 1, 3, 5, 2, 4, 6)
    else:
        v = x.flatten(2)[:, :, tokens].view(batch, groups, channels // groups, -1, block * block).transpose(2, 3)
    v = v.reshape(batch, groups, -1, (channels // groups) * block * block).float()
    var, mean = torch.var_mean(v, dim=-1, correction=0)
    return torch.stack((mean, var * v.shape[-1]))


def combine_stats(stats: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Chan's parallel combination of equal-size blocks in fp64: (2, B, G, nb) -> mean, variance (B, G)."""
    mean_b, m2_b = stats.double()
    mean = mean_b.mean(-1)
    m2 = m2_b.sum(-1) + count * ((mean_b - mean[..., None]) ** 2).sum(-1)
    return mean, m2 / (count * stats.shape[-1])


class SparseGroupNorm(nn.Module):
    """An `nn.GroupNorm` that, in sparse steps, normalises with statistics from the generation's per-block cache,
    the active blocks' statistics replaced by fresh ones (`group_norm="corrected"`) or not (`"cached"`)."""

    def __init__(self, original: nn.GroupNorm, *, ctx: StepContext, key: str) -> None:
        super().__init__()
        self.weight = original.weight
        self.bias = original.bias
        object.__setattr__(self, "original", original)
        object.__setattr__(self, "ctx", ctx)
        self.key = key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx, norm = self.ctx, self.original
        if x.dim() != 4:
            return norm(x)
        height, width = x.shape[2:]
        if ctx.phase == "sparse":
            active = ctx.active(None, height, width)
            if active is not None:
                return self._sparse(x, active)
        y = norm(x)
        if ctx.phase == "record":
            block = ctx.stats_block(height, width)
            if block is not None:
                ctx.record(None, self.key, block_stats(x, norm.num_groups, None, block), 0)
        return y

    def _sparse(self, x: torch.Tensor, active: ActiveSet) -> torch.Tensor:
        norm = self.original
        stats = self.ctx.cached(self.key, x.device)
        blocks = self.ctx.stats_set(active)
        if self.ctx.group_norm == "corrected" and blocks.blocks.numel():
            stats = stats.clone()
            stats[..., blocks.blocks] = block_stats(x, norm.num_groups, blocks.tokens, blocks.block)
        count = (x.shape[1] // norm.num_groups) * blocks.block * blocks.block
        mean, var = combine_stats(stats, count)
        batch, channels = x.shape[:2]
        rstd = torch.rsqrt(var + norm.eps).float()
        xf = x.float().view(batch, norm.num_groups, -1)
        y = ((xf - mean.float()[..., None]) * rstd[..., None]).view_as(x)
        if norm.affine:
            y = y * self.weight.float()[None, :, None, None] + self.bias.float()[None, :, None, None]
        return y.to(x.dtype)
