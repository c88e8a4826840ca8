"""The tenants as LobRA's planner sees them (pure): each one's length pool and sequences per step, and the sampled
steps a deployment is evaluated on."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TenantLengths:
    """A tenant as the planner sees it: a pool of its sequence lengths and its sequences per step."""

    name: str
    lengths: np.ndarray
    samples: int


def sample_steps(tenants: Sequence[TenantLengths], *, steps: int, seed: int, max_len: int
                 ) -> list[list[np.ndarray]]:
    """Per step, each tenant's sequence lengths (drawn from its pool, truncated to ``max_len``)."""
    rng = np.random.default_rng(seed)
    return [[np.minimum(rng.choice(t.lengths, size=t.samples), max_len).astype(np.int64) for t in tenants]
            for _ in range(steps)]


def tenant_lengths(tenants, *, seed: int) -> list[TenantLengths]:
    """The planner's view of a tenants file (hetu_ext.config.tenants): each tenant's length pool from its
    ``lengths`` spec and its sequences per step (the mean of a ``samples`` schedule, at least 1)."""
    from hetu_ext.data.lengths import parse_length_spec

    out = []
    for t in tenants:
        if t.lengths is None:
            raise ValueError(f"tenant {t.name!r}: the planner reads sequence lengths from a 'lengths' spec; give one "
                             "that describes its data_path's documents (e.g. {mode: file, path: lengths.txt})")
        if t.samples is None:
            raise ValueError(f"tenant {t.name!r}: the planner needs 'samples' (sequences per step), not 'tokens'")
        lengths = np.asarray(parse_length_spec(dict(t.lengths)).sample(t.documents, seed + t.seed_offset))
        out.append(TenantLengths(t.name, np.maximum(lengths, 1).astype(np.int64),
                                 max(1, round(sum(t.samples) / len(t.samples)))))
    return out
