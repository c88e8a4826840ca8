"""The edit mask: from latent differences to a cleaned pixel mask, then to each layer's grid of active blocks.

A *block* is a `block x block` square of one feature map; a block is *active* when any pixel of the latent mask
that it covers is set. Active blocks are recomputed in sparse steps; the others keep the generation's cached values.
Token order everywhere is block-major: block by block (row-major over the block grid), each block row-major.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


def difference_map(cached: list[torch.Tensor], new: list[torch.Tensor]) -> torch.Tensor:
    """Sum over steps of the channel-mean |new - cached| latent difference. Each tensor (B, C, H, W) -> (H, W)."""
    if len(cached) != len(new) or not cached:
        raise ValueError(f"need the same non-zero number of cached and new latents, got {len(cached)} and {len(new)}")
    total = torch.zeros(cached[0].shape[-2:], dtype=torch.float32, device=cached[0].device)
    for old, cur in zip(cached, new, strict=True):
        total += (cur.float() - old.float()).abs().mean(dim=(0, 1))
    return total


def otsu_threshold(values: torch.Tensor, bins: int = 256) -> float:
    """Otsu's threshold of values in [0, 1]: the cut maximising the between-class variance of the histogram."""
    hist = torch.histc(values.float().flatten(), bins=bins, min=0.0, max=1.0).double()
    prob = hist / hist.sum()
    centers = (torch.arange(bins, dtype=torch.float64) + 0.5) / bins
    weight0 = prob.cumsum(0)
    mean0 = (prob * centers).cumsum(0)
    total_mean = mean0[-1]
    between = (total_mean * weight0 - mean0) ** 2 / (weight0 * (1.0 - weight0)).clamp_min(1e-12)
    cut = int(between[:-1].argmax())
    return float((cut + 1) / bins)


def dilate(mask: torch.Tensor, radius: int) -> torch.Tensor:
    """(H, W) bool mask grown by `radius` pixels (a (2r+1)^2 square neighbourhood)."""
    if radius == 0:
        return mask
    size = 2 * radius + 1
    return F.max_pool2d(mask[None, None].float(), size, stride=1, padding=radius)[0, 0] > 0.5


def _erode(mask: torch.Tensor, radius: int) -> torch.Tensor:
    return ~dilate(~mask, radius)


def clean_mask(mask: torch.Tensor, *, open_radius: int, dilate_radius: int, close_radius: int = 0) -> torch.Tensor:
    """Closing (dilate then erode) fills holes and gaps narrower than 2*close_radius+1; opening (erode then dilate)
    removes specks thinner than 2*open_radius+1; then dilate grows the border."""
    if close_radius:
        mask = _erode(dilate(mask, close_radius), close_radius)
    if open_radius:
        mask = dilate(_erode(mask, open_radius), open_radius)
    return dilate(mask, dilate_radius)


def smooth(diff: torch.Tensor, radius: int) -> torch.Tensor:
    """Mean over the (2 radius + 1)^2 window around each pixel (the map's own pixels only at its border)."""
    if radius == 0:
        return diff
    size = 2 * radius + 1
    return F.avg_pool2d(diff[None, None].float(), size, stride=1, padding=radius, count_include_pad=False)[0, 0]


def mask_from_difference(diff: torch.Tensor, *, threshold: str, fixed_threshold: float, open_radius: int,
                         dilate_radius: int, smooth_radius: int = 0, close_radius: int = 0) -> torch.Tensor:
    """(H, W) difference map -> (H, W) bool mask: smooth, normalise to [0, 1], threshold, clean morphologically
    (close, open, dilate)."""
    diff = smooth(diff, smooth_radius)
    peak = float(diff.max())
    if peak <= 0.0:
        return torch.zeros(diff.shape, dtype=torch.bool, device=diff.device)
    norm = diff / peak
    cut = otsu_threshold(norm.cpu()) if threshold == "otsu" else fixed_threshold
    return clean_mask(norm >= cut, open_radius=open_radius, dilate_radius=dilate_radius, close_radius=close_radius)


@dataclass
class ActiveSet:
    """The active blocks of one feature map size, with gather/scatter indices made once per edit and reused."""

    height: int
    width: int
    block: int
    grid: torch.Tensor
    """(H / block, W / block) bool: which blocks are active."""
    blocks: torch.Tensor = field(init=False)
    """(nb,) flat ids of the active blocks in the grid, ascending."""
    tokens: torch.Tensor = field(init=False)
    """(nb * block * block,) flat pixel ids (row-major over H x W) of the active blocks, block-major."""
    _windows: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict, init=False, repr=False)
    _taps: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict, init=False,
                                                                                  repr=False)

    def __post_init__(self) -> None:
        gw = self.width // self.block
        self.blocks = self.grid.flatten().nonzero().flatten()
        rows = (self.blocks // gw)[:, None] * self.block + torch.arange(self.block, device=self.grid.device)
        cols = (self.blocks % gw)[:, None] * self.block + torch.arange(self.block, device=self.grid.device)
        self.tokens = (rows[:, :, None] * self.width + cols[:, None, :]).flatten()

    @property
    def fraction(self) -> float:
        """Share of the map's blocks that are active."""
        return float(self.blocks.numel()) / float(self.grid.numel())

    def window_index(self, in_height: int, in_width: int, kernel: tuple[int, int], stride: tuple[int, int],
                     padding: tuple[int, int]) -> torch.Tensor:
        """Flat ids into the zero-padded input (in_height + 2 ph, in_width + 2 pw) of each active output block's
        input window with its halo: (nb, Lh, Lw), L = (block - 1) * stride + kernel."""
        key = (in_height, in_width, *kernel, *stride, *padding)
        if key not in self._windows:
            gw = self.width // self.block
            padded_w = in_width + 2 * padding[1]
            lh = (self.block - 1) * stride[0] + kernel[0]
            lw = (self.block - 1) * stride[1] + kernel[1]
            dev = self.grid.device
            top = (self.blocks // gw) * self.block * stride[0]
            left = (self.blocks % gw) * self.block * stride[1]
            rows = top[:, None] + torch.arange(lh, device=dev)
            cols = left[:, None] + torch.arange(lw, device=dev)
            self._windows[key] = rows[:, :, None] * padded_w + cols[:, None, :]
        return self._windows[key]


    def tap_index(self, in_height: int, in_width: int, kernel: tuple[int, int], stride: tuple[int, int],
                  padding: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """For each active output pixel (token order) and kernel tap (row-major): the flat input pixel id, clamped
        into the map, and a 0/1 validity (None when every tap is inside, i.e. no zero padding is read).
        Returns ((n * kh * kw,) ids, (n * kh * kw,) validity or None)."""
        key = (in_height, in_width, *kernel, *stride, *padding)
        if key not in self._taps:
            dev = self.tokens.device
            rows = (self.tokens // self.width)[:, None] * stride[0] - padding[0] + torch.arange(kernel[0], device=dev)
            cols = (self.tokens % self.width)[:, None] * stride[1] - padding[1] + torch.arange(kernel[1], device=dev)
            rows, cols = rows[:, :, None], cols[:, None, :]
            inside = (rows >= 0) & (rows < in_height) & (cols >= 0) & (cols < in_width)
            ids = rows.clamp(0, in_height - 1) * in_width + cols.clamp(0, in_width - 1)
            valid = None if bool(inside.all()) else inside.flatten()
            self._taps[key] = (ids.flatten(), valid)
        return self._taps[key]


def block_grid(mask: torch.Tensor, height: int, width: int, block: int) -> torch.Tensor:
    """Reduce an (H0, W0) latent mask to the (height / block, width / block) grid of a feature map by max-pooling:
    a block is active when any latent pixel it covers is."""
    h0, w0 = mask.shape
    m = mask[None, None].float()
    if (h0, w0) != (height, width):
        if h0 % height or w0 % width:
            raise ValueError(f"a {height}x{width} feature map does not tile the {h0}x{w0} latent mask; feature maps "
                             "must be the latent size divided by a whole factor")
        m = F.max_pool2d(m, (h0 // height, w0 // width))
    return F.max_pool2d(m, block)[0, 0] > 0.5


def resize_mask(mask: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """A user mask of any size that is a whole multiple (or divisor) of the latent size -> (height, width) bool."""
    if mask.dim() != 2:
        raise ValueError(f"a mask is (H, W), got shape {tuple(mask.shape)}; pass one 2-D boolean map")
    h, w = mask.shape
    m = mask.bool()[None, None].float()
    if h % height == 0 and w % width == 0:
        m = F.max_pool2d(m, (h // height, w // width))
    elif height % h == 0 and width % w == 0:
        m = F.interpolate(m, size=(height, width), mode="nearest")
    else:
        raise ValueError(f"mask of {h}x{w} does not match the {height}x{width} latents: give it at latent size "
                         f"or a whole multiple of it (e.g. the {8 * height}x{8 * width} image)")
    return m[0, 0] > 0.5
