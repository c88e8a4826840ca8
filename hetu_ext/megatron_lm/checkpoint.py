"""``--hetu-ckpt-format hetu`` on Megatron-LM's loop: hetu_ext's layout-agnostic checkpoints through Megatron-LM's
own save and load call sites (``megatron.training.training``'s ``save_checkpoint`` and ``load_checkpoint``, same
signatures), driven by its own ``--save``, ``--load``, ``--save-interval``, ``--exit-interval`` and
``--ckpt-step`` flags.

What is saved: every rank's parameters, fp32 master weights (``--bf16``) and Adam moments as pieces with global
offsets (:func:`hetu_ext.megatron.state.state_pieces`: the same names as hetu_ext's trainer writes; under
``--use-distributed-optimizer`` the masters and moments of each data-parallel rank's flat ranges, as boxes:
:mod:`hetu_ext.megatron.distopt_state`), Adam's step, Megatron-LM's LR scheduler state, ``consumed_train_samples``
(and the validation position) and the FLOP count, each rank's RNG states, the ``--fp16`` loss scaler's state
(scale, growth and hysteresis trackers: without it a resume would restart at ``--initial-loss-scale``, skip other
steps and differ), and the grid as a hetu_ext plan. The
snapshot is taken at the call; the files are written in the background
(:class:`hetu_ext.checkpoint.writer.Checkpointer`) while training goes on, except the run's last save, which is
committed before the call returns. Loading reshards the pieces into the running grid, whatever its TP / PP / DP
sizes; the LR scheduler goes through Megatron-LM's own ``load_state_dict`` (its override / use-checkpoint rules);
RNG states are restored when the grid is the one that saved; under the distributed optimizer the loaded parameters
must be the loaded masters rounded. A checkpoint of hetu_ext's trainer loads the same way (its consumed samples come
from the manifest). A ``--load`` directory that holds no hetu checkpoint goes to Megatron-LM's own loader (its
torch_dist checkpoints keep working).
"""

from __future__ import annotations

import atexit
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hetu_ext.checkpoint import LocalStorage
from hetu_ext.checkpoint.load import load_pieces
from hetu_ext.checkpoint.manifest import MANIFEST, Manifest
from hetu_ext.checkpoint.ownership import new_run_id
from hetu_ext.checkpoint.reader import latest_iteration
from hetu_ext.checkpoint.writer import Checkpointer, SaveConfig, checkpoint_name
from hetu_ext.checkpoint import CheckpointError
from hetu_ext.megatron.state import (
    MOMENTS,
    optimizer_step,
    restore_scaler_state,
    rng_state,
    scaler_state,
    set_rng_state,
    state_pieces,
)
from hetu_ext.megatron.weights import local_shards
from hetu_ext.megatron.vocab import VOCAB_KEYS, check_vocab, narrow_to_vocab, padding_logit_mask
from hetu_ext.patches.base import Patch
from hetu_ext.plan import plan_to_dict, uniform_plan

logger = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
TRAINING = "megatron.training.training"
LANGUAGE_MODULE = "megatron.core.models.common.language_module.language_module:LanguageModule"


def _vocab_size() -> int:
    """The tokenizer's ids (Megatron-LM's model pads them to ``args.padded_vocab_size`` rows)."""
    from megatron.training import get_tokenizer

    return get_tokenizer().vocab_size


def _vocab_rows(manifest: Manifest, pieces: list, *, where: str, padded: int) -> list:
    """Refuse another vocabulary; where the checkpoint pads it to other rows than the model, load the real
    rows only (:mod:`hetu_ext.megatron.vocab`)."""
    vocab = _vocab_size()
    check_vocab(manifest.state.get("vocab_size"), vocab, where=where)
    stored = {t.name: t.shape[0] for t in manifest.tensors if t.name.split("/", 1)[1] in VOCAB_KEYS}
    if all(rows == padded for rows in stored.values()):
        return pieces
    if manifest.state.get("vocab_size") is None:
        raise CheckpointError(f"{where} stores {sorted(set(stored.values()))} vocabulary rows, this model {padded}, "
                              "and it does not record its real vocabulary size; resume it under the "
                              "--tensor-model-parallel-size that saved it")
    return narrow_to_vocab(pieces, vocab_size=vocab, moments=MOMENTS)


def _check_shapes(manifest: Manifest, placement, *, where: str) -> None:
    """Every parameter this rank holds has the global shape the checkpoint stores (the vocabulary's rows may
    differ: padding, :func:`_vocab_rows`). A smaller model would otherwise load a corner of each saved tensor."""
    stored = manifest.tensor_map()
    for shard in local_shards(placement.model, **placement.shard_kwargs):
        record = stored.get((f"param/{shard.key}", shard.index))
        if record is None:
            continue  # named by the load's own check ("has no tensor ...")
        saved, model = tuple(record.shape), tuple(shard.shape)
        if shard.key in VOCAB_KEYS:
            saved, model = saved[1:], model[1:]
        if saved != model:
            raise CheckpointError(f"{where} was saved from another model: {shard.key}{list(shard.index)} is "
                                  f"{list(record.shape)} there and {list(shard.shape)} in this one (compare "
                                  "--hidden-size, --ffn-hidden-size, --num-attention-heads, --num-query-groups, "
                                  "--kv-channels); load a checkpoint of this model")


@dataclass
class GridPlacement:
    """Megatron-LM's model chunk and optimizer as :func:`state_pieces` reads them (Megatron numbers layers
    globally, so no layer offset)."""

    model: Any
    optimizer: Any
    active: bool = True
    shard_kwargs: dict = field(default_factory=dict)


def _placement(model: list, optimizer: Any) -> GridPlacement:
    if len(model) != 1:
        raise ValueError(f"--hetu-ckpt-format hetu: {len(model)} model chunks (virtual pipeline stages) are not "
                         "supported yet; drop --num-layers-per-virtual-pipeline-stage or use --hetu-ckpt-format auto")
    return GridPlacement(model=model[0], optimizer=optimizer)


def grid(args) -> dict:
    """The running grid, as recorded and compared (RNG states are restored only under the same grid); an MoE
    model's includes its expert parallelism (EP and expert TP)."""
    out = {"world": args.world_size, "tp": args.tensor_model_parallel_size,
           "pp": args.pipeline_model_parallel_size}
    if getattr(args, "num_experts", None):
        out.update(ep=args.expert_model_parallel_size, etp=args.expert_tensor_parallel_size)
    return out


def _check_params(placement: GridPlacement, where: str, why: str) -> None:
    """Under the DistributedOptimizer, the model's bf16 parameters must be its fp32 masters rounded, as Megatron
    keeps them (:func:`hetu_ext.megatron.distopt_state.params_match_masters`); else every rank raises the same
    :class:`CheckpointError`, ``why`` saying what it means."""
    from hetu_ext.megatron.distopt_state import distributed_optimizers, params_match_masters
    from hetu_ext.megatron.weights import local_shards

    problem = None
    if distributed_optimizers(placement.optimizer):
        problem = params_match_masters(placement, local_shards(placement.model))
    problems: list = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    first = next((p for p in problems if p), None)
    if first is not None:
        raise CheckpointError(f"{where}: {first}; {why}")


class StepStorage(LocalStorage):
    """A checkpoint directory whose tracker reads ``step`` (Megatron-LM's ``--ckpt-step``: load that one)."""

    def __init__(self, root: str, step: int) -> None:
        super().__init__(root)
        self.step = step

    def list(self, path: str) -> list[str]:
        names = super().list(path)
        return names if path or TRACKER in names else [*names, TRACKER]

    def read(self, path: str) -> bytes:
        return str(self.step).encode() if path == TRACKER else super().read(path)


def is_hetu(directory: str, step: int | None = None) -> bool:
    root = Path(directory)
    iteration = step if step is not None else latest_iteration(LocalStorage(root))
    if iteration is not None:
        return (root / checkpoint_name(iteration) / MANIFEST).exists()
    return any(root.glob(f"iter_*/{MANIFEST}"))


class HetuCheckpoints:
    """The save and load hooks, one object per process (its checkpointer outlives a save)."""

    def __init__(self, *, keep: int, fallback: bool, read: str, packing: str = "off") -> None:
        """``packing``: the run's ``--hetu-packing`` method, recorded with the data settings so that hetu_ext's
        trainer resumes a checkpoint only with the data that continues it (its ``restore`` compares them)."""
        self.keep, self.fallback, self.read, self.packing = keep, fallback, read, packing
        self.run_id: str | None = None
        self.loaded_from: str | None = None
        self.loaded_run: str | None = None
        self._checkpointers: dict[str, Checkpointer] = {}
        atexit.register(self.wait)

    def wait(self) -> None:
        for ckpt in self._checkpointers.values():
            ckpt.wait()

    def _run_id(self, directory: str) -> str | None:
        """This run's identity (rank 0's decision): the loaded checkpoint's when it resumes in place, else new."""
        if self.run_id is None:
            resumed = self.loaded_from == os.path.abspath(directory) and self.loaded_run is not None
            decision = [self.loaded_run if resumed else (new_run_id() if dist.get_rank() == 0 else None)]
            dist.broadcast_object_list(decision, src=0)
            self.run_id = decision[0]
        return self.run_id

    def save(self, iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
             *args: Any, **kwargs: Any) -> None:
        from megatron.training import get_args

        margs = get_args()
        directory = os.path.abspath(margs.save)
        placement = _placement(model, optimizer)
        if directory not in self._checkpointers:
            Path(directory).mkdir(parents=True, exist_ok=True)
            self._checkpointers[directory] = Checkpointer(LocalStorage(directory), SaveConfig(
                keep=self.keep, run_id=self._run_id(directory)))
        ckpt = self._checkpointers[directory]
        last = iteration >= margs.train_iters or bool(margs.exit_interval and iteration % margs.exit_interval == 0)
        plan = uniform_plan(world_size=margs.world_size, tp=margs.tensor_model_parallel_size,
                            pp=margs.pipeline_model_parallel_size, num_layers=margs.num_layers)
        state = {"iteration": iteration, "grid": grid(margs), "vocab_size": _vocab_size(),
                 "padded_vocab_size": margs.padded_vocab_size,
                 "scheduler": opt_param_scheduler.state_dict() if opt_param_scheduler is not None else None,
                 "optimizer_step": optimizer_step(placement), "grad_scaler": scaler_state(optimizer),
                 "consumed_train_samples": margs.consumed_train_samples,
                 "skipped_train_samples": getattr(margs, "skipped_train_samples", 0),
                 "consumed_valid_samples": getattr(margs, "consumed_valid_samples", 0),
                 "num_floating_point_operations_so_far": num_floating_point_operations_so_far,
                 "data": {"global_batch_size": margs.global_batch_size, "seed": margs.seed,
                          "seq_length": margs.seq_length, "packing": self.packing}}
        info = {"consumed_samples": margs.consumed_train_samples, "plan": plan_to_dict(plan),
                "config": {"megatron_lm": True, "num_layers": margs.num_layers,
                           "apply_layernorm_1p": bool(getattr(margs, "apply_layernorm_1p", False))},
                "state": state}
        _check_params(placement, f"--save {directory} at iteration {iteration}",
                      "the updated parameters were not gathered before the save (Megatron-LM's "
                      "save_checkpoint_and_time does that under --overlap-param-gather)")
        ckpt.save(iteration=iteration, pieces=state_pieces(placement), rng=rng_state(dist.get_rank()), info=info,
                  blocking=last)
        if dist.get_rank() == 0:
            logger.info("hetu checkpoint of iteration %d: %.1f ms blocking, %.2f MiB on rank 0 (%s)", iteration,
                        ckpt.last["blocking_s"] * 1e3, ckpt.last["bytes"] / 2**20,
                        "committed" if last else "persisting in the background")

    def load(self, ddp_model, optimizer, opt_param_scheduler, load_arg="load", strict=True, *args: Any,
             original=None, **kwargs: Any):
        from megatron.core.num_microbatches_calculator import update_num_microbatches
        from megatron.training import get_args

        margs = get_args()
        directory = getattr(margs, load_arg)
        step = getattr(margs, "ckpt_step", None)
        if directory is None or not is_hetu(directory, step):
            return original(ddp_model, optimizer, opt_param_scheduler, load_arg, strict, *args, **kwargs)
        placement = _placement(ddp_model, optimizer)
        storage = StepStorage(directory, step) if step is not None else LocalStorage(directory)

        def destinations(manifest: Manifest):
            kinds = {t.name.split("/", 1)[0] for t in manifest.tensors}
            saved_step = manifest.state.get("optimizer_step")
            moments = {m for m in MOMENTS if m in kinds} if saved_step is not None and optimizer is not None \
                else None
            where = f"{directory} (iteration {manifest.iteration})"
            _check_shapes(manifest, placement, where=where)
            pieces = state_pieces(placement, moments=moments, step=saved_step)
            return _vocab_rows(manifest, pieces, where=where, padded=margs.padded_vocab_size)

        report = load_pieces(storage, destinations, fallback=self.fallback, read=self.read)
        manifest = report.manifest
        state = manifest.state
        _check_params(placement, f"{directory} (iteration {manifest.iteration})",
                      "its param/ and master/ tensors are of different training states")
        if opt_param_scheduler is not None and state.get("scheduler") is not None:
            opt_param_scheduler.load_state_dict(state["scheduler"])
        restore_scaler_state(optimizer, state.get("grad_scaler"), f"{directory} (iteration {manifest.iteration})",
                             report=dist.get_rank() == 0)
        # hetu_ext's trainer records the samples in the manifest only (unpacked data: iteration x global batch)
        consumed = state.get("consumed_train_samples", manifest.consumed_samples)
        if consumed is None:
            raise CheckpointError(f"{directory} (iteration {manifest.iteration}) records no consumed samples (a "
                                  "packed run of hetu_ext's trainer); resume it with hetu_ext's trainer")
        margs.consumed_train_samples = consumed
        update_num_microbatches(consumed_samples=margs.consumed_train_samples, verbose=True)
        # as Megatron-LM's own load: the validation position too (else a sample-based run, --train-samples, would
        # evaluate from the validation split's start again; 0 lets an iteration-based run derive it)
        margs.skipped_train_samples = state.get("skipped_train_samples", 0)
        margs.consumed_valid_samples = state.get("consumed_valid_samples", 0)
        same_grid = state.get("grid") == grid(margs)
        rng = next((r for r in manifest.rng.values() if r.get("rank") == dist.get_rank()), None)
        if same_grid and rng is not None:
            set_rng_state(rng)
        self.loaded_from, self.loaded_run = os.path.abspath(directory), manifest.run_id
        if dist.get_rank() == 0:
            logger.info("loaded hetu checkpoint of iteration %d from %s into TP %d PP %d DP %d (%.2f s)%s",
                        manifest.iteration, directory, margs.tensor_model_parallel_size,
                        margs.pipeline_model_parallel_size, margs.data_parallel_size, report.seconds,
                        "" if same_grid else "; another grid: RNG states stay as the seed sets them")
            print(f" loaded hetu checkpoint from {directory} at iteration {manifest.iteration} "
                  f"(saved on {state.get('grid')}, now {grid(margs)})", flush=True)
        return manifest.iteration, state.get("num_floating_point_operations_so_far", 0)

    def patches(self) -> list[Patch]:
        def make_loss(original):
            def compute_language_model_loss(module, labels, logits):
                tp_rank = module.pg_collection.tp.rank() if module.pg_collection.tp is not None else 0
                return original(module, labels, padding_logit_mask(logits, vocab_size=_vocab_size(),
                                                                   tp_rank=tp_rank))

            return compute_language_model_loss

        def make_save(original):
            def save_checkpoint(*args, **kwargs):
                return self.save(*args, **kwargs)

            return save_checkpoint

        def make_load(original):
            def load_checkpoint(*args, **kwargs):
                return self.load(*args, original=original, **kwargs)

            return load_checkpoint

        return [
            Patch(name="hetu_ckpt:save_checkpoint", target=f"{TRAINING}:save_checkpoint", make=make_save,
                  reason="--hetu-ckpt-format hetu: Megatron-LM's save call sites write hetu checkpoints"),
            Patch(name="hetu_ckpt:load_checkpoint", target=f"{TRAINING}:load_checkpoint", make=make_load,
                  reason="--hetu-ckpt-format hetu: --load reads hetu checkpoints into any grid"),
            Patch(name="hetu_ckpt:padding_logit_mask", target=f"{LANGUAGE_MODULE}.compute_language_model_loss",
                  make=make_loss, reason="--hetu-ckpt-format hetu: the vocabulary's padding rows take no part in "
                                         "the loss, so a checkpoint resumes exactly under another TP's padding"),
        ]
