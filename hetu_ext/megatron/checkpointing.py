"""``--save`` / ``--load``: hetu_ext's layout-agnostic format (default) or Megatron-core's ``dist_checkpointing``.

**hetu** (``--hetu-ckpt-format hetu``, hetu_ext/checkpoint/): every rank's parameters, fp32 master weights (with
``--bf16`` or ``--fp16``) and Adam moments become pieces with global offsets; each unique element is written once,
spread over its holders, after a short blocking copy to host memory, while training goes on; the commit is atomic
and ``latest_checkpointed_iteration.txt`` moves only after it. Loading reshards the stored pieces into the running
plan, whatever it is (another TP / PP / DP, heterogeneous pipelines, another rank count), on either runtime. The
manifest also keeps Adam's step, the LR schedule, the ``--fp16`` loss scaler's state, the losses so far, the data
position (the iteration, from which both the unpacked and the packed data derive each step's samples, plus consumed
samples and the settings that fix the samples: global batch, seed, sequence length, split, packing; a resume that
changes them is refused) and each rank's RNG states (restored when the plan is the same; under another plan ranks
have no counterpart, so each keeps the RNG its seed gives).

**torch_dist** (Megatron-LM's layout, saved on the uniform runtime only): torch_dist_io.py.

``auto`` (the default) saves hetu, except with ``--use-distributed-optimizer`` on Megatron's uniform runtime, where
it saves torch_dist as Megatron-LM does; ``--hetu-ckpt-format hetu`` saves ZeRO-1's flat ranges as pieces there
(hetu_ext/megatron/distopt_state.py, the format Megatron-LM's loop writes under it), which load into any plan and
any optimizer, and a hetu checkpoint loads into ZeRO-1's ranges. ``--load`` recognises either format by its files.

**What is saved** is a :class:`~hetu_ext.megatron.checkpoint_target.CheckpointTarget`'s parts
(hetu_ext.checkpoint.parts.Checkpointable): their pieces are the tensors, their values the manifest's ``state``
(the per-rank RNG in its per-rank section); a load fills their destinations and restores them in order, the same
for every format (another framework's reader fills the model's and optimizer's pieces itself and returns a
:class:`~hetu_ext.megatron.state.RunState`). Whose checkpoints a run writes: checkpoint_target.py.
The LR schedule of a checkpoint is restored by Megatron-LM's rule (hetu_ext/checkpoint/schedule.py): a setting
that differs from the flags is an error unless ``--override-opt_param-scheduler`` or
``--use-checkpoint-opt_param-scheduler`` says which wins.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from hetu_ext.checkpoint import CheckpointError, LocalStorage
from hetu_ext.checkpoint.load import load_pieces
from hetu_ext.checkpoint.manifest import MANIFEST, Manifest
from hetu_ext.checkpoint.parts import PER_RANK, load_destinations, restore_parts, saved_pieces, state_record
from hetu_ext.checkpoint.writer import Checkpointer, SaveConfig, checkpoint_name
from hetu_ext.plan import plan_to_dict
from hetu_ext.runtime.reshard import Piece

from .checkpoint_target import (
    CheckpointTarget,
    latest_iteration,
    note_loaded_run,
    prepare_save,
    run_of,
)
from .distopt_state import distributed_optimizers, params_match_masters
from .launch_plan import save_format
from .state import RunState
from .torch_dist_io import load_torch_dist, load_torch_dist_resharded, save_torch_dist
from .weights import local_shards

__all__ = ["CheckpointTarget", "TrainerCheckpoints", "load", "load_hetu", "prepare_save", "save", "save_hetu"]

logger = logging.getLogger(__name__)

_CHECKPOINTERS: dict[str, Checkpointer] = {}
"""One asynchronous checkpointer per save directory in this process (its background save outlives a call)."""


# ---------------------------------------------------------------- hetu format


def _json_safe(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    return str(value)


def _checkpointer(target: CheckpointTarget, directory: str) -> Checkpointer:
    key = os.path.abspath(directory)
    if key not in _CHECKPOINTERS:
        run_id = run_of(target, directory, target.placement.report_group)
        Path(key).mkdir(parents=True, exist_ok=True)
        _CHECKPOINTERS[key] = Checkpointer(LocalStorage(key), SaveConfig(keep=target.config.checkpoint.keep,
                                                                         run_id=run_id))
    return _CHECKPOINTERS[key]


def save_hetu(target: CheckpointTarget, directory: str, *, blocking: bool) -> Checkpointer:
    """Collective over the plan's used ranks: snapshot the parts now, write in the background unless
    ``blocking`` (the last save of a run blocks, so it is committed before the job exits: :func:`save`)."""
    state = state_record(target.parts)
    rng = state.pop(PER_RANK, None)
    info = {"consumed_samples": target.consumed_samples, "plan": plan_to_dict(target.plan),
            "config": _json_safe(target.config.to_flat_dict()), "state": _json_safe(state)}
    ckpt = _checkpointer(target, directory)
    ckpt.save(iteration=target.iteration, pieces=saved_pieces(target.parts), rng=rng, info=info,
              group=target.placement.report_group, blocking=blocking)
    if target.rank == target.log_rank:
        logger.info("%s of iteration %d: %.1f ms blocking, %.2f MiB on this rank (%s)", target.label,
                    target.iteration, ckpt.last["blocking_s"] * 1e3, ckpt.last["bytes"] / 2**20,
                    "committed" if blocking else "persisting in the background")
    return ckpt


def saved_rng(target: CheckpointTarget, manifest: Manifest) -> dict | None:
    """This rank's RNG states in a hetu checkpoint when it was saved under the running plan; else None (the seed
    sets them: ranks of another plan have no saved counterpart), logged once."""
    if manifest.plan == plan_to_dict(target.plan):
        return next((r for r in manifest.rng.values() if r.get("rank") == target.rank), None)
    if target.rank == 0:
        logger.info("the plan differs from the saved one: %sRNG states stay as the seed sets them",
                    "" if target.label == "checkpoint" else f"{target.label}'s tensors resharded; ")
    return None


def load_hetu(target: CheckpointTarget, directory: str) -> RunState:
    """Collective over every rank (idle ones take part with nothing to fill): the parts' tensors into this plan;
    returns the rest of the checkpoint's state."""
    storage = LocalStorage(directory)
    config = target.config.checkpoint

    def destinations(manifest: Manifest) -> list[Piece]:
        kinds = {t.name.split("/", 1)[0] for t in manifest.tensors}
        return load_destinations(target.parts, manifest.state, kinds)

    report = load_pieces(storage, destinations, fallback=config.fallback, read=config.read)
    manifest = report.manifest
    rng = saved_rng(target, manifest)
    if target.rank == 0:
        logger.info("loaded %s of iteration %d from %s (%.2f MiB mapped by rank 0, %.2f s)%s", target.label,
                    manifest.iteration, directory, report.bytes_read / 2**20, report.seconds,
                    "".join(f"; skipped: {s}" for s in report.skipped))
    state = manifest.state
    return RunState(iteration=manifest.iteration, source=f"checkpoint iteration {manifest.iteration}",
                    losses=state.get("losses", []), scheduler=state.get("scheduler"), data=state.get("data"),
                    run_id=manifest.run_id, rng=rng, assumed=state.get("assumed"),
                    grad_scaler=state.get("grad_scaler"), extra=dict(state))


def _check_zero1_params(target: CheckpointTarget, where: str) -> None:
    """Under Megatron's ZeRO-1 (--use-distributed-optimizer, uniform runtime) the loaded half-precision
    parameters must be the loaded fp32 masters rounded, as Megatron keeps them after every step (a checkpoint
    mixing two training states is refused in one line on every rank). Collective over the DP groups."""
    placement = target.placement
    if not placement.active or not distributed_optimizers(placement.optimizer):
        return
    problem = params_match_masters(placement, local_shards(placement.model, **placement.shard_kwargs))
    flag = torch.tensor([1 if problem else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if int(flag):
        raise CheckpointError(f"{where}: {problem or 'on another rank, the parameters are not the masters rounded'}"
                              "; its param/ and master/ tensors are of different training states: load another "
                              "checkpoint")


# ---------------------------------------------------------------- dispatch


def save(target: CheckpointTarget, directory: str) -> bool:
    """Save in the format of ``--hetu-ckpt-format`` (collective over the plan's used ranks); True when the save
    goes on in the background after this returns."""
    if target.hetu_only or save_format(target.config.checkpoint, target.config.parallel) == "hetu":
        blocking = target.iteration >= target.config.training.train_iters
        save_hetu(target, directory, blocking=blocking)
        return not blocking
    save_torch_dist(target, directory)
    return False


def _is_hetu(directory: str) -> bool:
    """The checkpoint the tracker names is a hetu one (without a tracker: some committed one is)."""
    root = Path(directory)
    iteration = latest_iteration(directory)
    if iteration is not None:
        return (root / checkpoint_name(iteration) / MANIFEST).exists()
    return any(root.glob(f"iter_*/{MANIFEST}"))


class TrainerCheckpoints(Protocol):
    """Another framework's checkpoints as the trainer's ``--load`` reads them (DeepSpeed ZeRO's:
    hetu_ext/deepspeed/zero_checkpoint.py), given to the trainer where the command line is read (hetu_ext/cli)."""

    name: str

    def recognises(self, path: str) -> bool:
        """Whether ``path`` holds a checkpoint of this format (file names only)."""
        ...

    def load_into(self, target: CheckpointTarget, path: str) -> RunState:
        """The checkpoint into the target's plan (collective): its model's and optimizer's pieces
        (hetu_ext.megatron.state.state_pieces) filled; the run state the parts restore."""
        ...


def load(target: CheckpointTarget, directory: str) -> bool:
    """Load the latest checkpoint under ``directory`` (hetu, torch_dist, or one of ``target.formats``: DeepSpeed
    ZeRO) and restore the target's parts from it; False if there is none."""
    foreign = next((f for f in target.formats if f.recognises(directory)), None)
    hetu = foreign is None and _is_hetu(directory)
    plan_runtime = target.placement.grad_sync is not None or not target.placement.active
    # the plan runtime's sharded optimizer and Megatron's ZeRO-1 (its flat ranges as boxes: distopt_state.py) load
    # per-parameter state through the reshard engine (state_pieces); another framework's reader is not checked so
    if target.config.parallel.use_distributed_optimizer and foreign and not plan_runtime:
        raise CheckpointError(f"--load {directory}: a {foreign.name} checkpoint into --use-distributed-optimizer's "
                              "flat ZeRO-1 buffers is not supported; resume without --use-distributed-optimizer, "
                              "or with --hetu-runtime plan")
    if not hetu and latest_iteration(directory) is None and foreign is None:
        if target.rank == 0:
            logger.warning("--load %s: no checkpoint found, starting from scratch", directory)
        return False
    if not hetu and target.hetu_only:
        raise CheckpointError(f"--load {directory}: the latest checkpoint there is not in hetu's format, the only "
                              f"one {target.hetu_only}; give the --save directory of such a run")
    if foreign is not None:
        state = foreign.load_into(target, directory)
    elif hetu:
        state = load_hetu(target, directory)
        _check_zero1_params(target, f"--load {directory} (iteration {state.iteration})")
    elif plan_runtime:
        state = load_torch_dist_resharded(target, directory)
    else:
        state = load_torch_dist(target, directory)
    restore_parts(target.parts, state.record(), state.source)  # every format: the same checks and restoration
    note_loaded_run(directory, state.run_id)
    return True
