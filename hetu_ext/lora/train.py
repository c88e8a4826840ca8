"""LobRA's joint training: many tenants' adapters over one frozen base, on any plan, through pretrain_gpt.py.

``--hetu-lora-tenants FILE`` makes :func:`hetu_ext.cli.train.build_run` (where the command line is read) choose
:func:`build_lora_trainer`: the plan runtime builds Megatron-core's stage models with the tenants' adapters
installed (hetu_ext.lora.install), every step packs all tenants' sequences together across the plan's pipelines
(hetu_ext.lora.data), and the loss is

    L = sum over tenants t of (sum of t's token losses) / (t's tokens in the global batch),

so every adapter's gradient is that of its tenant trained alone on its own data, whatever pipeline, microbatch
or pack its tokens landed in (the gold test, tests/test_lobra_training.py). Everything else (Megatron's
schedule, DDP, optimizer, LR schedule, log lines, metrics) is the ordinary trainer's.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist

from hetu_ext.config import RunConfig
from hetu_ext.config.tenants import TenantSpec, load_tenants
from hetu_ext.megatron import checkpointing, host
from hetu_ext.megatron.data import make_tokenizer
from hetu_ext.megatron.launch_plan import check_launch
from hetu_ext.megatron.model import TrainingNumerics, optimizer_config
from hetu_ext.megatron.plan_runtime import build_plan_placement
from hetu_ext.train.step import StepKind, StepWork
from hetu_ext.megatron.switching import Switching
from hetu_ext.megatron.tokenizers import tokenizer_files
from hetu_ext.train.trainer import Trainer, emulated_layer_cost, make_scheduler, plan_id, straggler_monitor
from hetu_ext.model import inventory
from hetu_ext.runtime.straggler import LayerTimer

from .data import TenantCorpus, build_tenant_steps
from .install import LoRAConverter, routing_of
from .layers import TenantRouting
from .loss import tenant_forward_step, token_weights
from .pretrained import load_base, seed_base
from .switched import TenantGroupSteps, adapter_pieces
from .sync import LoRASync, attach_sync


@dataclass
class LoRATrainer(Trainer):
    """The trainer with tenants: the same loop, a tenant-aware step."""

    tenants: tuple[TenantSpec, ...] = ()
    lora: LoRASync | None = None
    normalisation: str = "tenant"
    """``tenant`` (LobRA's loss) or ``global``: one token mean over every tenant's tokens (a negative control:
    an adapter then depends on the other tenants' token counts)."""
    tenant_losses: list[list[float | None]] = field(default_factory=list)
    """Per step, each tenant's mean token loss (None when absent)."""
    base: dict | None = None
    """The frozen base (hetu_ext.lora.pretrained.base_record): the pretrained checkpoint's, else the seed's."""

    def __post_init__(self) -> None:
        self.steps = TenantSteps()
        self.plugin_pieces = self.migration_pieces

    def migration_pieces(self, placement, destination: bool) -> list:
        """The adapters and their Adam state as a migration's pieces (collective over the world: every rank
        migrates). Each tenant keeps its own Adam step, learned from the ranks that held it before."""
        from .checkpoint import adapter_pieces, local_tenant_steps

        if not destination:
            everyone: list = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, local_tenant_steps(placement))
            self._migrating_steps = {t: step for steps in everyone for t, step in steps.items()}
            return adapter_pieces(placement)
        return adapter_pieces(placement, steps=self._migrating_steps)

    def build_strategy(self, k: int):
        """HotSPa: strategy ``k``'s compute placement with the adapters and their reduction (collective)."""
        plan = self.switching.strategies.items[k].plan
        placement = build_plan_placement(self.config.training, self.spec, plan, self.host, self.numerics,
                                         with_optimizer=False, converter=self.converter)
        attach_sync(placement, plan, tuple(t.name for t in self.tenants), self.host.rank)
        self.attach_timer(placement, plan)
        return placement

    def build_placement(self, plan):
        """A migration's destination: the stage with adapters and their reduction (and, with
        --use-distributed-optimizer, the adapters' sharded optimizer) before the state moves (collective)."""
        placement, self.lora = place_tenants(self.config, self.spec, plan, self.host, self.numerics, self.converter,
                                             tuple(t.name for t in self.tenants))
        return placement

    def placement_changed(self) -> None:
        """After a migration: an idle rank's probe layer routed."""
        route_probe(self.placement, self.spec.seq_length)

    def _save(self, directory: str) -> None:
        """Save the tenants' adapters and Adam state (not the frozen base): hetu_ext.lora.checkpoint."""
        from .checkpoint import save_adapters

        start = time.perf_counter()
        blocking = self.iteration >= self.config.training.train_iters
        save_adapters(self, directory, blocking=blocking)
        blocking_s = time.perf_counter() - start
        if self.metrics is not None:
            self.metrics.event("checkpoint_save", iteration=self.iteration, directory=directory, format="hetu",
                               blocking_s=blocking_s, total_s=blocking_s if blocking else None)

    def load(self, directory: str) -> bool:
        """Resume the tenants' adapters and Adam state from ``directory`` into this plan (collective)."""
        from .checkpoint import load_adapters

        start = time.perf_counter()
        loaded = load_adapters(self, directory)
        if loaded and self.metrics is not None:
            seconds = time.perf_counter() - start
            self.metrics.event("checkpoint_load", iteration=self.iteration, directory=directory,
                               blocking_s=seconds, total_s=seconds)
        return loaded

    def tenant_losses_of(self, reports: list[dict]) -> list[float | None]:
        total = torch.zeros(2 * len(self.tenants), dtype=torch.float64)
        if self.placement.is_last_stage and self.placement.tp_rank == 0:
            for report in reports:
                total += report["tenant loss"].double().cpu()
        dist.all_reduce(total, group=self.placement.report_group)
        sums, counts = total[: len(self.tenants)], total[len(self.tenants):]
        return [float(s / n) if n else None for s, n in zip(sums, counts)]


class TenantSteps(StepKind):
    """One step of every tenant (hetu_ext.train.step): all tenants' sequences packed together, each token's loss
    weighted by its tenant (``normalisation``), the adapters stepped per tenant present (LoRASync)."""

    scheduler_increment = 1

    def open(self, trainer):
        return build_tenant_steps(trainer.tenants, method=trainer.config.packing.method,
                                  cost_model=trainer.config.packing.cost_model, spec=trainer.spec, plan=trainer.plan,
                                  pipeline=trainer.placement.pipeline_index, device=trainer.host.device,
                                  seed=trainer.config.training.seed, vocab_size=0, corpus=trainer.documents)

    def prepare(self, trainer, data) -> StepWork | None:
        counts = data.batches.tenant_tokens(trainer.iteration)
        if not counts.any():  # nobody has data: no step (every rank agrees: the batches are deterministic)
            trainer.tenant_losses.append([None] * len(trainer.tenants))
            return None
        step = data.step(trainer.iteration)
        weights = token_weights(counts, trainer.normalisation)
        return StepWork(microbatches=iter(step.microbatches), num_microbatches=len(step.microbatches),
                        samples=step.sequences, tokens=step.tokens, micro_batch_size=1, shapes=step.shapes,
                        extra={"counts": counts, "weights": weights, "predicted_s": list(step.predicted_s)})

    def observe(self, trainer, work: StepWork) -> None:
        trainer.monitor.use_microbatches(work.shapes)

    def forward_step(self, trainer, work: StepWork):
        weights = work.extra["weights"].to(trainer.host.device)
        return partial(tenant_forward_step, routing_of(trainer.model), weights, len(trainer.tenants))

    def optimizer_step(self, trainer, work: StepWork) -> tuple[bool, float | None]:
        present = [bool(n) for n in work.extra["counts"]]  # always an update: --fp16 is refused with tenants
        return True, trainer.lora.step(trainer.optimizer, present=present,
                                       clip_grad=trainer.config.training.clip_grad)

    def statistics(self, trainer, work: StepWork, reports: list) -> dict:
        trainer.tenant_losses.append(trainer.tenant_losses_of(reports))
        return {"microbatches": work.num_microbatches, "predicted_s": work.extra["predicted_s"],
                "tenant_tokens": [int(n) for n in work.extra["counts"]], "tenant_loss": trainer.tenant_losses[-1]}


def build_lora_trainer(config: RunConfig) -> LoRATrainer:
    """Check the launch and the tenants, start the process group, build the stage with adapters on the plan
    runtime (whatever ``--hetu-runtime`` says: the adapters' reduction needs it), attach the adapters' sync."""
    tenants = load_tenants(config.lora.tenants)
    if config.packing.method == "off":  # tenants are always packed; balanced is Hydraulis' two-stage assignment
        config = dataclasses.replace(config, packing=dataclasses.replace(config.packing, method="balanced"))
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    launch = check_launch(config, world_size)
    spec, plan = launch.spec, launch.plan
    tokenizer = make_tokenizer(config.data.tokenizer_type, config.data.vocab_size, tokenizer_files(config.data))
    training = config.training
    corpus = TenantCorpus(tenants, vocab_size=tokenizer.vocab_size, seed=training.seed)  # checked before groups
    force = {"auto": None, "on": True, "off": False}[config.parallel.cpu_patches]
    h = host.init_distributed(force_cpu=force, timeout_minutes=config.parallel.distributed_timeout_minutes,
                              backend=config.parallel.distributed_backend)
    numerics = TrainingNumerics.of(config.model, training, variable_seq_lengths=True)
    converter = LoRAConverter(tenants, seed=training.seed)
    placement, lora = place_tenants(config, spec, plan, h, numerics, converter, tuple(t.name for t in tenants))
    flops = inventory.training_flops_per_token(spec, seq_length=spec.seq_length, causal=True)  # MFU's convention
    layer_cost = emulated_layer_cost(config.straggler)  # --hetu-emulate-cost: layers padded to a cost table
    monitor = straggler_monitor(config.straggler, 1, config.logging.log_interval, spec, plan, h, placement)
    trainer = LoRATrainer(config=config, spec=spec, plan=plan, host=h, placement=placement,
                          scheduler=make_scheduler(training, config.packing, placement, plan), dataset=None,
                          numerics=numerics, documents=corpus, flops_per_token=flops, plan_key=plan_id(plan),
                          tenants=tenants, lora=lora, layer_cost=layer_cost, monitor=monitor, converter=converter,
                          migrations=launch.migrations,
                          timer=monitor.timer if monitor else (LayerTimer() if layer_cost else None))
    if launch.strategies is not None:  # --hetu-hotspa / --hetu-strategies: the adapters switch with the base
        trainer.switching = Switching(launch.strategies, home=placement, build=trainer.build_strategy,
                                      ranks_per_node=config.straggler.gpus_per_node, plugin_pieces=adapter_pieces)
        trainer.steps = TenantGroupSteps()
    if layer_cost is not None and placement.active:
        _gradient_into_first_layer(placement.model)
    trainer.attach_timer()
    trainer.follow_log_rank()
    route_probe(placement, spec.seq_length)
    trainer.base = seed_base(training.seed)
    if config.lora.pretrained_checkpoint:  # the base's weights (hetu_ext.lora.pretrained), before the adapters
        trainer.base = load_base(trainer, config.lora.pretrained_checkpoint)
    if config.checkpoint.load:  # the adapters and their Adam state (hetu_ext.lora.checkpoint)
        trainer.load(config.checkpoint.load)
    if config.checkpoint.save:  # the run's identity; another run's checkpoints there are refused before training
        checkpointing.prepare_save(trainer, config.checkpoint.save)
    return trainer


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
