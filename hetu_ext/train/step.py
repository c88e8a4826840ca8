"""One training step, written once: every kind of step (plain microbatches, packed documents, HotSPa / Hydraulis
switching, LoRA tenants) is a configuration of :func:`run_step`, not a copy of it.

The order, for every kind::

    work = kind.prepare(trainer, data)        # the step's data: microbatches (or groups), samples, tokens
    monitor / emulation timer hooks           # the straggler monitor sees the microbatch shapes it will time
    reports = kind.execute(trainer, work)     # zero the gradients, run the schedule(s): one placement or several
    updated, grad_norm = kind.optimizer_step(trainer)  # Megatron's optimizer (sharded or not), or per tenant
    LR scheduler step (not after a skipped update: --fp16's overflow), iteration + 1
    loss = kind.loss(trainer, work, reports)  # the global batch's per-token mean (per tenant for LoRA)
    replan = monitor.after_step(...)          # the monitor may propose a plan
    -> StepResult (typed), with the kind's statistics for the metrics record

A kind whose ``prepare`` returns None has nothing to run this step (LoRA: no tenant has data): the schedule
still advances and the loss is NaN.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from hetu_ext.megatron.context_parallel import cp_batches
from hetu_ext.megatron.data import microbatch_iterator
from hetu_ext.megatron.packed_data import PackedSteps, build_packed_steps
from hetu_ext.megatron.switching import SwitchedSteps, local_loss, predicted_switch_s
from hetu_ext.plan.core.batches import global_batch_size, scheduler_unit, step_microbatches
from hetu_ext.runtime.straggler import factor_at, parse_schedule


@dataclass(frozen=True)
class StepResult:
    """What one step reports to the loop (the same on every used rank)."""

    loss: float
    """Per-token mean loss of the global batch (NaN for a step with no data)."""
    grad_norm: float | None
    """None for a skipped update (and for a step with no data)."""
    replan: Any
    """The plan the straggler monitor proposes after this step, or None."""
    samples: int
    tokens: int
    statistics: dict | None = None
    """The kind's figures for the metrics record (packing, hotspa, hydraulis, tenants), or None."""
    skipped: bool = False
    """--fp16: the gradients overflowed, so the optimizer did not update (Megatron-LM's skipped iteration: the LR
    schedule did not advance, the loss scaler backed off); the data position advanced all the same."""


@dataclass
class StepWork:
    """One step's data as the kind prepared it."""

    microbatches: Any
    num_microbatches: int
    samples: int
    tokens: int
    shapes: Any = None
    """What the monitor's timer needs to price the microbatches (packed: their shapes; switching: per group)."""
    micro_batch_size: int | None = None
    """Sequences per microbatch as the schedule is told (None: --micro-batch-size; a THD pack is 1)."""
    extra: dict = field(default_factory=dict)


def forward_step(data_iterator, model):
    """One microbatch through a stage; the loss is a token sum (normalised once per global batch)."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                   packed_seq_params=batch.get("packed_seq_params"))
    return output, partial(_loss_func, batch["loss_mask"])


def _loss_func(loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    mask = loss_mask.view(-1).float()
    loss = torch.sum(per_token_loss.view(-1).float() * mask)  # (b*s,) -> scalar sum
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss.detach().clone(), num_tokens.detach().float()])
    return loss, num_tokens, {"lm loss": report}


class StepKind:
    """The parts of a step that differ between kinds; the defaults are the plain trainer's."""

    scheduler_increment: int | None = None
    """LR schedule units per step (None: the trainer's ``scheduler_unit``)."""

    def open(self, trainer):
        """This pipeline's data from the trainer's current step on (closed by the loop: ``close()`` if it has it)."""
        raise NotImplementedError

    def prepare(self, trainer, data) -> StepWork | None:
        raise NotImplementedError

    def observe(self, trainer, work: StepWork) -> None:
        """Tell the monitor the shapes it is about to time (packed, switched)."""

    def execute(self, trainer, work: StepWork) -> list:
        trainer.model.zero_grad_buffer()
        trainer.optimizer.zero_grad()
        placement = trainer.placement
        return placement.forward_backward(
            forward_step_func=self.forward_step(trainer, work),
            data_iterator=cp_batches(work.microbatches, placement),
            model=[placement.model], num_microbatches=work.num_microbatches, seq_length=trainer.spec.seq_length,
            micro_batch_size=work.micro_batch_size or trainer.config.training.micro_batch_size, forward_only=False,
            **placement.schedule_kwargs)

    def forward_step(self, trainer, work: StepWork):
        return forward_step

    def optimizer_step(self, trainer, work: StepWork) -> tuple[bool, float | None]:
        """(whether the parameters were updated, the global grad norm). Megatron's mixed-precision optimizer
        returns False under --fp16 when a gradient overflowed; every used rank agrees (its found-inf flag is
        all-reduced over the optimizer's grad-stats group: the plan's used ranks)."""
        updated, grad_norm, _ = trainer.optimizer.step()
        return bool(updated), grad_norm

    def loss(self, trainer, work: StepWork, reports: list) -> float:
        return trainer.global_loss(reports)

    def statistics(self, trainer, work: StepWork, reports: list) -> dict | None:
        return None


class MicrobatchSteps(StepKind):
    """Megatron samples in fixed-shape microbatches, the plan's count per pipeline."""

    def open(self, trainer):
        training = trainer.config.training
        return microbatch_iterator(trainer.dataset, trainer.plan, trainer.placement.pipeline_index,
                                   training.micro_batch_size, start_iteration=trainer.iteration,
                                   num_iterations=training.train_iters - trainer.iteration,
                                   device=trainer.host.device, ramp=trainer.ramp)

    def prepare(self, trainer, data) -> StepWork:
        training, placement, ramp = trainer.config.training, trainer.placement, trainer.ramp
        # --rampup-batch-size: this step's global batch, shared among the pipelines (plan/core/batches.py)
        samples = global_batch_size(trainer.plan, training.micro_batch_size) if ramp is None else \
            ramp.batch(trainer.iteration)
        counts = step_microbatches(trainer.plan, ramp, trainer.iteration, training.micro_batch_size)
        return StepWork(microbatches=data, num_microbatches=counts[placement.pipeline_index], samples=samples,
                        tokens=samples * trainer.spec.seq_length)


class PackedDocumentSteps(StepKind):
    """--hetu-packing: the packer's packs (THD microbatches) of this pipeline."""

    def open(self, trainer) -> PackedSteps:
        training = trainer.config.training
        return build_packed_steps(trainer.config.packing, trainer.spec, trainer.plan,
                                  trainer.placement.pipeline_index, trainer.documents, trainer.host.device,
                                  seed=training.seed, global_batch_size=training.global_batch_size,
                                  slowdowns=trainer.monitor.assumed if trainer.monitor else None)

    def prepare(self, trainer, data: PackedSteps) -> StepWork:
        step = data.step(trainer.iteration)
        return StepWork(microbatches=iter(step.microbatches), num_microbatches=len(step.microbatches),
                        samples=step.sequences, tokens=step.tokens, shapes=step.shapes,
                        extra={"predicted_s": list(step.predicted_s)})

    def observe(self, trainer, work: StepWork) -> None:
        trainer.monitor.use_microbatches(work.shapes)

    def statistics(self, trainer, work: StepWork, reports: list) -> dict:
        return {"microbatches": work.num_microbatches, "predicted_s": work.extra["predicted_s"]}


class SwitchedGroupSteps(StepKind):
    """HotSPa / Hydraulis: the step's groups, each under its strategy's compute placement (switching.py), the
    gradients pulled into the home layout, one optimizer step at home."""

    scheduler_increment = 1

    def open(self, trainer) -> SwitchedSteps:
        """Each strategy's packer over the same global batches, and the grouping (or the candidate) of each step."""
        packing, training, strategies = trainer.config.packing, trainer.config.training, trainer.switching.strategies
        per_strategy = []
        for strategy in strategies.items:
            where = strategy.plan.stage_of(trainer.host.rank)
            steps = self.strategy_data(trainer, strategy, where[0] if where else None)
            steps.close()  # planning ahead happens once, for the whole step, in SwitchedSteps
            per_strategy.append(steps)
        switch_s = predicted_switch_s(strategies, trainer.spec, weight_bytes=2 if training.bf16 or training.fp16 else 4,
                                      bandwidth=packing.hotspa_bandwidth_gbs * 1e9)
        mode = "select" if packing.strategies else "auto" if packing.hotspa == "auto" else "fixed"
        return SwitchedSteps(per_strategy, strategies, mode=mode, spec=trainer.spec, cost=per_strategy[0].cost,
                             switch_s=switch_s)

    def strategy_data(self, trainer, strategy, pipeline: int | None) -> PackedSteps:
        """One strategy's packs (at most its ``max_len`` tokens) of its ``pipeline`` (None: this rank runs none of
        them), over the run's global batches."""
        training = trainer.config.training
        return build_packed_steps(trainer.config.packing, trainer.spec, strategy.plan, pipeline, trainer.documents,
                                  trainer.host.device, seed=training.seed,
                                  global_batch_size=training.global_batch_size, max_pack_tokens=strategy.max_len)

    def prepare(self, trainer, data: SwitchedSteps) -> StepWork:
        step = data.step(trainer.iteration)
        items = trainer.switching.strategies.items
        shapes = [(items[g.strategy].plan, g.data.shapes) for g in step.groups if g.data]
        return StepWork(microbatches=None, num_microbatches=0, samples=step.sequences, tokens=step.tokens,
                        shapes=shapes, extra={"step": step, "data": data})

    def observe(self, trainer, work: StepWork) -> None:
        trainer.monitor.use_group_microbatches(work.shapes)

    def execute(self, trainer, work: StepWork) -> list:
        results, switches = trainer.switching.run(work.extra["step"], trainer.run_schedule)
        work.extra["switches"] = switches
        return results

    def loss(self, trainer, work: StepWork, reports: list) -> float:
        return trainer.global_loss([], local=local_loss(reports, trainer.switching.placement))

    def statistics(self, trainer, work: StepWork, reports: list) -> dict:
        step, data, switches = work.extra["step"], work.extra["data"], work.extra["switches"]
        names = [s.name for s in trainer.switching.strategies.items]
        moved = torch.tensor([float(w.bytes_sent) for w in switches] or [0.0], dtype=torch.float64)
        dist.all_reduce(moved)  # every rank runs the same switches: the bytes all ranks sent in each
        hotspa = {"groups": [{"strategy": names[g.strategy], "sequences": g.sequences, "tokens": g.tokens,
                              "predicted_s": g.predicted_s} for g in step.groups],
                  "switches": [{"from": None if w.strategy_from is None else names[w.strategy_from],
                                "to": None if w.strategy_to is None else names[w.strategy_to],
                                "bytes_sent": w.bytes_sent, "bytes_total": int(moved[i]), "seconds": w.seconds}
                               for i, w in enumerate(switches)]}
        if data.mode != "select":
            return {"hotspa": hotspa}
        chosen = step.groups[0]
        return {"hydraulis": {"candidate": names[chosen.strategy], "predicted_s": chosen.predicted_s
                              + data.switch_s[chosen.strategy], "predicted_compute_s": chosen.predicted_s,
                              "predicted_switch_s": data.switch_s[chosen.strategy],
                              "switches": hotspa["switches"], "switch_bytes": int(moved.sum()) if switches else 0,
                              "switch_s": sum(w.seconds for w in switches)}}


def run_step(trainer, kind: StepKind, data, log) -> StepResult:
    """One step of ``trainer`` (a :class:`hetu_ext.train.trainer.Trainer`) of the given kind."""
    work = kind.prepare(trainer, data)
    if work is None:
        trainer.scheduler.step(increment=1)
        trainer.iteration += 1
        trainer.losses.append(float("nan"))
        return StepResult(loss=float("nan"), grad_norm=None, replan=None, samples=0, tokens=0)
    if trainer.monitor:
        trainer.monitor.before_step(trainer.iteration + 1)
        kind.observe(trainer, work)
    elif trainer.timer is not None:
        trainer.timer.factor = factor_at(parse_schedule(trainer.config.straggler.emulate_slowdown or ""),
                                         trainer.host.rank, trainer.iteration + 1)
    reports = kind.execute(trainer, work)
    updated, grad_norm = kind.optimizer_step(trainer, work)
    if updated:  # as Megatron-LM's train_step: a skipped update (--fp16 overflow) leaves the LR schedule
        increment = kind.scheduler_increment
        if increment is None:  # with --rampup-batch-size the step's global batch, as Megatron-LM's train_step
            increment = scheduler_unit(trainer.config.training, trainer.config.packing, trainer.plan) \
                if trainer.ramp is None else work.samples
        trainer.scheduler.step(increment=increment)
    else:
        trainer.skipped_iterations += 1
    trainer.iteration += 1
    loss = kind.loss(trainer, work, reports)
    trainer.losses.append(loss)
    replan = trainer.monitor.after_step(trainer.iteration, log) if trainer.monitor else None
    return StepResult(loss=loss, grad_norm=grad_norm, replan=replan, samples=work.samples, tokens=work.tokens,
                      statistics=kind.statistics(trainer, work, reports), skipped=not updated)
