"""Whose checkpoints a ``--save`` directory holds, and whether a run may save there (pure: files in, a verdict out).

Every checkpoint records the identity of the run that wrote it (``run_id``: the hetu manifest's field, the
``hetu_common.pt`` of a torch_dist save). A run gets a new identity, or keeps the one of the checkpoint it was
resumed from (``--load``), so resuming into the same directory is still the same run. Retention deletes only
the run's own checkpoints. A directory that holds checkpoints of another run (another identity, none, a
Megatron-LM or DeepSpeed checkpoint) is refused for saving unless the user says so (``--hetu-ckpt-reuse-dir``):
the tracker would then name this run's checkpoint and the others would be left behind, never deleted; even
then, this run never saves an iteration that another run's checkpoint holds (that would replace it).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .manifest import MANIFEST
from .storage import LocalStorage
from .writer import ITER_DIR, UNREADABLE, run_of

TORCH_DIST_COMMON = "hetu_common.pt"
"""hetu_ext's side file of a torch_dist checkpoint: iteration, LR schedule, losses, run identity."""
_DEEPSPEED_TAG = re.compile(r".*_optim_states\.pt$|^mp_rank_\d+_model_states\.pt$")


def new_run_id() -> str:
    """A fresh run identity (64 random bits, hex)."""
    return uuid.uuid4().hex[:16]


@dataclass(frozen=True)
class Found:
    """One checkpoint in a directory."""

    name: str
    """Its directory name (``iter_0000010``, ``global_step10``)."""
    kind: str
    """``hetu``, ``torch_dist`` or ``deepspeed``."""
    run_id: str | None
    """The run that wrote it; None when it records none."""
    iteration: int | None
    """Its iteration, for ``iter_NNNNNNN`` directories."""


def torch_dist_run(path: Path) -> str | None:
    """The run identity in a torch_dist checkpoint's ``hetu_common.pt`` (None without one)."""
    import torch

    try:
        return torch.load(path / TORCH_DIST_COMMON, weights_only=True).get("run_id")
    except Exception:  # noqa: BLE001 - a missing or unreadable side file: a checkpoint of no known run
        return None


def checkpoints_in(directory: str | Path) -> list[Found]:
    """Every checkpoint directly under ``directory``: committed hetu ones (a corrupt manifest is no run's and is
    left out), torch_dist ones (Megatron-LM's or hetu_ext's) and DeepSpeed tags."""
    root = Path(directory)
    if not root.is_dir():
        return []
    storage = LocalStorage(root)
    out = []
    for child in sorted(p for p in root.iterdir() if p.is_dir()):
        m = ITER_DIR.match(child.name)
        if m and (child / MANIFEST).is_file():
            run = run_of(storage, int(m.group(1)))
            if run != UNREADABLE:
                out.append(Found(child.name, "hetu", run, int(m.group(1))))
        elif m and ((child / "metadata.json").is_file() or (child / "common.pt").is_file()):
            out.append(Found(child.name, "torch_dist", torch_dist_run(child), int(m.group(1))))
        elif any(_DEEPSPEED_TAG.match(f.name) for f in child.iterdir()):
            out.append(Found(child.name, "deepspeed", None, None))
    return out


def planned_saves(start: int, train_iters: int, save_interval: int | None) -> set[int]:
    """Iterations a run from ``start`` saves: every multiple of ``save_interval`` after ``start`` up to
    ``train_iters``, and the last one."""
    out = set(range((start // save_interval + 1) * save_interval, train_iters + 1, save_interval)) \
        if save_interval else set()
    end = max(start, train_iters)
    if not save_interval or end % save_interval:
        out.add(end)
    return out


def _describe(found: Iterable[Found]) -> str:
    by_run: dict[str, list[str]] = {}
    for f in found:
        label = f"run {f.run_id}" if f.run_id else f"{f.kind}, no run identity"
        by_run.setdefault(label, []).append(f.name)
    return "; ".join(f"{', '.join(names[:3])}{f' and {len(names) - 3} more' if len(names) > 3 else ''} "
                     f"({label})" for label, names in by_run.items())


def check_save_dir(directory: str, run_id: str, *, resumed: bool, reuse: bool,
                   planned: set[int]) -> tuple[str | None, list[Found]]:
    """(the one-line refusal, or None; the other runs' checkpoints) for a run ``run_id`` saving into
    ``directory`` the iterations ``planned``. ``resumed``: the identity came from ``--load``."""
    foreign = [f for f in checkpoints_in(directory) if f.run_id != run_id]
    if not foreign:
        return None, []
    who = f"this run (run {run_id}, resumed by --load)" if resumed else f"this new run (run {run_id})"
    if not reuse:
        return (f"--save {directory} holds checkpoints of another run ({_describe(foreign)}) and {who} would "
                "save beside them (its tracker would hide them from --load); save into an empty directory, "
                "continue that run with --load on this directory, or pass --hetu-ckpt-reuse-dir to save here "
                "anyway, keeping them untouched"), foreign
    clash = [f for f in foreign if f.iteration in planned]
    if clash:
        return (f"--save {directory}: {who} would save iteration(s) {sorted(f.iteration for f in clash)}, which "
                f"another run's checkpoints hold ({_describe(clash)}); --hetu-ckpt-reuse-dir never replaces "
                "them: save into another directory"), foreign
    return None, foreign
