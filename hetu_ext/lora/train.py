"""LobRA's joint training: many tenants' adapters over one frozen base, on any plan, through pretrain_gpt.py.

``--hetu-lora-tenants FILE`` makes :func:`hetu_ext.cli.train.build_run` (where the command line is read) choose
:func:`build_lora_trainer`: hetu_ext's one trainer builder with the tenants' plug-in (hetu_ext.lora.plugin). The plan
runtime builds Megatron-core's stage models with the tenants' adapters
installed (hetu_ext.lora.install), every step packs all tenants' sequences together across the plan's pipelines
(hetu_ext.lora.data), and the loss is

    L = sum over tenants t of (sum of t's token losses) / (t's tokens in the global batch),

so every adapter's gradient is that of its tenant trained alone on its own data, whatever pipeline, microbatch
or pack its tokens landed in (the gold test, tests/test_lobra_training.py). Everything else (Megatron's
schedule, DDP, optimizer, LR schedule, log lines, metrics) is the ordinary trainer's.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from hetu_ext.config import RunConfig
from hetu_ext.config.tenants import load_tenants
from hetu_ext.train.step import StepKind, StepWork
from hetu_ext.train.trainer import Trainer, build_trainer

from .data import build_tenant_steps
from .install import routing_of
from .loss import tenant_forward_step, token_weights
from .plugin import LoRAPlugin


def tenant_losses_of(trainer: Trainer, reports: list[dict]) -> list[float | None]:
    """Each tenant's mean token loss of the step (None when absent): the last stages' sums over the used ranks."""
    tenants = len(trainer.plugin.tenants)
    total = torch.zeros(2 * tenants, dtype=torch.float64)
    if trainer.placement.is_last_stage and trainer.placement.tp_rank == 0:
        for report in reports:
            total += report["tenant loss"].double().cpu()
    dist.all_reduce(total, group=trainer.placement.report_group)
    sums, counts = total[:tenants], total[tenants:]
    return [float(s / n) if n else None for s, n in zip(sums, counts)]


class TenantSteps(StepKind):
    """One step of every tenant (hetu_ext.train.step): all tenants' sequences packed together, each token's loss
    weighted by its tenant (``normalisation``), the adapters stepped per tenant present (LoRASync)."""

    scheduler_increment = 1

    def open(self, trainer):
        return build_tenant_steps(trainer.plugin.tenants, method=trainer.config.packing.method,
                                  cost_model=trainer.config.packing.cost_model, spec=trainer.spec, plan=trainer.plan,
                                  pipeline=trainer.placement.pipeline_index, device=trainer.host.device,
                                  seed=trainer.config.training.seed, vocab_size=0, corpus=trainer.documents)

    def prepare(self, trainer, data) -> StepWork | None:
        counts = data.batches.tenant_tokens(trainer.iteration)
        if not counts.any():  # nobody has data: no step (every rank agrees: the batches are deterministic)
            trainer.plugin.tenant_losses.append([None] * len(trainer.plugin.tenants))
            return None
        step = data.step(trainer.iteration)
        weights = token_weights(counts, trainer.plugin.normalisation)
        return StepWork(microbatches=iter(step.microbatches), num_microbatches=len(step.microbatches),
                        samples=step.sequences, tokens=step.tokens, micro_batch_size=1, shapes=step.shapes,
                        extra={"counts": counts, "weights": weights, "predicted_s": list(step.predicted_s)})

    def observe(self, trainer, work: StepWork) -> None:
        trainer.monitor.use_microbatches(work.shapes)

    def forward_step(self, trainer, work: StepWork):
        weights = work.extra["weights"].to(trainer.host.device)
        return partial(tenant_forward_step, routing_of(trainer.model), weights, len(trainer.plugin.tenants))

    def optimizer_step(self, trainer, work: StepWork) -> tuple[bool, float | None]:
        present = [bool(n) for n in work.extra["counts"]]  # always an update: --fp16 is refused with tenants
        return True, trainer.plugin.lora.step(trainer.optimizer, present=present,
                                              clip_grad=trainer.config.training.clip_grad)

    def statistics(self, trainer, work: StepWork, reports: list) -> dict:
        losses = trainer.plugin.tenant_losses
        losses.append(tenant_losses_of(trainer, reports))
        return {"microbatches": work.num_microbatches, "predicted_s": work.extra["predicted_s"],
                "tenant_tokens": [int(n) for n in work.extra["counts"]], "tenant_loss": losses[-1]}


def build_lora_trainer(config: RunConfig) -> Trainer:
    """hetu_ext's trainer with the tenants of ``--hetu-lora-tenants`` as its plug-in (hetu_ext.lora.plugin): the
    stage with adapters on the plan runtime (whatever ``--hetu-runtime`` says: the adapters' reduction needs it),
    the tenants' steps, the adapters' checkpoints."""
    tenants = load_tenants(config.lora.tenants)
    return build_trainer(config, plugin=LoRAPlugin(tenants, seed=config.training.seed))
