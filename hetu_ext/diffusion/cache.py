"""The generation's cache: what sparse steps reuse, kept on the host, with a byte budget and GPU prefetch.

A *unit* is what is cached or not as one piece: one convolution's output, or one Transformer2D's projected output
(with its self-attention keys/values when they are cached). A unit missing at a step runs dense at that step, which
is always valid because every tensor between units stays full-size (fresh on active blocks, cached elsewhere).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheUnit:
    """One cacheable piece and what caching it buys."""

    name: str
    bytes_per_step: int
    macs_per_step: int
    """MACs of the unit's dense computation in one step: the most a sparse step can save by caching it."""


@dataclass(frozen=True)
class CachePlan:
    """Which units are cached at which steps; everything else runs dense."""

    steps: dict[str, frozenset[int]]
    total_bytes: int

    def has(self, unit: str, step: int) -> bool:
        return step in self.steps.get(unit, frozenset())


def plan_cache(units: list[CacheUnit], steps: list[int], budget_bytes: int | None) -> CachePlan:
    """Pure: the units with the most MACs saved per byte first, each for every sparse step while the budget lasts;
    the first unit that does not fit gets its earliest steps that do, then planning stops (later units with fewer
    MACs per byte are not better value)."""
    ordered = sorted(units, key=lambda u: (-u.macs_per_step / max(u.bytes_per_step, 1), u.name))
    chosen: dict[str, frozenset[int]] = {}
    total = 0
    for unit in ordered:
        if budget_bytes is None or total + unit.bytes_per_step * len(steps) <= budget_bytes:
            chosen[unit.name] = frozenset(steps)
            total += unit.bytes_per_step * len(steps)
            continue
        room = (budget_bytes - total) // max(unit.bytes_per_step, 1)
        if room > 0:
            chosen[unit.name] = frozenset(steps[:room])
            total += unit.bytes_per_step * room
        break
    return CachePlan(steps=chosen, total_bytes=total)


class FeatureCache:
    """Tensors by (step, key), stored on the host (pinned when the model is on a GPU); `prefetch(step)` copies a
    step to the device on a side stream so the copy overlaps the previous step's compute."""

    def __init__(self) -> None:
        self._host: dict[int, dict[str, torch.Tensor]] = {}
        self._device: dict[int, dict[str, torch.Tensor]] = {}
        self._events: dict[int, torch.cuda.Event] = {}
        self._stream: torch.cuda.Stream | None = None

    def clear(self) -> None:
        self._host.clear()
        self._device.clear()
        self._events.clear()

    def put(self, step: int, key: str, value: torch.Tensor) -> None:
        """Keep a copy of `value` (never the live tensor: later in-place updates must not reach the cache)."""
        if value.is_cuda:
            host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            host.copy_(value, non_blocking=True)
        else:
            host = value.detach().clone()
        self._host.setdefault(step, {})[key] = host

    def drop(self, step: int, key: str) -> None:
        self._host.get(step, {}).pop(key, None)

    def has(self, step: int, key: str) -> bool:
        return key in self._host.get(step, {})

    def get(self, step: int, key: str, device: torch.device) -> torch.Tensor:
        """The cached tensor on `device`. On the host it is the stored tensor itself: callers must not modify it."""
        if device.type != "cuda":
            return self._host[step][key]
        if step not in self._device:
            self.prefetch(step, device)
        event = self._events.pop(step, None)
        if event is not None:
            torch.cuda.current_stream(device).wait_event(event)
        return self._device[step][key]

    def prefetch(self, step: int, device: torch.device) -> None:
        """Start copying one step's tensors to a CUDA device; a no-op on the host or for an unknown step."""
        if device.type != "cuda" or step not in self._host or step in self._device:
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        with torch.cuda.stream(self._stream):
            self._device[step] = {k: v.to(device, non_blocking=True) for k, v in self._host[step].items()}
            event = torch.cuda.Event()
            event.record(self._stream)
        self._events[step] = event

    def release(self, step: int) -> None:
        """Free a step's device copies once the step is done."""
        self._device.pop(step, None)
        self._events.pop(step, None)

    @property
    def nbytes(self) -> int:
        """Bytes held on the host."""
        return sum(t.numel() * t.element_size() for entries in self._host.values() for t in entries.values())

    def step_keys(self, step: int) -> list[str]:
        return list(self._host.get(step, {}))
