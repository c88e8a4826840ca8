"""LobRA's tenants as a plug-in of hetu_ext's trainer (hetu_ext.train.plugin.TrainerPlugin), not a subclass of it.

:class:`LoRAPlugin` changes, at the trainer's hooks: the settings (tenants' sequences are always packed), the data
(the tenants' corpus), every placement (the plan runtime's stage with the tenants' adapters installed, their
reduction and step: hetu_ext.lora.sync; also HotSPa's compute placements and a migration's destination), the step
kind (hetu_ext.lora.train.TenantSteps, or TenantGroupSteps when switching), what a migration and a switch move
besides the model (the adapters and their Adam state), and what a checkpoint holds: the adapters part
(:class:`AdaptersPart`) instead of the frozen base's model and optimizer. Everything else (the loop, Megatron's
schedule, DDP, optimizer, LR schedule, straggler monitor, log lines, metrics) is the ordinary trainer's.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hetu_ext.checkpoint import CheckpointError
from hetu_ext.checkpoint.parts import Checkpointable, Part
from hetu_ext.config import RunConfig
from hetu_ext.config.tenants import TenantSpec
from hetu_ext.megatron.model import optimizer_config
from hetu_ext.megatron.plan_runtime import build_plan_placement
from hetu_ext.runtime.reshard import Piece
from hetu_ext.train.parts import ProgressPart, RNGPart, SchedulerPart
from hetu_ext.train.plugin import TrainerPlugin

from .data import TenantCorpus
from .install import LoRAConverter
from .layers import TenantRouting
from .sync import LoRASync, attach_sync

if TYPE_CHECKING:
    from hetu_ext.train.trainer import Trainer


class LoRAPlugin(TrainerPlugin):
    """The tenants of ``--hetu-lora-tenants`` and their state on this rank."""

    runtime = "plan"  # the adapters' reduction needs the plan runtime, whatever --hetu-runtime says
    monitor_micro_batch = 1  # one THD pack per microbatch
    sequence_parallel = False  # the adapters' stage is built without it (as since LobRA's first version)
    hetu_only = "LoRA adapters are saved in (hetu_ext.lora.checkpoint)"
    checkpoint_label = "adapters checkpoint"

    def __init__(self, tenants: tuple[TenantSpec, ...], *, seed: int) -> None:
        self.tenants = tenants
        self.converter = LoRAConverter(tenants, seed=seed)
        self.lora: LoRASync | None = None
        """The home placement's adapter reduction and per-tenant step (hetu_ext.lora.sync)."""
        self.normalisation = "tenant"
        """``tenant`` (LobRA's loss) or ``global``: one token mean over every tenant's tokens (a negative control:
        an adapter then depends on the other tenants' token counts)."""
        self.tenant_losses: list[list[float | None]] = []
        """Per step, each tenant's mean token loss (None when absent)."""
        self.base: dict | None = None
        """The frozen base (hetu_ext.lora.pretrained.base_record): the pretrained checkpoint's, else the seed's."""
        self._migrating_steps: dict[str, float | None] = {}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tenants)

    def configure(self, config: RunConfig) -> RunConfig:
        """Tenants are always packed (``balanced``, Hydraulis' two-stage assignment, unless another is given)."""
        if config.packing.method == "off":
            return dataclasses.replace(config, packing=dataclasses.replace(config.packing, method="balanced"))
        return config

    def documents(self, config: RunConfig, tokenizer) -> TenantCorpus:
        """Every tenant's documents, checked before the process group starts."""
        return TenantCorpus(self.tenants, vocab_size=tokenizer.vocab_size, seed=config.training.seed)

    def build_placement(self, config: RunConfig, spec, plan, host, numerics, *, with_optimizer: bool = True):
        """The stage with the adapters and their reduction (collective); with ``with_optimizer`` (the home
        placement) also their step, kept as :attr:`lora`, and with --use-distributed-optimizer their sharded
        optimizer."""
        if not with_optimizer:  # HotSPa's compute placement: the adapters and their reduction
            placement = build_plan_placement(config.training, spec, plan, host, numerics, with_optimizer=False,
                                             converter=self.converter)
            attach_sync(placement, plan, self.names, host.rank)
            return placement
        placement, self.lora = place_tenants(config, spec, plan, host, numerics, self.converter, self.names)
        return placement

    def attach(self, trainer: Trainer) -> None:
        """The tenants' step kind, the adapters switched with the base (HotSPa), the probe layer routed, the
        emulation's gradient path, and the frozen base (the seed's, or --pretrained-checkpoint's: before any
        checkpoint of the adapters loads)."""
        from .pretrained import load_base, seed_base
        from .switched import TenantGroupSteps, adapter_pieces
        from .train import TenantSteps

        trainer.steps = TenantSteps()
        if trainer.switching is not None:  # --hetu-hotspa / --hetu-strategies: the adapters switch with the base
            trainer.switching.plugin_pieces = adapter_pieces
            trainer.steps = TenantGroupSteps()
        if trainer.layer_cost is not None and trainer.placement.active:
            _gradient_into_first_layer(trainer.placement.model)
        route_probe(trainer.placement, trainer.spec.seq_length)
        self.base = seed_base(trainer.config.training.seed)
        if trainer.config.lora.pretrained_checkpoint:
            self.base = load_base(trainer, trainer.config.lora.pretrained_checkpoint)

    def migration_pieces(self, placement, destination: bool) -> list[Piece]:
        """The adapters and their Adam state as a migration's pieces (collective over the world: every rank
        migrates). Each tenant keeps its own Adam step, learned from the ranks that held it before."""
        from .checkpoint import adapter_pieces, local_tenant_steps

        if not destination:
            everyone: list = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, local_tenant_steps(placement))
            self._migrating_steps = {t: step for steps in everyone for t, step in steps.items()}
            return adapter_pieces(placement)
        return adapter_pieces(placement, steps=self._migrating_steps)

    def placement_changed(self, trainer: Trainer) -> None:
        """After a migration: an idle rank's probe layer routed."""
        route_probe(trainer.placement, trainer.spec.seq_length)

    def parts(self, trainer: Trainer) -> list[Checkpointable]:
        """The progress, the LR schedule, the adapters and the RNG; the frozen base is not saved (its record is:
        hetu_ext.lora.checkpoint)."""
        return [ProgressPart(trainer), SchedulerPart(trainer), AdaptersPart(trainer, self), RNGPart(trainer)]


class AdaptersPart(Part):
    """The tenants' adapters and their Adam moments as pieces, and per tenant its Adam step, losses and LoRA
    record (hetu_ext.lora.checkpoint's format: the record is checked against the tenants file before a load)."""

    name = "LoRA adapters"
    keys = ("tenant_losses", "tenant_steps", "lora")

    def __init__(self, trainer: Trainer, plugin: LoRAPlugin) -> None:
        self.trainer, self.plugin = trainer, plugin

    def state_dict(self) -> dict[str, Any]:
        """Collective over the plan's used ranks (the tenants' Adam steps are gathered)."""
        from .checkpoint import lora_record, tenant_steps

        config = self.trainer.config
        return {"tenant_losses": [list(row) for row in self.plugin.tenant_losses],
                "tenant_steps": tenant_steps(self.trainer.placement, self.plugin.tenants),
                "lora": lora_record(self.plugin.tenants, seed=config.training.seed,
                                    seq_length=config.model.seq_length, base=self.plugin.base)}

    def pieces(self) -> list[Piece]:
        from .checkpoint import adapter_pieces

        return adapter_pieces(self.trainer.placement)

    def destinations(self, saved: dict[str, Any], names: set[str]) -> list[Piece]:
        from .checkpoint import adapter_pieces, check_tenants

        config = self.trainer.config
        where = f"--load {config.checkpoint.load} (iteration {saved.get('iteration')})"
        error = check_tenants(saved.get("lora"), self.plugin.tenants, seed=config.training.seed,
                              seq_length=config.model.seq_length, where=where, base=self.plugin.base)
        if error is not None:
            raise CheckpointError(error)
        return adapter_pieces(self.trainer.placement, steps=saved.get("tenant_steps", {}))

    def load_state_dict(self, saved: dict[str, Any], where: str) -> None:
        """--bf16: the model's adapter weights cast from their loaded fp32 masters; the tenants' losses so far."""
        from .checkpoint import cast_masters_down

        cast_masters_down(self.trainer.placement)
        self.plugin.tenant_losses = [list(row) for row in saved.get("tenant_losses") or []]


def place_tenants(config: RunConfig, spec, plan, h, numerics, converter, tenants: tuple[str, ...]):
    """This rank's stage under ``plan`` with the tenants' adapters, and their reduction and step (collective):
    (placement, LoRASync). With --use-distributed-optimizer the stage is built without an optimizer and the
    adapters' sharded one is attached (hetu_ext.lora.sync.attach_sync)."""
    training, sharded = config.training, config.parallel.use_distributed_optimizer
    placement = build_plan_placement(training, spec, plan, h, numerics, converter=converter, with_optimizer=not sharded)
    lora = attach_sync(placement, plan, tenants, h.rank,
                       sharded_optimizer=optimizer_config(training, numerics) if sharded else None)
    return placement, lora


def route_probe(placement, seq_length: int) -> None:
    """An idle rank's probe layer (the straggler monitor times one layer to keep the rank measured) carries
    adapters too: route its tokens (one pack of ``seq_length``, as the monitor sends) to the first tenant."""
    layer = placement.probe_layer
    if placement.active or layer is None:
        return
    routings = {id(m.routing): m.routing for m in layer.modules() if isinstance(getattr(m, "routing", None),
                                                                                  TenantRouting)}
    for routing in routings.values():
        routing.set(torch.zeros((1, seq_length), dtype=torch.long))


def _gradient_into_first_layer(model) -> None:
    """Emulation only: the layer timer pads a layer's backward between the gradient reaching its output and
    leaving its input; with a frozen embedding no gradient leaves the first layer's input, so its backward would
    not be padded (measured: a 4-layer stage ran 14% under the cost table). Make the embedding's output require
    a gradient, as it does when the base trains."""
    module = model
    while not hasattr(module, "embedding") and hasattr(module, "module"):
        module = module.module
    embedding = getattr(module, "embedding", None)
    if embedding is None:
        return

    def hook(_module, _inputs, output):
        if torch.is_grad_enabled() and not output.requires_grad:
            return output.detach().requires_grad_()
        return None

    embedding.register_forward_hook(hook)
