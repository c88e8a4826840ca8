"""Per-run state the wrappers and hooks consult: phase, step, cache plan, mask and active blocks per map size."""

from __future__ import annotations

import logging

import torch

from hetu_ext.diffusion.cache import CachePlan, CacheUnit, FeatureCache, plan_cache
from hetu_ext.diffusion.config import FISEditConfig
from hetu_ext.diffusion.mask import ActiveSet, block_grid
from hetu_ext.diffusion.sparse_ops import Phase

logger = logging.getLogger(__name__)


class RunState:
    """Implements `StepContext`. One generation fills the cache; each edit reads it."""

    def __init__(self, config: FISEditConfig) -> None:
        self.config = config
        self.group_norm = config.group_norm
        self.conv_kernel = config.conv_kernel
        self.phase: Phase = "off"
        self.step = 0
        self.cache = FeatureCache()
        self.plan: CachePlan | None = None
        self.mask: torch.Tensor | None = None
        self.timesteps: list[float] = []
        self._sizes: dict[str, tuple[int, int]] = {}  # unit -> (bytes, macs) seen at the first recorded step
        self._sets: dict[tuple[int, int], ActiveSet | None] = {}
        self._stat_sets: dict[tuple[int, int], ActiveSet] = {}

    # ---- record (generation) -------------------------------------------------------------------------------
    def start_record(self) -> None:
        self.cache.clear()
        self.plan, self.mask, self.timesteps = None, None, []
        self._sizes.clear()
        self._sets.clear()

    def records_features(self) -> bool:
        """Features are cached only for the steps an edit runs sparse."""
        return self.step >= self.config.dense_steps

    def record(self, unit: str | None, key: str, value: torch.Tensor, macs: int) -> None:
        if self.phase != "record" or not self.records_features():
            return
        if unit is None:
            self.cache.put(self.step, key, value)
            return
        if self.plan is None:  # first recorded step: keep all, sizes decide the plan after the step
            size, total = self._sizes.get(unit, (0, 0))
            self._sizes[unit] = (size + value.numel() * value.element_size(), total + macs)
            self.cache.put(self.step, key, value)
        elif self.plan.has(unit, self.step):
            self.cache.put(self.step, key, value)

    def note_macs(self, unit: str, macs: int) -> None:
        """Add MACs computed outside `record` (attention) to a unit's value at the first recorded step."""
        if self.phase == "record" and self.records_features() and self.plan is None:
            size, total = self._sizes.get(unit, (0, 0))
            self._sizes[unit] = (size, total + macs)

    def finish_record_step(self, total_steps: int) -> None:
        """After the first recorded step: plan the cache for all sparse steps and drop what the plan leaves out."""
        if self.phase != "record" or not self.records_features() or self.plan is not None:
            return
        units = [CacheUnit(name=n, bytes_per_step=b, macs_per_step=m) for n, (b, m) in self._sizes.items()]
        steps = list(range(self.config.dense_steps, total_steps))
        self.plan = plan_cache(units, steps, self.config.cache_budget_bytes)
        for key in self.cache.step_keys(self.step):
            unit = key.rsplit("#", 1)[0]
            if unit in self._sizes and not self.plan.has(unit, self.step):
                self.cache.drop(self.step, key)
        kept = sum(1 for n in self._sizes if self.plan.steps.get(n))
        logger.info("FISEdit cache plan: %d of %d units, %.1f MiB of feature maps for %d sparse steps", kept,
                    len(units), self.plan.total_bytes / 2**20, len(steps))

    # ---- edit ----------------------------------------------------------------------------------------------
    def start_edit(self) -> None:
        assert self.plan is not None or self.config.dense_steps >= len(self.timesteps), "recorded without a plan"
        self.mask = None
        self._sets.clear()

    def set_mask(self, mask: torch.Tensor) -> None:
        self.mask = mask
        self._sets.clear()
        self._stat_sets.clear()

    def _block(self, size: int, height: int, width: int) -> int | None:
        block = min(size, height, width)
        if min(height, width) < self.config.min_sparse_size or height % block or width % block:
            return None
        return block

    def stats_block(self, height: int, width: int) -> int | None:
        """Side of the GroupNorm statistics blocks of a map size, None if that size never runs sparse."""
        if self._block(self.config.block_size, height, width) is None:
            return None
        return self._block(self.config.stats_block_size, height, width)

    def stats_set(self, active: ActiveSet) -> ActiveSet:
        """The statistics blocks that hold any active pixel of `active` (same map size)."""
        key = (active.height, active.width)
        if key not in self._stat_sets:
            block = self.stats_block(*key)
            assert block is not None, "a map that runs sparse has statistics blocks"
            pixels = torch.zeros(active.height * active.width, dtype=torch.bool, device=active.tokens.device)
            pixels[active.tokens] = True
            grid = block_grid(pixels.view(key), *key, block)
            self._stat_sets[key] = ActiveSet(height=key[0], width=key[1], block=block, grid=grid)
        return self._stat_sets[key]

    def active(self, unit: str | None, height: int, width: int) -> ActiveSet | None:
        if self.phase != "sparse" or self.mask is None:
            return None
        if unit is not None and (self.plan is None or not self.plan.has(unit, self.step)):
            return None
        key = (height, width)
        if key not in self._sets:
            self._sets[key] = self._make_set(height, width)
        return self._sets[key]

    def _make_set(self, height: int, width: int) -> ActiveSet | None:
        block = self._block(self.config.block_size, height, width)
        if block is None or self.stats_block(height, width) is None:
            return None
        grid = block_grid(self.mask, height, width, block)
        aset = ActiveSet(height=height, width=width, block=block, grid=grid)
        if aset.fraction > self.config.max_active_fraction:
            logger.info("FISEdit: %dx%d maps run dense (%.0f%% of blocks active > max_active_fraction %.0f%%)",
                        height, width, 100 * aset.fraction, 100 * self.config.max_active_fraction)
            return None
        return aset

    def active_fractions(self) -> dict[str, float]:
        """Per map size that ran sparse in the last edit: the share of its blocks recomputed."""
        return {f"{h}x{w}": s.fraction for (h, w), s in sorted(self._sets.items(), reverse=True) if s is not None}

    def cached(self, key: str, device: torch.device) -> torch.Tensor:
        return self.cache.get(self.step, key, device)
