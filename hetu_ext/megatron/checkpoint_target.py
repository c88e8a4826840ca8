"""What a save or a load works on (:class:`CheckpointTarget`), and whose checkpoints a run writes.

A format (checkpointing.py: hetu's; torch_dist_io.py: Megatron-core's dist_checkpointing) takes a
:class:`CheckpointTarget`: this rank's checkpoint parts (hetu_ext.checkpoint.parts.Checkpointable: the tensors and
values it saves and restores) and where the rank stands (the run's configuration, the plan, the host, the
placement whose model and optimizer Megatron's own format reads, the iteration). The trainer builds one for each
save and load (hetu_ext.train.trainer.Trainer.checkpoint_target); nothing here reads or writes the trainer.

**Whose checkpoints** (hetu_ext/checkpoint/ownership.py): a run keeps the identity of the checkpoint it resumed
from, or gets a new one (:func:`prepare_save`); every checkpoint records it, retention deletes only the run's
own, and a ``--save`` directory holding another run's checkpoints is refused before training unless
``--hetu-ckpt-reuse-dir``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hetu_ext.checkpoint import CheckpointError
from hetu_ext.checkpoint.ownership import check_save_dir, new_run_id, planned_saves
from hetu_ext.checkpoint.parts import Checkpointable
from hetu_ext.config import RunConfig
from hetu_ext.plan import Plan

from .host import Host
from .placement import Placement

logger = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"


@dataclass
class CheckpointTarget:
    """One rank's training state as a save or a load sees it (built anew for each: the placement changes on a
    migration, the iteration every step)."""

    parts: list[Checkpointable]
    """What is saved and restored, in restore order (hetu_ext/train/parts.py; a plug-in's own)."""
    config: RunConfig
    plan: Plan
    host: Host
    placement: Placement
    """This rank's placement: its report group (the ranks that save), and the model and optimizer Megatron's
    own format (torch_dist) reads through their ``sharded_state_dict``."""
    iteration: int
    log_rank: int
    """The rank that logs (the plan's lowest used rank)."""
    consumed_samples: int | None = None
    """Samples the run has consumed (the manifest's ``consumed_samples``, read by Megatron-LM's loop); None:
    not counted in samples (packed documents, a plug-in's data)."""
    formats: tuple = ()
    """Other frameworks' checkpoints ``--load`` reads (:class:`~hetu_ext.megatron.checkpointing.TrainerCheckpoints`:
    DeepSpeed ZeRO's)."""
    hetu_only: str | None = None
    """Why the parts save and load hetu's format only (a plug-in's parts: LoRA's adapters), or None."""
    label: str = "checkpoint"
    """What the log lines call a checkpoint of these parts (``adapters checkpoint``)."""

    @property
    def rank(self) -> int:
        return self.host.rank


# ---------------------------------------------------------------- run identity and the --save directory

_RUNS: dict[str, str | None] = {}
"""Save directory (absolute) -> this run's identity, decided once by :func:`prepare_save`."""
_LOADED_RUN: dict[str, str | None] = {}
"""Load directory (absolute) -> the run identity of the checkpoint loaded from it (None: it records none)."""


def _group_src(group) -> int:
    return 0 if group is None else dist.get_global_rank(group, 0)


def run_of(target: CheckpointTarget, directory: str, group=None) -> str | None:
    """This run's identity for saves into ``directory``: decided by :func:`prepare_save` (now, collective over
    ``group``, if it was not yet)."""
    key = os.path.abspath(directory)
    return _RUNS[key] if key in _RUNS else prepare_save(target, directory, group)


def prepare_save(target: CheckpointTarget, directory: str, group=None) -> str | None:
    """This run's identity, and the check that it may save into ``directory``; before training, after any load
    (collective over ``group``, default every rank: its rank 0 decides, every rank raises the same one-line
    :class:`CheckpointError`).

    The identity is the loaded checkpoint's, so that a resumed run stays the same run (a checkpoint that records
    none, resumed in place, keeps none); otherwise rank 0 makes a new one."""
    decision: list = [None, None]
    if dist.get_rank(group) == 0:
        try:
            decision = _decide_save(target, directory)
        except Exception as e:  # noqa: BLE001 - every rank must learn of rank 0's failure, not wait for it
            decision = [None, f"--save {directory}: cannot check the directory ({type(e).__name__}: {e})"]
    dist.broadcast_object_list(decision, src=_group_src(group), group=group)
    run_id, error = decision
    if error is not None:
        raise CheckpointError(error)
    _RUNS[os.path.abspath(directory)] = run_id
    return run_id


def _decide_save(target: CheckpointTarget, directory: str) -> list[Any]:
    ckpt = target.config.checkpoint
    load = os.path.abspath(ckpt.load) if ckpt.load else None
    resumed = load in _LOADED_RUN
    run_id = _LOADED_RUN.get(load) if resumed else None
    if run_id is None and not (resumed and load == os.path.abspath(directory)):
        run_id, resumed = new_run_id(), False
    planned = planned_saves(target.iteration, target.config.training.train_iters, ckpt.save_interval)
    error, foreign = check_save_dir(directory, run_id, resumed=resumed, reuse=ckpt.reuse_dir, planned=planned)
    if foreign and error is None:
        logger.warning("--save %s: %d checkpoint(s) of other runs stay untouched beside this run's "
                       "(--hetu-ckpt-reuse-dir): %s", directory, len(foreign), ", ".join(f.name for f in foreign))
    return [run_id, error]


def note_loaded_run(directory: str, run_id: str | None) -> None:
    """Record that this run resumed from a checkpoint of run ``run_id`` under ``directory`` (its saves keep it)."""
    _LOADED_RUN[os.path.abspath(directory)] = run_id


def latest_iteration(directory: str) -> int | None:
    """The iteration ``DIR/latest_checkpointed_iteration.txt`` names (None: no tracker)."""
    tracker = Path(directory) / TRACKER
    if not tracker.exists():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{tracker}: expected an iteration number, found {text!r}; fix or delete the file")
    return int(text)
