"""Online migration of a running job to a new plan: no restart, no disk.

Every rank (idle ones too) builds its place in the new plan (groups, stage model, DDP, optimizer), then the
reshard engine moves the parameters and Adam's moments from the old layout to the new one by point-to-point
transfers, local copies first. Adam's step count, the LR schedule and the data position carry over, so the run
continues exactly as it would have on the old plan (tests/test_migration.py). fp32 training: with --bf16 the
fp32 master weights would move the same way, but that path is not wired yet.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from hetu_ext.runtime.reshard import Piece, reshard

from .placement import Placement
from .weights import local_shards

_MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class MigrationReport:
    bytes_sent: int
    bytes_kept: int
    seconds: float


def _inner(optimizer):
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]


def _pieces(placement: Placement, *, create_state_at_step: int | None = None) -> list[Piece]:
    """This rank's parameters and Adam moments as reshard pieces (empty on idle ranks)."""
    if not placement.active:
        return []
    states = {}
    for opt in _inner(placement.optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                if create_state_at_step is not None:
                    opt.state[p] = {"step": torch.tensor(float(create_state_at_step)),
                                    **{m: torch.zeros_like(p.data) for m in _MOMENTS}}
                states[id(p)] = opt.state.get(p, {})
    pieces = []
    for s in local_shards(placement.model, **placement.shard_kwargs):
        box = tuple((sl.start, sl.stop) for sl in s.slices)
        pieces.append(Piece(f"param:{s.key}", s.index, box, s.data.data))
        state = states.get(id(s.data), {})
        for m in _MOMENTS:
            if m in state:
                pieces.append(Piece(f"{m}:{s.key}", s.index, box, state[m]))
    return pieces


def migrate(old: Placement, build_new, iteration: int) -> tuple[Placement, MigrationReport]:
    """Build the new placement (``build_new()``, collective) and move the old one's state into it."""
    start = time.perf_counter()
    sources = _pieces(old)
    new = build_new()
    destinations = _pieces(new, create_state_at_step=iteration if iteration > 0 else None)
    report = reshard(sources, destinations)
    return new, MigrationReport(bytes_sent=report.bytes_sent, bytes_kept=report.bytes_copied_locally,
                                seconds=time.perf_counter() - start)


def parse_migrations(text: str) -> list[tuple[int, str]]:
    """``"step=3:plan=a.yaml,step=8:plan=b.yaml"`` -> [(3, "a.yaml"), (8, "b.yaml")] (after step 3, ...)."""
    out = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        fields = dict(kv.split("=", 1) for kv in item.split(":") if "=" in kv)
        if set(fields) != {"step", "plan"} or not fields["step"].isdigit() or int(fields["step"]) < 1:
            raise ValueError(f"--hetu-migrate {item!r}: expected step=N:plan=FILE with N >= 1 (migrate after step "
                             "N), several separated by commas")
        out.append((int(fields["step"]), fields["plan"]))
    steps = [s for s, _ in out]
    if steps != sorted(set(steps)):
        raise ValueError(f"--hetu-migrate: steps must increase, got {steps}")
    return out
