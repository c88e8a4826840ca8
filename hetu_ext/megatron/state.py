"""The training state a run must restore, composed once for every checkpoint format.

:class:`RunState` is what a checkpoint holds besides tensors, as every loader returns it (hetu, Megatron's
torch_dist into the uniform runtime or resharded into any plan, DeepSpeed ZeRO): the iteration, the losses so far,
the LR schedule, the data settings that fix each step's samples, this rank's RNG states (used only under the
saving plan), the straggler monitor's assumed slowdowns, the ``--fp16`` loss scaler's state (:func:`scaler_state`:
the record Megatron-LM's loop keeps in hetu checkpoints too, so either loop resumes the other's), the run's
identity, and a plug-in's keys. Its :meth:`RunState.record` is what the checkpoint parts restore from
(hetu_ext.checkpoint.parts; the trainer's parts, hetu_ext/train/parts.py, call the functions here).

The functions are the host side of those parts, each on typed inputs: :func:`state_pieces` (parameters, fp32
master weights, optimizer moments: the reshard engine's view of the model and optimizer, which every loader reads
its tensors into), :func:`data_settings`, :func:`restore_scheduler` (Megatron-LM's rule), :func:`rng_state` and
:func:`set_rng_state`, :func:`scaler_state` and :func:`restore_scaler_state`, :func:`optimizer_step`.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hetu_ext.checkpoint import CheckpointError
from hetu_ext.checkpoint.schedule import resolve_schedule
from hetu_ext.plan.core.batches import global_batch_size
from hetu_ext.runtime.reshard import Piece

from .distopt_state import distopt_pieces, distributed_optimizers
from .weights import local_shards

logger = logging.getLogger(__name__)

MOMENTS = ("exp_avg", "exp_avg_sq", "momentum_buffer")
"""Optimizer state tensors shaped like their parameter (Adam's two moments, SGD's momentum)."""


@dataclass
class RunState:
    """What a checkpoint restores besides tensors (every format fills what it has; None: not recorded)."""

    iteration: int
    source: str
    """Where it was read (a checkpoint path): named in errors."""
    losses: list[float] = field(default_factory=list)
    scheduler: dict[str, Any] | None = None
    """``OptimizerParamScheduler.state_dict()``; None: replay the flags' schedule to the iteration."""
    data: dict[str, Any] | None = None
    """:func:`data_settings` when saved; None: not recorded, not checked."""
    run_id: str | None = None
    rng: dict[str, Any] | None = None
    """This rank's RNG states, when the checkpoint was saved under the running plan."""
    assumed: dict[int, float] | None = None
    """The straggler monitor's assumed slowdowns (rank -> x) when saved."""
    grad_scaler: list[dict] | None = None
    """--fp16: :func:`scaler_state` of the saving run (None: saved without --fp16, or not recorded)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """The rest of the saved record (a plug-in's keys: LoRA's ``tenant_steps``, ``tenant_losses``, ``lora``)."""

    def record(self) -> dict[str, Any]:
        """The flat record the checkpoint's parts restore from (hetu_ext.checkpoint.parts): the saved state's keys,
        the RNG under ``rng``."""
        return {**self.extra, "iteration": self.iteration, "losses": list(self.losses),
                "scheduler": self.scheduler, "data": self.data, "rng": self.rng, "assumed": self.assumed,
                "grad_scaler": self.grad_scaler}


def grad_scalers(optimizer) -> list:
    """The loss scalers of Megatron's optimizer: one per part of a ``ChainedOptimizer`` under ``--fp16``
    (``DynamicGradScaler``, or ``ConstantGradScaler`` under ``--loss-scale``); none under ``--bf16`` or fp32, nor
    on an idle rank (no optimizer)."""
    if optimizer is None:
        return []
    parts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [s for s in (getattr(p, "grad_scaler", None) for p in parts) if s is not None]


def scaler_state(optimizer) -> list[dict] | None:
    """Each loss scaler's state as JSON: ``scale`` (a float32 value, exact in a double), ``growth_tracker`` and
    ``hysteresis_tracker`` (a ConstantGradScaler has the scale only); None without a scaler. The format of
    hetu_ext.megatron_lm.checkpoint's ``grad_scaler`` record (Megatron-LM's loop), so the two loops read each
    other's checkpoints."""
    scalers = grad_scalers(optimizer)
    if not scalers:
        return None
    return [{**{k: int(v) for k, v in s.state_dict().items() if k != "scale"}, "scale": float(s.scale.item())}
            for s in scalers]


def restore_scaler_state(optimizer, saved: list[dict] | None, where: str, *, report: bool = True) -> None:
    """Load :func:`scaler_state`'s record into the optimizer's loss scalers (Megatron-core's own
    ``load_state_dict``). A record of a run without --fp16 leaves the scaler at ``--initial-loss-scale``, as
    Megatron-LM's loader does (said once, when ``report``); a record of another number of scalers is refused."""
    scalers = grad_scalers(optimizer)
    if not scalers:
        return
    if not saved:
        if report:
            logger.warning("%s holds no loss scaler state (saved without --fp16): the loss scale starts at "
                           "--initial-loss-scale", where)
        return
    if len(saved) != len(scalers):
        raise CheckpointError(f"{where} holds {len(saved)} loss scaler state(s), this run's optimizer has "
                              f"{len(scalers)}; resume with the optimizer options that saved it")
    for scaler, record in zip(scalers, saved):
        scale = torch.tensor([record["scale"]], dtype=torch.float, device=scaler.scale.device)
        scaler.load_state_dict({**record, "scale": scale})


def check_norm_convention(config, directory: str) -> None:
    """--apply-layernorm-1p stores norm weights as gamma - 1: a hetu_ext checkpoint saved under the other convention
    has the same tensors with other meanings, so loading it is refused (its manifest records the flag; absent in
    older ones: off). Checkpoints of Megatron-LM's loop record no model flags and are not checked."""
    from hetu_ext.checkpoint.reader import latest_iteration, read_manifest

    from hetu_ext.checkpoint import LocalStorage

    storage = LocalStorage(directory)
    try:
        iteration = latest_iteration(storage)
        recorded = read_manifest(storage, iteration).config if iteration is not None else {}
    except (OSError, ValueError):
        return  # not a hetu checkpoint, or a damaged one: the loader says which
    if "num_layers" not in recorded:
        return
    saved, now = bool(recorded.get("apply_layernorm_1p", False)), config.model.apply_layernorm_1p
    if saved != now:
        raise ValueError(f"--load {directory}: its norm weights were saved {'with' if saved else 'without'} "
                         f"--apply-layernorm-1p (gamma{' - 1' if saved else ''}), this run is "
                         f"{'with' if now else 'without'} it; give the same setting as the saved run")


def optimizers(optimizer) -> list:
    """The torch optimizers inside Megatron's (chained) optimizer (none for a model without one)."""
    if optimizer is None:
        return []
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]


def state_pieces(placement, *, moments: set[str] | None = None, step: float | None = None) -> list[Piece]:
    """This rank's parameters, fp32 master weights and optimizer moments as pieces (empty on idle ranks).

    Names: ``param/KEY`` (model dtype), ``master/KEY`` (fp32 copy kept by the optimizer under --bf16),
    ``exp_avg/KEY``, ``exp_avg_sq/KEY``; under Megatron's DistributedOptimizer (--use-distributed-optimizer) the
    last three are the boxes of this rank's flat ranges (:mod:`hetu_ext.megatron.distopt_state`). With ``moments``
    given (loading), the optimizer state of every parameter (of every flat shard, under the DistributedOptimizer)
    is first created with those moments and Adam's ``step``, uninitialised: these pieces are the destinations of
    a load (:func:`hetu_ext.checkpoint.load.load_pieces`), whose reshard fills every element or raises before
    moving anything (a failed load stops the run). Not zero-filling them saves a pass over the moments' memory
    (on one core of the benchmark machine: zeros at 2.2 GB/s, then the copy into them at 5 GB/s; the copy into
    untouched memory at 3.4 GB/s). State that no returned piece names (so no load would fill it) is zeroed.
    """
    if not placement.active:
        return []
    if moments is None:
        return _pieces(placement)
    created = create_optimizer_state(placement, moments, step, zero=False)
    pieces = _pieces(placement)
    named = {p.tensor.data_ptr() for p in pieces}  # a gated weight's pieces view their whole tensor
    for tensor in created:
        if tensor.data_ptr() not in named:
            tensor.zero_()
    return pieces


def _pieces(placement) -> list[Piece]:
    if distributed_optimizers(placement.optimizer):  # --- Megatron's DistributedOptimizer: its flat DP ranges
        return distopt_pieces(placement, local_shards(placement.model, **placement.shard_kwargs))
    sharded = getattr(placement.optimizer, "hetu_sharded", None)
    if sharded is not None:  # --- the plan runtime's sharded optimizer: state of the owned boxes only
        pieces = [Piece(f"param/{s.key}", s.index, tuple((sl.start, sl.stop) for sl in s.slices), s.data.data)
                  for s in local_shards(placement.model, **placement.shard_kwargs)]
        for e in sharded.entries():
            if e.master is not None:
                pieces.append(Piece(f"master/{e.key}", e.index, e.box, e.master.data))
            pieces.extend(Piece(f"{m}/{e.key}", e.index, e.box, e.state[m]) for m in MOMENTS if m in e.state)
        return pieces
    states = {id(p): opt.state.get(p, {}) for opt in optimizers(placement.optimizer)
              for group in opt.param_groups for p in group["params"]}
    pieces = []
    for s in local_shards(placement.model, **placement.shard_kwargs):
        box = tuple((sl.start, sl.stop) for sl in s.slices)
        pieces.append(Piece(f"param/{s.key}", s.index, box, s.data.data))
        main = getattr(s.param, "main_param", None)
        if main is not None:
            pieces.append(Piece(f"master/{s.key}", s.index, box, s.view(main.data)))
        state = states.get(id(main if main is not None else s.param), {})
        pieces.extend(Piece(f"{m}/{s.key}", s.index, box, s.view(state[m])) for m in MOMENTS if m in state)
    return pieces


def create_optimizer_state(placement, moments: set[str], step: float | None, *,
                           zero: bool = True) -> list[torch.Tensor]:
    """Give every parameter of this rank's optimizer the state ``moments`` (zeros; with ``zero=False``
    uninitialised, for a caller that overwrites every element) and Adam's ``step``; returns the moments made."""
    new = torch.zeros_like if zero else torch.empty_like
    created = []
    for opt in optimizers(placement.optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                state = {m: new(p.data) for m in moments}
                created.extend(state.values())
                if step is not None:
                    state["step"] = torch.tensor(float(step), dtype=torch.float32)
                opt.state[p] = state
    return created


def optimizer_steps(placement) -> set[float]:
    """The Adam step counts of this rank's parameters (empty before the first step / without Adam)."""
    return {float(st["step"]) for opt in optimizers(placement.optimizer) for st in opt.state.values() if "step" in st}


def optimizer_step(placement) -> float | None:
    """Adam's step count (the same for every parameter), or None before the first step / without Adam."""
    steps = optimizer_steps(placement)
    if len(steps) > 1:
        raise AssertionError(f"parameters are at different optimizer steps {sorted(steps)}")
    return steps.pop() if steps else None


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.contiguous().view(torch.uint8).numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state(rank: int) -> dict[str, Any]:
    """Python, NumPy, torch and Megatron's model-parallel RNG states of this rank, JSON-able."""
    from megatron.core import tensor_parallel

    version, state, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    tracker = tensor_parallel.get_cuda_rng_tracker().get_states()
    return {"rank": rank, "python": [version, list(state), gauss],
            "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
            "torch": _b64(torch.get_rng_state()),
            "cuda": [_b64(s) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
            "tracker": {k: _b64(v) for k, v in tracker.items() if isinstance(v, torch.Tensor)}}


def set_rng_state(saved: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    version, state, gauss = saved["python"]
    random.setstate((version, tuple(state), gauss))
    name, keys, pos, has_gauss, cached = saved["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(saved["torch"]))
    if saved["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in saved["cuda"]])
    if saved["tracker"]:
        tensor_parallel.get_cuda_rng_tracker().set_states({k: _unb64(v) for k, v in saved["tracker"].items()})


def data_settings(cfg, plan) -> dict[str, Any]:
    """What fixes the samples of step g (the data position is the iteration): changing any of them on resume
    would skip or repeat samples (``cfg``: the RunConfig)."""
    return {"global_batch_size": global_batch_size(plan, cfg.training.micro_batch_size),
            "seed": cfg.training.seed, "seq_length": cfg.model.seq_length, "split": cfg.data.split,
            "mock_data": bool(cfg.data.mock_data), "packing": cfg.packing.method,
            "global_batch_tokens": cfg.packing.global_batch_tokens,
            "rampup_batch_size": list(cfg.training.rampup_batch_size or []) or None}


def scheduler_settings(training, unit: int) -> dict[str, Any]:
    """``OptimizerParamScheduler``'s settings from the flags (``training``: the TrainingConfig), steps counted in
    ``unit`` per iteration (samples, as Megatron-LM counts; 1 with packing).

    Megatron-LM's rules (training.py, get_optimizer_param_scheduler): iteration-based, the decay spans
    ``--lr-decay-iters`` (default ``--train-iters``) x unit and the warmup ``--lr-warmup-iters`` x unit;
    sample-based (``--train-samples``), the decay spans ``--lr-decay-samples`` (default ``--train-samples``) and
    the warmup ``--lr-warmup-samples``; either way ``--lr-warmup-fraction`` makes the warmup that share of the
    decay. The weight-decay increment spans the decay (iterations; its style is constant, so only the record
    sees it) or ``--train-samples``."""
    if training.train_samples is not None:
        decay_steps = training.lr_decay_samples or training.train_samples
        warmup_steps = training.lr_warmup_samples
        wd_steps = training.train_samples
    else:
        decay_steps = (training.lr_decay_iters or training.train_iters) * unit
        warmup_steps = training.lr_warmup_iters * unit
        wd_steps = decay_steps
    if training.lr_warmup_fraction is not None:
        warmup_steps = training.lr_warmup_fraction * decay_steps
    return {"max_lr": float(training.lr), "min_lr": float(training.min_lr),
            "lr_warmup_steps": warmup_steps, "lr_decay_steps": decay_steps,
            "lr_decay_style": training.lr_decay_style, "start_wd": float(training.weight_decay),
            "end_wd": float(training.weight_decay), "wd_incr_steps": wd_steps, "wd_incr_style": "constant"}


def schedule_policy(training) -> str:
    """``override`` (--override-opt_param-scheduler), ``checkpoint`` (--use-checkpoint-opt_param-scheduler) or
    ``check`` (Megatron-LM's default: a difference is an error)."""
    if training.override_opt_param_scheduler:
        return "override"
    return "checkpoint" if training.use_checkpoint_opt_param_scheduler else "check"


def restore_scheduler(scheduler, saved: dict[str, Any] | None, where: str, *, config, plan, iteration: int,
                      ramp=None):
    """Set ``scheduler`` (Megatron's OptimizerParamScheduler; None on an idle rank) from a loaded checkpoint's
    schedule (``saved``: its ``state_dict()``) by Megatron-LM's rule; returns the run's configuration (``config``,
    the RunConfig), changed only as below.

    Every rank calls this (idle ones too, with no scheduler), at the loaded ``iteration``, so a refusal is raised
    everywhere at once. Without a saved schedule the flags' schedule is replayed to the iteration (under
    --rampup-batch-size, ``ramp``: the samples consumed so far). With --use-checkpoint-opt_param-scheduler the
    returned config's training settings take the checkpoint's schedule, so a scheduler built later from it (a
    migration) agrees."""
    from hetu_ext.plan.core.batches import scheduler_unit

    training = config.training
    unit = scheduler_unit(training, config.packing, plan)
    if saved is None:
        if scheduler is not None:
            scheduler.step(increment=iteration * unit if ramp is None else ramp.consumed(iteration))
        return config
    policy = schedule_policy(training)
    state = resolve_schedule(saved, scheduler_settings(training, unit), policy=policy, unit=unit, where=where)
    if policy == "checkpoint":
        changes = {"lr": state["max_lr"], "min_lr": state["min_lr"], "lr_decay_style": state["lr_decay_style"]}
        if state["start_wd"] == state["end_wd"]:
            changes["weight_decay"] = state["start_wd"]
        if training.train_samples is not None:  # sample-based: the saved steps are samples
            warmup, decay = state["lr_warmup_steps"], state["lr_decay_steps"]
            changes["lr_decay_samples"] = int(decay)
            if float(warmup).is_integer():
                changes.update(lr_warmup_samples=int(warmup), lr_warmup_fraction=None)
            else:  # a fraction's warmup
                changes.update(lr_warmup_samples=0, lr_warmup_fraction=warmup / decay)
        else:
            for key, name in (("lr_warmup_steps", "lr_warmup_iters"), ("lr_decay_steps", "lr_decay_iters")):
                if state[key] % unit == 0:
                    changes[name] = state[key] // unit
                    if key == "lr_warmup_steps":
                        changes["lr_warmup_fraction"] = None
        config = dataclasses.replace(config, training=dataclasses.replace(training, **changes))
    if scheduler is not None:
        scheduler.load_state_dict(state)
    return config
