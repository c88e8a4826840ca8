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

**torch_dist** (Megatron-LM's layout, uniform runtime only): ``DIR/iter_0000004/`` with Megatron's shards and
``hetu_common.pt``, written into ``DIR/.tmp_iter_0000004_<token>/`` and renamed by rank 0 once every rank
finished (a failed save never leaves a folder that looks like a checkpoint); the tracker moves last. With
``--use-distributed-optimizer`` the optimizer state is saved as Megatron-LM saves it (``dp_reshardable``: each
rank's flat ZeRO-1 buckets; it loads into the same TP and PP sizes, any data-parallel size).

``auto`` (the default) saves hetu, except with ``--use-distributed-optimizer`` on Megatron's uniform runtime, where
it saves torch_dist as Megatron-LM does; ``--hetu-ckpt-format hetu`` saves ZeRO-1's flat ranges as pieces there
(hetu_ext/megatron/distopt_state.py, the format Megatron-LM's loop writes under it), which load into any plan and
any optimizer, and a hetu checkpoint loads into ZeRO-1's ranges. ``--load`` recognises either format by its files.

**Whose checkpoints** (hetu_ext/checkpoint/ownership.py): a run keeps the identity of the checkpoint it resumed
from, or gets a new one; every checkpoint records it, retention deletes only the run's own, and a ``--save``
directory holding another run's checkpoints is refused before training unless ``--hetu-ckpt-reuse-dir``.
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
from hetu_ext.checkpoint.ownership import (
    TORCH_DIST_COMMON,
    check_save_dir,
    checkpoints_in,
    new_run_id,
    planned_saves,
)
from hetu_ext.checkpoint.writer import Checkpointer, SaveConfig, checkpoint_name, remove_leftovers
from hetu_ext.plan import plan_to_dict
from hetu_ext.runtime.reshard import Piece

from .launch_plan import save_format
from .distopt_state import distributed_optimizers, params_match_masters
from .state import (
    MOMENTS,
    RunState,
    create_optimizer_state,
    optimizers,
    restore,
    rng_state,
    run_state,
    state_pieces,
)
from .weights import local_shards

logger = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
_CHECKPOINTERS: dict[str, Checkpointer] = {}
"""One asynchronous checkpointer per save directory in this process (its background save outlives a call)."""


# ---------------------------------------------------------------- RNG states


# ---------------------------------------------------------------- hetu format


def _json_safe(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    return str(value)


def _checkpointer(trainer, directory: str) -> Checkpointer:
    key = os.path.abspath(directory)
    if key not in _CHECKPOINTERS:
        run_id = _RUNS[key] if key in _RUNS else prepare_save(trainer, directory, trainer.placement.report_group)
        Path(key).mkdir(parents=True, exist_ok=True)
        keep = trainer.config.checkpoint.keep
        _CHECKPOINTERS[key] = Checkpointer(LocalStorage(key), SaveConfig(keep=keep, run_id=run_id))
    return _CHECKPOINTERS[key]


# ---------------------------------------------------------------- run identity and the --save directory

_RUNS: dict[str, str | None] = {}
"""Save directory (absolute) -> this run's identity, decided once by :func:`prepare_save`."""
_LOADED_RUN: dict[str, str | None] = {}
"""Load directory (absolute) -> the run identity of the checkpoint loaded from it (None: it records none)."""


def _group_src(group) -> int:
    return 0 if group is None else dist.get_global_rank(group, 0)


def prepare_save(trainer, directory: str, group=None) -> str | None:
    """This run's identity, and the check that it may save into ``directory``; before training, after any load
    (collective over ``group``, default every rank: its rank 0 decides, every rank raises the same one-line
    :class:`CheckpointError`).

    The identity is the loaded checkpoint's, so that a resumed run stays the same run (a checkpoint that records
    none, resumed in place, keeps none); otherwise rank 0 makes a new one."""
    decision: list = [None, None]
    if dist.get_rank(group) == 0:
        try:
            decision = _decide_save(trainer, directory)
        except Exception as e:  # noqa: BLE001 - every rank must learn of rank 0's failure, not wait for it
            decision = [None, f"--save {directory}: cannot check the directory ({type(e).__name__}: {e})"]
    dist.broadcast_object_list(decision, src=_group_src(group), group=group)
    run_id, error = decision
    if error is not None:
        raise CheckpointError(error)
    _RUNS[os.path.abspath(directory)] = run_id
    return run_id


def _decide_save(trainer, directory: str) -> list:
    ckpt = trainer.config.checkpoint
    load = os.path.abspath(ckpt.load) if ckpt.load else None
    resumed = load in _LOADED_RUN
    run_id = _LOADED_RUN.get(load) if resumed else None
    if run_id is None and not (resumed and load == os.path.abspath(directory)):
        run_id, resumed = new_run_id(), False
    planned = planned_saves(trainer.iteration, trainer.config.training.train_iters, ckpt.save_interval)
    error, foreign = check_save_dir(directory, run_id, resumed=resumed, reuse=ckpt.reuse_dir, planned=planned)
    if foreign and error is None:
        logger.warning("--save %s: %d checkpoint(s) of other runs stay untouched beside this run's "
                       "(--hetu-ckpt-reuse-dir): %s", directory, len(foreign), ", ".join(f.name for f in foreign))
    return [run_id, error]


# --- LobRA checkpoints (issue 16): hetu_ext.lora saves its adapters' own pieces through these ---
def checkpointer_of(trainer, directory: str) -> Checkpointer:
    """The run's asynchronous checkpointer of ``directory`` (one per directory in this process)."""
    return _checkpointer(trainer, directory)


def note_loaded_run(directory: str, run_id: str | None) -> None:
    """Record that this run resumed from a checkpoint of run ``run_id`` under ``directory`` (its saves keep it)."""
    _LOADED_RUN[os.path.abspath(directory)] = run_id
# --- end LobRA checkpoints (issue 16) ---


def save_hetu(trainer, directory: str, *, blocking: bool) -> Checkpointer:
    """Collective over the plan's used ranks: snapshot now, write in the background unless ``blocking`` (the
    last save of a run blocks, so it is committed before the job exits: :func:`save`)."""
    placement = trainer.placement
    state = run_state(trainer)
    packed = state["data"]["packing"] not in (None, "off")
    ramp = getattr(trainer, "ramp", None)
    consumed = trainer.iteration * state["data"]["global_batch_size"] if ramp is None else \
        ramp.consumed(trainer.iteration)
    info = {"consumed_samples": None if packed else consumed,
            "plan": plan_to_dict(trainer.plan), "config": _json_safe(trainer.config.to_flat_dict()),
            "state": _json_safe(state)}
    ckpt = _checkpointer(trainer, directory)
    ckpt.save(iteration=trainer.iteration, pieces=state_pieces(placement), rng=rng_state(trainer.host.rank),
              info=info, group=placement.report_group, blocking=blocking)
    if trainer.host.rank == trainer.log_rank:
        logger.info("checkpoint of iteration %d: %.1f ms blocking, %.2f MiB on this rank (%s)", trainer.iteration,
                    ckpt.last["blocking_s"] * 1e3, ckpt.last["bytes"] / 2**20,
                    "committed" if blocking else "persisting in the background")
    return ckpt


def saved_rng(trainer, manifest: Manifest, *, note: str = "") -> dict | None:
    """This rank's RNG states in a hetu checkpoint when it was saved under the running plan; else None (the seed
    sets them: ranks of another plan have no saved counterpart), logged once with ``note`` before the reason."""
    if manifest.plan == plan_to_dict(trainer.plan):
        return next((r for r in manifest.rng.values() if r.get("rank") == trainer.host.rank), None)
    if trainer.host.rank == 0:
        logger.info("the plan differs from the saved one: %sRNG states stay as the seed sets them", note)
    return None


def load_hetu(trainer, directory: str) -> RunState:
    """Collective over every rank (idle ones take part with nothing to fill): the tensors into this plan; returns
    the rest of the checkpoint's state."""
    storage = LocalStorage(directory)
    placement = trainer.placement
    fallback = trainer.config.checkpoint.fallback

    def destinations(manifest: Manifest) -> list[Piece]:
        kinds = {t.name.split("/", 1)[0] for t in manifest.tensors}
        step = manifest.state.get("optimizer_step")
        moments = {m for m in MOMENTS if m in kinds} if step is not None else None
        return state_pieces(placement, moments=moments, step=step)

    report = load_pieces(storage, destinations, fallback=fallback, read=trainer.config.checkpoint.read)
    manifest = report.manifest
    rng = saved_rng(trainer, manifest)
    if trainer.host.rank == 0:
        logger.info("loaded checkpoint of iteration %d from %s (%.2f MiB mapped by rank 0, %.2f s)%s",
                    manifest.iteration, directory, report.bytes_read / 2**20, report.seconds,
                    "".join(f"; skipped: {s}" for s in report.skipped))
    state = manifest.state
    return RunState(iteration=manifest.iteration, source=f"checkpoint iteration {manifest.iteration}",
                    losses=state.get("losses", []), scheduler=state.get("scheduler"), data=state.get("data"),
                    run_id=manifest.run_id, rng=rng, assumed=state.get("assumed"),
                    grad_scaler=state.get("grad_scaler"))


def _check_zero1_params(trainer, where: str) -> None:
    """Under Megatron's ZeRO-1 (--use-distributed-optimizer, uniform runtime) the loaded half-precision
    parameters must be the loaded fp32 masters rounded, as Megatron keeps them after every step (a checkpoint
    mixing two training states is refused in one line on every rank). Collective over the DP groups."""
    placement = trainer.placement
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


def save(trainer, directory: str) -> bool:
    """Save in the format of ``--hetu-ckpt-format`` (collective over the plan's used ranks); True when the save
    goes on in the background after this returns."""
    if save_format(trainer.config.checkpoint, trainer.config.parallel) == "hetu":
        blocking = trainer.iteration >= trainer.config.training.train_iters
        save_hetu(trainer, directory, blocking=blocking)
        return not blocking
    save_torch_dist(trainer, directory)
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

    def load_into(self, trainer, path: str) -> RunState:
        """The checkpoint into the trainer's plan (collective); the run state :func:`restore` takes."""
        ...


def load(trainer, directory: str) -> bool:
    """Load the latest checkpoint under ``directory`` (hetu, torch_dist, or one of ``trainer.checkpoint_formats``:
    DeepSpeed ZeRO); False if there is none."""
    foreign = next((f for f in trainer.checkpoint_formats if f.recognises(directory)), None)
    hetu = foreign is None and _is_hetu(directory)
    plan_runtime = trainer.placement.grad_sync is not None or not trainer.placement.active
    # the plan runtime's sharded optimizer and Megatron's ZeRO-1 (its flat ranges as boxes: distopt_state.py) load
    # per-parameter state through the reshard engine (state_pieces); another framework's reader is not checked so
    if trainer.config.parallel.use_distributed_optimizer and foreign and not plan_runtime:
        raise CheckpointError(f"--load {directory}: a {foreign.name} checkpoint into --use-distributed-optimizer's "
                              "flat ZeRO-1 buffers is not supported; resume without --use-distributed-optimizer, "
                              "or with --hetu-runtime plan")
    if foreign is not None:
        state = foreign.load_into(trainer, directory)
    elif hetu:
        state = load_hetu(trainer, directory)
        _check_zero1_params(trainer, f"--load {directory} (iteration {state.iteration})")
    elif latest_iteration(directory) is None:
        if trainer.host.rank == 0:
            logger.warning("--load %s: no checkpoint found, starting from scratch", directory)
        return False
    elif plan_runtime:
        state = load_torch_dist_resharded(trainer, directory)
    else:
        state = load_torch_dist(trainer, directory)
    restore(trainer, state)  # every format: the same checks, the same restoration
    _LOADED_RUN[os.path.abspath(directory)] = state.run_id
    return True


def load_torch_dist_resharded(trainer, directory: str) -> RunState:
    """A dist_checkpointing checkpoint into any plan (collective over every rank): its global tensors are read
    once each and resharded into this plan's layout (hetu_ext/checkpoint/torch_dist.py)."""
    from hetu_ext.checkpoint.torch_dist import load_resharded

    iteration = latest_iteration(directory)
    path = Path(directory) / f"iter_{iteration:07d}"
    common = torch.load(path / "common.pt", weights_only=False)
    sharding = (common.get("content_metadata") or {}).get("distrib_optim_sharding_type")
    if sharding is not None:
        raise CheckpointError(f"{path} was saved with --use-distributed-optimizer ({sharding}: ZeRO-1's flat "
                              "buffers), which loads only on Megatron's uniform runtime with the same TP and PP "
                              "sizes; resume on such a plan with --use-distributed-optimizer")
    step = common.get("optimizer", {}).get("state", {}).get("common_step")
    step = float(step) if step is not None else None

    def destinations(names: set[str]) -> list[Piece]:
        moments = {m for m in MOMENTS if any(n.startswith(m + "/") for n in names)} if step is not None else None
        return state_pieces(trainer.placement, moments=moments, step=step)

    report = load_resharded(str(path), destinations)
    extra = path / TORCH_DIST_COMMON  # written by hetu_ext's torch_dist save; Megatron-LM keeps these in common.pt
    extra = torch.load(extra, weights_only=False) if extra.exists() else {
        "iteration": common.get("iteration", iteration), "scheduler": common.get("opt_param_scheduler")}
    if trainer.host.rank == 0:
        logger.info("loaded dist_checkpointing checkpoint %s at iteration %d into the plan (%.2f MiB sent by rank "
                    "0)", path, extra["iteration"], report.bytes_sent / 2**20)
    return _torch_dist_state(extra, path)


def _torch_dist_state(common: dict, path: Path) -> RunState:
    """The RunState of a torch_dist checkpoint's ``hetu_common.pt`` (or of Megatron-LM's ``common.pt``)."""
    return RunState(iteration=common["iteration"], source=str(path), losses=common.get("losses", []),
                    scheduler=common.get("scheduler"), data=common.get("data"), run_id=common.get("run_id"),
                    assumed=common.get("assumed"), grad_scaler=common.get("grad_scaler"))


# ---------------------------------------------------------------- torch_dist format (Megatron-core)


DISTRIB_OPTIM_SHARDING = "dp_reshardable"
"""How --use-distributed-optimizer's state is saved: as Megatron-LM saves it by default (each rank's flat ZeRO-1
buckets, written in parallel; it loads into the same TP and PP sizes, any data-parallel size). Megatron-core's
own default, ``fully_sharded_model_space``, uses ``ShardedTensor.flattened_range``, which its 0.16.1 save
refuses; ``fully_reshardable`` gathers through CUDA tensors only."""


def _content_metadata(trainer) -> dict | None:
    """The ``sharded_state_dict`` metadata a save uses (and records in the checkpoint, as Megatron-LM does)."""
    if trainer.config.parallel.use_distributed_optimizer:
        return {"distrib_optim_sharding_type": DISTRIB_OPTIM_SHARDING}
    return None


def _state(trainer, is_loading: bool, metadata: dict | None = None) -> dict:
    model_sd = trainer.model.module.sharded_state_dict(metadata=metadata)
    return {"model": model_sd, "optimizer": trainer.optimizer.sharded_state_dict(
        model_sd, is_loading=is_loading, metadata=metadata)}


def save_torch_dist(trainer, directory: str) -> Path:
    """Megatron-core's dist_checkpointing save (collective over every rank; the uniform runtime), into a
    temporary directory that rank 0 renames to ``iter_NNNNNNN`` once every rank has written; then the tracker."""
    from megatron.core import dist_checkpointing

    key = os.path.abspath(directory)
    run_id = _RUNS[key] if key in _RUNS else prepare_save(trainer, directory)
    storage = LocalStorage(directory)
    final = checkpoint_name(trainer.iteration)
    rank = dist.get_rank()
    decision: list = [None, None]
    if rank == 0:
        storage.makedirs("")
        found = {f.name: f for f in checkpoints_in(directory)}
        if final in found and found[final].run_id != run_id:
            decision = [None, f"{storage.local_path(final)} holds a checkpoint of another run (run identity "
                              f"{found[final].run_id}), which is never replaced; save into another directory"]
        else:
            decision = [new_run_id()[:12], None]
            storage.makedirs(f".tmp_{final}_{decision[0]}")
    dist.broadcast_object_list(decision, src=0)
    token, problem = decision
    if problem is not None:
        raise CheckpointError(problem)
    tmp = f".tmp_{final}_{token}"
    metadata = _content_metadata(trainer)
    dist_checkpointing.save(_state(trainer, False, metadata), storage.local_path(tmp), content_metadata=metadata)
    if rank == 0:
        parallel = trainer.config.parallel
        torch.save({**run_state(trainer), "run_id": run_id,
                    "tp_pp": [parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size]},
                   storage.local_path(f"{tmp}/{TORCH_DIST_COMMON}"))
    dist.barrier()
    if rank == 0:
        if final in storage.list(""):  # this run's earlier save of the iteration, or a failed save's folder
            storage.rename(final, f".old_{final}_{token}")
        storage.rename(tmp, final)
        storage.write(f"{TRACKER}.tmp", [str(trainer.iteration).encode()])
        storage.rename(f"{TRACKER}.tmp", TRACKER)
        remove_leftovers(storage, trainer.iteration)
        logger.info("saved checkpoint at iteration %d to %s", trainer.iteration, storage.local_path(final))
    dist.barrier()
    return Path(storage.local_path(final))


def latest_iteration(directory: str) -> int | None:
    tracker = Path(directory) / TRACKER
    if not tracker.exists():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{tracker}: expected an iteration number, found {text!r}; fix or delete the file")
    return int(text)


def load_torch_dist(trainer, directory: str) -> RunState:
    """The latest checkpoint under ``directory`` into the uniform runtime's model and optimizer (Megatron's own
    load); returns the rest of its state."""
    from megatron.core import dist_checkpointing

    iteration = latest_iteration(directory)
    path = Path(directory) / f"iter_{iteration:07d}"
    metadata = dist_checkpointing.load_content_metadata(str(path))
    common = torch.load(path / TORCH_DIST_COMMON, weights_only=False)
    _check_optimizer_layout(trainer, path, metadata, common)
    torch_adam = False
    if trainer.config.parallel.use_distributed_optimizer:
        from megatron.core.optimizer import distrib_optimizer

        torch_adam = not distrib_optimizer.HAVE_APEX_OR_TE
        if torch_adam:  # Megatron reads 'step' from the (still empty) state of torch's Adam
            create_optimizer_state(trainer.placement, {"exp_avg", "exp_avg_sq"}, 0.0)
    loaded = dist_checkpointing.load(_state(trainer, True, metadata), str(path))
    trainer.model.module.load_state_dict(loaded["model"])
    with torch.no_grad():  # dp_reshardable copies into main params that are views of leaves requiring grad
        trainer.optimizer.load_state_dict(loaded["optimizer"])
    if torch_adam:
        _restore_adam_step(trainer.placement)
    if trainer.host.rank == 0:
        logger.info("loaded checkpoint from %s at iteration %d", path, iteration)
    return _torch_dist_state(common, path)


def _check_optimizer_layout(trainer, path: Path, metadata: dict | None, common: dict) -> None:
    """The same decision on every rank (from the files): the checkpoint's optimizer layout loads into this run."""
    parallel = trainer.config.parallel
    sharding = (metadata or {}).get("distrib_optim_sharding_type")
    if parallel.use_distributed_optimizer and sharding is None:
        raise CheckpointError(f"{path} was saved without --use-distributed-optimizer; Megatron-core cannot load its "
                              "optimizer state into ZeRO-1's flat buffers: resume without --use-distributed-optimizer")
    if not parallel.use_distributed_optimizer and sharding is not None:
        raise CheckpointError(f"{path} was saved with --use-distributed-optimizer ({sharding}: ZeRO-1's flat "
                              "buffers); resume with --use-distributed-optimizer on the same TP and PP sizes")
    now = [parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size]
    if sharding == DISTRIB_OPTIM_SHARDING and common.get("tp_pp", now) != now:
        raise CheckpointError(f"{path}: --use-distributed-optimizer's {sharding} optimizer state was saved with "
                              f"TP x PP = {common['tp_pp'][0]} x {common['tp_pp'][1]} and loads only into the same "
                              f"sizes (this run: {now[0]} x {now[1]}); resume with those sizes (any data-parallel "
                              "size)")


def _restore_adam_step(placement) -> None:
    """Adam's step from the loaded parameter groups into every parameter's state, one tensor each. Megatron-core
    0.16.1's dp_reshardable load (torch's Adam, no Apex / Transformer Engine) gives every parameter the same step
    tensor, which each parameter's update then increments (36 after one step of 34 parameters), and afterwards
    overwrites it with the step the state held before the load (a non-persistent local object)."""
    for opt in optimizers(placement.optimizer):
        for group in opt.param_groups:
            if group.get("step") is None:
                continue
            for p in group["params"]:
                state = opt.state.get(p, {})
                if "step" in state:
                    state["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)
