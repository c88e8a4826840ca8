"""Megatron-core's ``dist_checkpointing`` (torch_dist) as a format of the trainer's ``--save`` and ``--load``.

Megatron-LM's layout, saved on the uniform runtime only: ``DIR/iter_0000004/`` with Megatron's shards and
``hetu_common.pt`` (the parts' record, hetu_ext.checkpoint.parts, less the per-rank RNG), written into
``DIR/.tmp_iter_0000004_<token>/`` and renamed by rank 0 once every rank finished (a failed save never leaves a
folder that looks like a checkpoint); the tracker moves last. With ``--use-distributed-optimizer`` the optimizer
state is saved as Megatron-LM saves it (``dp_reshardable``: each rank's flat ZeRO-1 buckets; it loads into the
same TP and PP sizes, any data-parallel size). A torch_dist checkpoint loads into Megatron's own model and
optimizer on the uniform runtime (:func:`load_torch_dist`), or into any plan through the reshard engine
(:func:`load_torch_dist_resharded`: its global tensors into the parts' destinations).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist

from hetu_ext.checkpoint import CheckpointError, LocalStorage
from hetu_ext.checkpoint.ownership import TORCH_DIST_COMMON, checkpoints_in, new_run_id
from hetu_ext.checkpoint.parts import PER_RANK, load_destinations, state_record, tensor_kinds
from hetu_ext.checkpoint.writer import checkpoint_name, remove_leftovers
from hetu_ext.runtime.reshard import Piece

from .checkpoint_target import TRACKER, CheckpointTarget, latest_iteration, run_of
from .state import RunState, create_optimizer_state, optimizers

logger = logging.getLogger(__name__)


def _common_record(target: CheckpointTarget) -> dict:
    """The parts' record as ``hetu_common.pt`` holds it (no per-rank RNG: Megatron's format has no place for it)."""
    record = state_record(target.parts)
    record.pop(PER_RANK, None)
    return record


def load_torch_dist_resharded(target: CheckpointTarget, directory: str) -> RunState:
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
        return load_destinations(target.parts, {"optimizer_step": step}, tensor_kinds(names))

    report = load_resharded(str(path), destinations)
    extra = path / TORCH_DIST_COMMON  # written by hetu_ext's torch_dist save; Megatron-LM keeps these in common.pt
    extra = torch.load(extra, weights_only=False) if extra.exists() else {
        "iteration": common.get("iteration", iteration), "scheduler": common.get("opt_param_scheduler")}
    if target.host.rank == 0:
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


def _content_metadata(target: CheckpointTarget) -> dict | None:
    """The ``sharded_state_dict`` metadata a save uses (and records in the checkpoint, as Megatron-LM does)."""
    if target.config.parallel.use_distributed_optimizer:
        return {"distrib_optim_sharding_type": DISTRIB_OPTIM_SHARDING}
    return None


def _state(target: CheckpointTarget, is_loading: bool, metadata: dict | None = None) -> dict:
    model_sd = target.placement.model.module.sharded_state_dict(metadata=metadata)
    return {"model": model_sd, "optimizer": target.placement.optimizer.sharded_state_dict(
        model_sd, is_loading=is_loading, metadata=metadata)}


def save_torch_dist(target: CheckpointTarget, directory: str) -> Path:
    """Megatron-core's dist_checkpointing save (collective over every rank; the uniform runtime), into a
    temporary directory that rank 0 renames to ``iter_NNNNNNN`` once every rank has written; then the tracker."""
    from megatron.core import dist_checkpointing

    run_id = run_of(target, directory)
    storage = LocalStorage(directory)
    final = checkpoint_name(target.iteration)
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
    metadata = _content_metadata(target)
    dist_checkpointing.save(_state(target, False, metadata), storage.local_path(tmp),
                            content_metadata=metadata)
    if rank == 0:
        parallel = target.config.parallel
        torch.save({**_common_record(target), "run_id": run_id,
                    "tp_pp": [parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size]},
                   storage.local_path(f"{tmp}/{TORCH_DIST_COMMON}"))
    dist.barrier()
    if rank == 0:
        if final in storage.list(""):  # this run's earlier save of the iteration, or a failed save's folder
            storage.rename(final, f".old_{final}_{token}")
        storage.rename(tmp, final)
        storage.write(f"{TRACKER}.tmp", [str(target.iteration).encode()])
        storage.rename(f"{TRACKER}.tmp", TRACKER)
        remove_leftovers(storage, target.iteration)
        logger.info("saved checkpoint at iteration %d to %s", target.iteration, storage.local_path(final))
    dist.barrier()
    return Path(storage.local_path(final))


def load_torch_dist(target: CheckpointTarget, directory: str) -> RunState:
    """The latest checkpoint under ``directory`` into the uniform runtime's model and optimizer (Megatron's own
    load); returns the rest of its state."""
    from megatron.core import dist_checkpointing

    iteration = latest_iteration(directory)
    path = Path(directory) / f"iter_{iteration:07d}"
    metadata = dist_checkpointing.load_content_metadata(str(path))
    common = torch.load(path / TORCH_DIST_COMMON, weights_only=False)
    _check_optimizer_layout(target, path, metadata, common)
    torch_adam = False
    if target.config.parallel.use_distributed_optimizer:
        from megatron.core.optimizer import distrib_optimizer

        torch_adam = not distrib_optimizer.HAVE_APEX_OR_TE
        if torch_adam:  # Megatron reads 'step' from the (still empty) state of torch's Adam
            create_optimizer_state(target.placement, {"exp_avg", "exp_avg_sq"}, 0.0)
    loaded = dist_checkpointing.load(_state(target, True, metadata), str(path))
    target.placement.model.module.load_state_dict(loaded["model"])
    with torch.no_grad():  # dp_reshardable copies into main params that are views of leaves requiring grad
        target.placement.optimizer.load_state_dict(loaded["optimizer"])
    if torch_adam:
        _restore_adam_step(target.placement)
    if target.host.rank == 0:
        logger.info("loaded checkpoint from %s at iteration %d", path, iteration)
    return _torch_dist_state(common, path)


def _check_optimizer_layout(target: CheckpointTarget, path: Path, metadata: dict | None, common: dict) -> None:
    """The same decision on every rank (from the files): the checkpoint's optimizer layout loads into this run."""
    parallel = target.config.parallel
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
