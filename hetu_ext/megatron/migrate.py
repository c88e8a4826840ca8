"""Online migration of a running job to a new plan: no restart, no disk.

Every rank (idle ones too) builds its place in the new plan (groups, stage model, DDP, optimizer), then the
reshard engine moves the parameters and the optimizer's state from the old layout to the new one by
point-to-point transfers, local copies first: with ``--bf16`` the fp32 master weights (the bf16 model weights are
then cast from them, as after an optimizer step; the same under ``--fp16``), Adam's moments or SGD's momentum.
Adam's step count (the updates made: under ``--fp16`` fewer than the iterations, by the skipped ones), the
``--fp16`` loss scaler's state, the LR schedule and the data position carry over, so the run continues exactly as
it would have on the old plan (tests/test_migration.py, tests/test_trainer_fp16.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hetu_ext.runtime.reshard import Piece, reshard

from .placement import Placement
from .state import optimizer_step, optimizer_steps, optimizers, restore_scaler_state, scaler_state
from .weights import local_shards

_MOMENTS = {"adam": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}


@dataclass(frozen=True)
class MigrationReport:
    bytes_sent: int
    bytes_kept: int
    seconds: float


def _megatron_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def master_weights(optimizer) -> dict[int, torch.Tensor]:
    """Model parameter id -> its fp32 master copy in the optimizer (--bf16); fp32 parameters are their own."""
    out = {}
    for opt in _megatron_optimizers(optimizer):
        for models, mains in zip(getattr(opt, "float16_groups", []), getattr(opt, "fp32_from_float16_groups", [])):
            out.update((id(model), main) for model, main in zip(models, mains))
    return out


def _new_state(opt: torch.optim.Optimizer, param: torch.Tensor, step: int) -> dict:
    """The state an optimizer has for ``param`` after ``step`` steps, zero-filled (the reshard fills it)."""
    if isinstance(opt, torch.optim.SGD):
        momentum = opt.param_groups[0].get("momentum", 0)
        return {"momentum_buffer": torch.zeros_like(param.data)} if momentum else {}
    return {"step": torch.tensor(float(step)), **{m: torch.zeros_like(param.data) for m in _MOMENTS["adam"]}}


def _pieces(placement: Placement, *, create_state_at_step: int | None = None) -> list[Piece]:
    """This rank's parameters (fp32 masters under --bf16) and optimizer state as reshard pieces (empty on idle
    ranks)."""
    if not placement.active:
        return []
    states = {}
    for opt in (o.optimizer for o in _megatron_optimizers(placement.optimizer)):
        for group in opt.param_groups:
            for p in group["params"]:
                if create_state_at_step is not None:
                    opt.state[p] = _new_state(opt, p, create_state_at_step)
                states[id(p)] = opt.state.get(p, {})
    sharded = getattr(placement.optimizer, "hetu_sharded", None)
    if sharded is not None:  # --- the plan runtime's sharded optimizer: owned boxes (masters under --bf16)
        entries = sharded.entries()
        # every holder's weights where the optimizer keeps no fp32 master: fp32 models, and frozen parameters
        # (a plug-in's base, e.g. LoRA's) in bf16 too
        pieces = [Piece(f"param:{s.key}", s.index, tuple((sl.start, sl.stop) for sl in s.slices), s.data.data)
                  for s in local_shards(placement.model, **placement.shard_kwargs)
                  if s.param.dtype == torch.float32 or not s.param.requires_grad]
        for e in entries:
            if e.master is not None:
                pieces.append(Piece(f"param:{e.key}", e.index, e.box, e.master.data))
            pieces.extend(Piece(f"{m}:{e.key}", e.index, e.box, e.state[m])
                          for m in (*_MOMENTS["adam"], *_MOMENTS["sgd"]) if e.state.get(m) is not None)
        return pieces
    masters = master_weights(placement.optimizer)
    pieces = []
    for s in local_shards(placement.model, **placement.shard_kwargs):
        box = tuple((sl.start, sl.stop) for sl in s.slices)
        master = masters.get(id(s.param), s.param)
        pieces.append(Piece(f"param:{s.key}", s.index, box, s.view(master.data)))
        state = states.get(id(master), {})
        for m in (*_MOMENTS["adam"], *_MOMENTS["sgd"]):
            if state.get(m) is not None:
                pieces.append(Piece(f"{m}:{s.key}", s.index, box, s.view(state[m])))
    return pieces


def _carried(old: Placement, *, plugin_steps: bool = False) -> tuple[list[dict] | None, int | None]:
    """What every rank of the new plan needs from the old one's used ranks (collective over every rank; the same
    on all of them): the loss scaler's state (--fp16) and the updates the optimizer made (Adam's step; 0 for an
    optimizer with state but no step count, SGD's momentum; None when it holds no state yet). ``plugin_steps``: a
    plug-in moves its parameters' Adam steps itself (LoRA: each tenant its own, which differ after a tenant's
    absence), so they may differ here; the most updates any parameter made is taken (the plug-in's pieces then set
    each of its parameters' own)."""
    mine = (None, None)
    if old.active:
        held = any(opt.state for opt in optimizers(old.optimizer))
        step = max(optimizer_steps(old), default=None) if plugin_steps else optimizer_step(old)
        mine = (scaler_state(old.optimizer), None if step is None and not held else int(step or 0))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    scaler = next((s for s, _ in everyone if s is not None), None)
    steps = [n for _, n in everyone if n is not None]
    return scaler, max(steps) if steps else None


def migrate(old: Placement, build_new, iteration: int, *, plugin_pieces=None) -> tuple[Placement, MigrationReport]:
    """Build the new placement (``build_new()``, collective) and move the old one's state into it.
    ``plugin_pieces(placement, destination)``: a plug-in's own state outside the model's sharded state dict
    (LoRA's adapters and their Adam state) as pieces, moved in the same exchange. ``iteration``: the steps run
    so far (the updates made can be fewer: --fp16's skipped steps)."""
    start = time.perf_counter()
    scaler, updates = _carried(old, plugin_steps=plugin_pieces is not None)
    sources = _pieces(old) + (plugin_pieces(old, False) if plugin_pieces else [])
    new = build_new()
    destinations = _pieces(new, create_state_at_step=updates if iteration > 0 else None)
    destinations += plugin_pieces(new, True) if plugin_pieces else []
    report = reshard(sources, destinations)
    if new.active:  # --bf16: the model's weights are the masters cast down, as after an optimizer step
        for opt in _megatron_optimizers(new.optimizer):
            if getattr(opt, "float16_groups", None):
                opt._copy_main_params_to_model_params()
        if getattr(new.optimizer, "hetu_sharded", None) is not None:  # sharded: owners -> every holder
            new.optimizer.hetu_sharded.sync.gather()
        restore_scaler_state(new.optimizer, scaler, f"the migration after step {iteration}", report=False)
    return new, MigrationReport(bytes_sent=report.bytes_sent, bytes_kept=report.bytes_copied_locally,
                                seconds=time.perf_counter() - start)


