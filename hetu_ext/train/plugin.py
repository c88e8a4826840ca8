"""What a plug-in may change in hetu_ext's trainer, as hooks (LoRA's tenants: hetu_ext/lora/plugin.py).

There is one trainer and one builder (hetu_ext.train.trainer.build_trainer); a plug-in is an object the builder
and the trainer ask at fixed points, never a subclass of the trainer. :class:`TrainerPlugin` is the plain run:
each hook does what the trainer does without a plug-in, so a plug-in overrides only what it changes.

When each hook runs:

* build_trainer, before any process group: :meth:`~TrainerPlugin.configure` (settings the plug-in implies), then
  :meth:`~TrainerPlugin.documents` (its corpus, checked before the ranks start);
* build_trainer and every migration: :meth:`~TrainerPlugin.build_placement` (this rank's stage under a plan, on
  the plan runtime; the uniform runtime's grid is built by the trainer unless :attr:`~TrainerPlugin.runtime` is
  ``plan``); HotSPa's compute placements too (``with_optimizer=False``);
* build_trainer, once the trainer exists: :meth:`~TrainerPlugin.attach` (its step kind, switching, base weights);
* a migration: :attr:`~TrainerPlugin.migration_pieces` (its state outside the model's, moved with the rest), then
  :meth:`~TrainerPlugin.placement_changed`;
* every save and load: :meth:`~TrainerPlugin.parts` (what the checkpoint holds: hetu_ext.checkpoint.parts).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from hetu_ext.checkpoint.parts import Checkpointable
from hetu_ext.megatron.plan_runtime import build_plan_placement
from hetu_ext.runtime.reshard import Piece

if TYPE_CHECKING:
    from hetu_ext.config import RunConfig
    from hetu_ext.megatron.placement import Placement

    from .trainer import Trainer


class TrainerPlugin:
    """The plain run's hooks (no plug-in)."""

    runtime: str | None = None
    """``plan``: every placement runs on the plan runtime whatever ``--hetu-runtime`` says (None: as the launch
    decides: Megatron's uniform grid for uniform plans)."""
    monitor_micro_batch: int | None = None
    """Samples per microbatch the straggler monitor prices (None: ``--micro-batch-size``)."""
    sequence_parallel: bool = True
    """False: the stage models are built without sequence parallelism whatever ``--sequence-parallel`` says."""
    hetu_only: str | None = None
    """Why the plug-in's checkpoints are in hetu's format only (None: any format ``--hetu-ckpt-format`` says)."""
    checkpoint_label: str = "checkpoint"
    """What the log lines call a checkpoint of this run."""
    converter: object | None = None
    """The model converter every stage model is built with (model.build_gpt_stage; LoRA's adapters)."""
    migration_pieces: Callable[[Placement, bool], list[Piece]] | None = None
    """``(placement, destination) -> pieces``: the plug-in's state outside the model's sharded state dict, as
    pieces a migration moves (migrate.py): the source's (``destination=False``, collective over the world) or the
    destination's to fill; None: it has none (a method of the plug-in where it has: LoRA's adapters)."""

    def configure(self, config: RunConfig) -> RunConfig:
        """The run's settings with what the plug-in implies (pure, before anything is checked)."""
        return config

    def documents(self, config: RunConfig, tokenizer) -> object | None:
        """The plug-in's corpus, read and checked before the process group starts (None: the run's own data)."""
        return None

    def build_placement(self, config: RunConfig, spec, plan, host, numerics, *,
                        with_optimizer: bool = True) -> Placement:
        """This rank's placement under ``plan`` on the plan runtime (collective): a migration's destination, or
        with ``with_optimizer=False`` a compute placement of HotSPa's strategies."""
        return build_plan_placement(config.training, spec, plan, host, numerics, with_optimizer=with_optimizer,
                                    use_distributed_optimizer=config.parallel.use_distributed_optimizer
                                    and with_optimizer, converter=self.converter)

    def attach(self, trainer: Trainer) -> None:
        """The plug-in's part of the built trainer (before any checkpoint is loaded)."""

    def placement_changed(self, trainer: Trainer) -> None:
        """After a migration built the new placement and moved the state (collective)."""

    def parts(self, trainer: Trainer) -> list[Checkpointable]:
        """What a checkpoint of this run holds, in restore order (hetu_ext/train/parts.py)."""
        from .parts import training_parts

        return training_parts(trainer)
