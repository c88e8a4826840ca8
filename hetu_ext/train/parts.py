"""The trainer's checkpoint parts (hetu_ext.checkpoint.parts.Checkpointable), one per owner of training state.

:func:`training_parts` lists them in the order a load restores them: the data position first (it refuses a
checkpoint of other data settings before anything changes), then the progress, the LR schedule, the model and
optimizer tensors, the loss scaler, the RNG, and the straggler monitor's assumptions. Each part reads the trainer's
current placement when asked (a migration replaces it), so the list stays valid for the whole run. A plug-in
gives its own list (hetu_ext.train.plugin.TrainerPlugin.parts; LoRA's adapters replace the model and optimizer).

The keys are those of the record hetu_ext has always saved (a manifest's ``state``, a torch_dist save's
``hetu_common.pt``): ``iteration``, ``losses``, ``data``, ``scheduler``, ``optimizer_step``, ``grad_scaler``,
``assumed``, and the per-rank ``rng``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hetu_ext.checkpoint import CheckpointError
from hetu_ext.checkpoint.parts import Checkpointable, Part
from hetu_ext.megatron.state import (
    MOMENTS,
    data_settings,
    optimizer_step,
    restore_scaler_state,
    restore_scheduler,
    rng_state,
    scaler_state,
    set_rng_state,
    state_pieces,
)
from hetu_ext.runtime.reshard import Piece

if TYPE_CHECKING:
    from .trainer import Trainer


class _TrainerPart(Part):
    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer


class ProgressPart(_TrainerPart):
    """The iteration (the data position: every step's samples derive from it) and the losses so far."""

    name = "progress"
    keys = ("iteration", "losses")

    def state_dict(self) -> dict[str, Any]:
        return {"iteration": self.trainer.iteration, "losses": list(self.trainer.losses)}

    def load_state_dict(self, saved: dict[str, Any], where: str) -> None:
        self.trainer.iteration = saved["iteration"]
        self.trainer.losses = list(saved.get("losses") or [])


class DataPart(_TrainerPart):
    """The data settings that fix each step's samples (hetu_ext.megatron.state.data_settings): a resume under
    other values would skip or repeat samples, so it is refused, naming them (not checked when not recorded)."""

    name = "data position"
    keys = ("data",)

    def state_dict(self) -> dict[str, Any]:
        return {"data": data_settings(self.trainer.config, self.trainer.plan)}

    def load_state_dict(self, saved: dict[str, Any], where: str) -> None:
        if saved.get("data") is None:
            return
        now = data_settings(self.trainer.config, self.trainer.plan)
        changed = {k: (v, now[k]) for k, v in saved["data"].items() if k in now and now[k] != v}
        if changed:
            raise CheckpointError(f"{where} was trained with other data settings (saved, now): {changed}; resume "
                                  f"with the saved values so that step {saved['iteration'] + 1} reads the samples "
                                  "that follow, none skipped or repeated")


class SchedulerPart(_TrainerPart):
    """The LR and weight-decay schedule, restored by Megatron-LM's rule (hetu_ext.megatron.state.restore_scheduler;
    after the progress part: it replays the flags' schedule to the loaded iteration when none was saved)."""

    name = "LR schedule"
    keys = ("scheduler",)

    def state_dict(self) -> dict[str, Any]:
        scheduler = self.trainer.scheduler
        return {"scheduler": scheduler.state_dict() if scheduler is not None else None}

    def load_state_dict(self, saved: dict[str, Any], where: str) -> None:
        t = self.trainer
        t.config = restore_scheduler(t.scheduler, saved.get("scheduler"), where, config=t.config, plan=t.plan,
                                     iteration=t.iteration, ramp=t.ramp)


class ModelPart(_TrainerPart):
    """The model's parameters (``param/KEY``: this rank's shards, in the model's dtype)."""

    name = "model"

    def pieces(self) -> list[Piece]:
        return [p for p in state_pieces(self.trainer.placement) if p.key.startswith("param/")]

    def destinations(self, saved: dict[str, Any], names: set[str]) -> list[Piece]:
        return self.pieces()


class OptimizerPart(_TrainerPart):
    """The optimizer's fp32 master weights and moments (``master/``, ``exp_avg/``, ``exp_avg_sq/``; under a
    distributed optimizer its owned boxes) and Adam's step (hetu_ext.megatron.state.state_pieces). A load
    creates the moments the checkpoint holds, at its step."""

    name = "optimizer"
    keys = ("optimizer_step",)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer_step": optimizer_step(self.trainer.placement)}

    def pieces(self) -> list[Piece]:
        return [p for p in state_pieces(self.trainer.placement) if not p.key.startswith("param/")]

    def destinations(self, saved: dict[str, Any], names: set[str]) -> list[Piece]:
        step = saved.get("optimizer_step")
        moments = {m for m in MOMENTS if m in names} if step is not None else None
        return [p for p in state_pieces(self.trainer.placement, moments=moments, step=step)
                if not p.key.startswith("param/")]


class LossScalerPart(_TrainerPart):
    """--fp16's loss scalers (hetu_ext.megatron.state.scaler_state: the record Megatron-LM's loop keeps too)."""

    name = "loss scaler"
    keys = ("grad_scaler",)

    def state_dict(self) -> dict[str, Any]:
        return {"grad_scaler": scaler_state(self.trainer.placement.optimizer)}

    def load_state_dict(self, saved: dict[str, Any], where: str) -> None:
        restore_scaler_state(self.trainer.placement.optimizer, saved.get("grad_scaler"), where,
                             report=self.trainer.host.rank == 0)


class RNGPart(_TrainerPart):
    """This rank's Python, NumPy, torch and Megatron RNG states (per rank: restored only when the loading plan is
    the one that saved; the format leaves ``rng`` None otherwise)."""

    name = "RNG"
    keys = ("rng",)

    def state_dict(self) -> dict[str, Any]:
        return {"rng": rng_state(self.trainer.host.rank)}

    def load_state_dict(self, saved: dict[str, Any], where: str) -> None:
        if saved.get("rng") is not None:
            set_rng_state(saved["rng"])


class MonitorPart(_TrainerPart):
    """The straggler monitor's assumed slowdowns (rank -> x), so a resumed run detects against the same ones."""

    name = "straggler monitor"
    keys = ("assumed",)

    def state_dict(self) -> dict[str, Any]:
        monitor = self.trainer.monitor
        return {"assumed": {str(r): x for r, x in monitor.assumed.items()} if monitor is not None else None}

    def load_state_dict(self, saved: dict[str, Any], where: str) -> None:
        if saved.get("assumed") and self.trainer.monitor is not None:
            self.trainer.monitor.detector.assumed = {int(r): float(x) for r, x in saved["assumed"].items()}


def training_parts(trainer: Trainer) -> list[Checkpointable]:
    """The plain trainer's parts, in restore order."""
    return [DataPart(trainer), ProgressPart(trainer), SchedulerPart(trainer), ModelPart(trainer),
            OptimizerPart(trainer), LossScalerPart(trainer), RNGPart(trainer), MonitorPart(trainer)]
