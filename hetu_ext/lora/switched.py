"""Tenants under HotSPa's switching layer (``--hetu-hotspa``, or Hydraulis' ``--hetu-strategies``): a step's
sequences of every tenant split into length groups, each trained under its own strategy (hetu_ext.megatron.switching),
the adapters switched with the base.

What changes against a plain switched step (hetu_ext.train.step.SwitchedGroupSteps):

* every strategy's packs are the tenants' packs (hetu_ext.lora.data, tokens tagged with their tenant), over the
  same global batches, so the groups partition the step's sequences of every tenant;
* every strategy's stage models carry the adapters (the run's model converter) and the adapters' own reduction
  (hetu_ext.lora.sync: no division: each token's loss is already weighted by 1 / its tenant's tokens in the
  *whole step*, so the groups add up to the tenant's token mean over the global batch);
* a switch pushes the adapters with the base's weights and pulls their gradients (the frozen base has none);
* the home steps per tenant (per-tenant clipping, absent tenants not stepped), as without switching.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from hetu_ext.train.step import StepWork, SwitchedGroupSteps
from hetu_ext.megatron.switching import SwitchedSteps
from hetu_ext.runtime.reshard import Piece

from .adapters import adapter_shards
from .data import build_tenant_steps
from .install import routing_of
from .loss import tenant_forward_step, token_weights


def adapter_pieces(placement, kind: str) -> list[Piece]:
    """This rank's adapter weights (``param``, the model's dtype) or gradients (``grad``, fp32 main_grad)."""
    out = []
    for s in adapter_shards(placement.model, layer_offset=placement.shard_kwargs.get("layer_offset", 0)):
        tensor = s.view(s.param.data if kind == "param" else s.param.main_grad)
        out.append(Piece(f"{kind}:{s.key}", s.index, tuple((sl.start, sl.stop) for sl in s.slices), tensor))
    return out


class TenantGroupSteps(SwitchedGroupSteps):
    """One step of every tenant, its length groups under their strategies."""

    def strategy_data(self, trainer, strategy, pipeline: int | None):
        """The tenants' packs for one strategy (at most its ``max_len`` tokens), over the same global batches."""
        packing = trainer.config.packing
        return build_tenant_steps(trainer.plugin.tenants, method=packing.method, cost_model=packing.cost_model,
                                  spec=trainer.spec, plan=strategy.plan, pipeline=pipeline,
                                  device=trainer.host.device, seed=trainer.config.training.seed, vocab_size=0,
                                  corpus=trainer.documents, max_pack_tokens=strategy.max_len)

    def prepare(self, trainer, data: SwitchedSteps) -> StepWork | None:
        counts = data.batches.tenant_tokens(trainer.iteration)
        if not counts.any():  # nobody has data: no step (every rank agrees: the batches are deterministic)
            trainer.plugin.tenant_losses.append([None] * len(trainer.plugin.tenants))
            return None
        work = super().prepare(trainer, data)
        work.extra.update(counts=counts, weights=token_weights(counts, trainer.plugin.normalisation))
        return work

    def execute(self, trainer, work: StepWork) -> list:
        weights, tenants = work.extra["weights"].to(trainer.host.device), len(trainer.plugin.tenants)

        def run_schedule(placement, step):
            return placement.forward_backward(
                forward_step_func=partial(tenant_forward_step, routing_of(placement.model), weights, tenants),
                data_iterator=iter(step.microbatches), model=[placement.model],
                num_microbatches=len(step.microbatches), seq_length=trainer.spec.seq_length, micro_batch_size=1,
                forward_only=False, **placement.schedule_kwargs)

        results, switches = trainer.switching.run(work.extra["step"], run_schedule)
        work.extra["switches"] = switches
        return results

    def optimizer_step(self, trainer, work: StepWork) -> tuple[bool, float | None]:
        present = [bool(n) for n in work.extra["counts"]]  # always an update: --fp16 is refused with tenants
        return True, trainer.plugin.lora.step(trainer.optimizer, present=present,
                                       clip_grad=trainer.config.training.clip_grad)

    def statistics(self, trainer, work: StepWork, reports: list) -> dict:
        total = torch.zeros(2 * len(trainer.plugin.tenants), dtype=torch.float64)
        for k, group_reports in reports:
            placement = trainer.switching.placement(k)
            if placement.active and placement.is_last_stage and placement.tp_rank == 0:
                for report in group_reports:
                    total += report["tenant loss"].double().cpu()
        dist.all_reduce(total, group=trainer.placement.report_group)
        n = len(trainer.plugin.tenants)
        trainer.plugin.tenant_losses.append([float(s / c) if c else None for s, c in zip(total[:n], total[n:])])
        out = super().statistics(trainer, work, reports)
        out.update(tenant_tokens=[int(c) for c in work.extra["counts"]],
                   tenant_loss=trainer.plugin.tenant_losses[-1])
        return out
