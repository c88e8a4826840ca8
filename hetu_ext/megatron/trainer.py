"""The training loop of ``launch/pretrain_gpt.py`` on Megatron-core's own parts.

Megatron-core's GPTModel, its DistributedDataParallel, its optimizer and LR scheduler, and its pipeline schedule
do the work; this module wires them together the way Megatron-LM's ``training.py`` does. Where a rank sits and
what it holds comes from a runtime: Megatron's own ``parallel_state`` grid for uniform plans
(uniform_runtime.py) or the plan runtime for any plan (plan_runtime.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist

from hetu_ext.data.assign import global_batch_size
from hetu_ext.plan import ModelSpec, Plan, PlanError, format_plan, load_plan, uniform_plan, uniform_shape
from hetu_ext.plan.straggler_policy import StragglerPolicy
from hetu_ext.runtime.straggler import parse_schedule

from . import checkpointing, host
from .data import DataSpec, build_train_dataset, make_tokenizer, microbatch_iterator
from .memory import memory_table
from .migrate import migrate, parse_migrations
from .model import TrainingNumerics
from .monitor import StragglerMonitor
from .packed_data import PackedSteps, build_packed_steps, open_documents
from .placement import Placement
from .plan_runtime import build_plan_placement, check_runnable
from .uniform_runtime import build_megatron_placement

logger = logging.getLogger(__name__)


def model_spec_from_args(args: argparse.Namespace, vocab_size: int) -> ModelSpec:
    return ModelSpec(num_layers=args.num_layers, hidden_size=args.hidden_size,
                     num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
                     vocab_size=vocab_size, seq_length=args.seq_length,
                     max_position_embeddings=args.max_position_embeddings,
                     untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
                     make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)


def plan_from_args(args: argparse.Namespace, spec: ModelSpec, world_size: int) -> Plan:
    """The plan to run: ``--hetu-plan`` if given, else Megatron's uniform grid of the TP/PP/batch flags."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    packed = args.hetu_packing != "off"  # microbatches are chosen per step by the packer
    if args.hetu_plan:
        plan = load_plan(args.hetu_plan)
    else:
        if world_size % (tp * pp):
            raise PlanError(f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
                            f"--pipeline-model-parallel-size {pp}; launch a multiple of {tp * pp} ranks")
        dp = world_size // (tp * pp)
        gbs = args.micro_batch_size * dp if packed else args.global_batch_size or args.micro_batch_size * dp
        if gbs % (args.micro_batch_size * dp):
            raise PlanError(f"--global-batch-size {gbs} must be a multiple of --micro-batch-size "
                            f"{args.micro_batch_size} x data-parallel size {dp} = {args.micro_batch_size * dp}")
        plan = uniform_plan(world_size=world_size, tp=tp, pp=pp, num_layers=spec.num_layers,
                            num_microbatches=gbs // (args.micro_batch_size * dp))
    plan.validate(spec, world_size)
    if not packed and args.global_batch_size and \
            global_batch_size(plan, args.micro_batch_size) != args.global_batch_size:
        raise PlanError(f"the plan runs {plan.num_microbatches} microbatches of {args.micro_batch_size} = "
                        f"{global_batch_size(plan, args.micro_batch_size)} samples per step but --global-batch-size "
                        f"is {args.global_batch_size}; make them agree")
    return plan


@dataclass
class Trainer:
    """The state of one rank's training: its placement under the plan, LR scheduler and data."""

    args: argparse.Namespace
    spec: ModelSpec
    plan: Plan
    host: host.Host
    placement: Placement
    scheduler: object
    dataset: object
    monitor: StragglerMonitor | None = None
    numerics: TrainingNumerics | None = None
    migrations: list[tuple[int, Plan]] = field(default_factory=list)
    """Pending (after step, plan) migrations (--hetu-migrate)."""
    documents: object | None = None
    """--hetu-packing: the corpus' documents (``dataset`` is then None)."""
    iteration: int = 0
    losses: list[float] = field(default_factory=list)

    @property
    def model(self):
        return self.placement.model

    @property
    def optimizer(self):
        return self.placement.optimizer

    @property
    def log_rank(self) -> int:
        """The rank that prints log lines: the plan's lowest used rank."""
        return min(self.plan.used_ranks)

    def train(self, log=print) -> list[float]:
        """Run until ``--train-iters``; return this run's per-iteration global losses (same on every used rank).

        Ranks the current plan leaves unused skip ahead to the next migration (they take part in it) or to the
        final barrier."""
        args = self.args
        data = None
        window_start, window_iters, window_tokens = time.perf_counter(), 0, 0
        while self.iteration < args.train_iters:
            placement = self.placement
            replan = None
            if not placement.active:
                pending = [step for step, _ in self.migrations if step > self.iteration]
                if self.monitor:  # idle ranks take part in every exchange of timings
                    pending.append((self.iteration // self.monitor.interval + 1) * self.monitor.interval)
                self.iteration = min(min(pending, default=args.train_iters), args.train_iters)
                if self.monitor:
                    if placement.probe_layer is not None and self.iteration % self.monitor.interval == 0:
                        self.monitor.probe(placement.probe_layer, self.iteration)
                    replan = self.monitor.after_step(self.iteration, log)
            else:
                if data is None:
                    data = self._open_data()
                loss, grad_norm, replan, samples, tokens = self._step(data, log)
                window_iters += 1
                window_tokens += tokens
                if self.iteration % args.log_interval == 0 or self.iteration == args.train_iters:
                    elapsed = (time.perf_counter() - window_start) / window_iters
                    if self.host.rank == self.log_rank:
                        log(format_log_line(iteration=self.iteration, train_iters=args.train_iters,
                                            consumed=self._consumed(data, samples), step_ms=elapsed * 1e3,
                                            lr=self.optimizer.param_groups[0]["lr"], gbs=samples, loss=loss,
                                            grad_norm=grad_norm,
                                            tokens_per_s=window_tokens / (elapsed * window_iters)))
                    window_start, window_iters, window_tokens = time.perf_counter(), 0, 0
                if args.save and args.save_interval and self.iteration % args.save_interval == 0:
                    checkpointing.save(self, args.save)
            if self.migrations and self.migrations[0][0] == self.iteration:
                replan = self.migrations.pop(0)[1]
            elif args.hetu_straggler_replan != "online":
                replan = None
            if replan is not None:
                self._migrate(replan, log)
                if isinstance(data, PackedSteps):
                    data.close()
                data = None
                window_start, window_iters, window_tokens = time.perf_counter(), 0, 0  # migrating is no step
        if args.save and self.placement.active and (not args.save_interval or self.iteration % args.save_interval):
            checkpointing.save(self, args.save)
        if isinstance(data, PackedSteps):
            data.close()
        if self.plan.unused_ranks:
            dist.barrier()  # release the idle ranks
        return self.losses

    def _consumed(self, data, samples_per_step: int) -> int:
        return data.consumed(self.iteration) if isinstance(data, PackedSteps) else self.iteration * samples_per_step

    def _open_data(self):
        """This pipeline's data from the current step on: packed steps, or Megatron samples in microbatches."""
        args, placement = self.args, self.placement
        if self.documents is not None:
            return build_packed_steps(args, self.spec, self.plan, placement.pipeline_index, self.documents,
                                      self.host.device, slowdowns=self.monitor.assumed if self.monitor else None)
        return microbatch_iterator(self.dataset, self.plan, placement.pipeline_index, args.micro_batch_size,
                                   start_iteration=self.iteration, num_iterations=args.train_iters - self.iteration,
                                   device=self.host.device)

    def _step(self, data, log) -> tuple[float, float | None, Plan | None, int, int]:
        """One training step of this rank's pipeline: the global loss, the grad norm, the plan the straggler
        monitor proposes (or None), and the global batch's samples and tokens."""
        args, placement = self.args, self.placement
        if isinstance(data, PackedSteps):
            step = data.step(self.iteration)
            microbatches, num_microbatches = iter(step.microbatches), len(step.microbatches)
            samples, tokens = step.sequences, step.tokens
        else:
            num_microbatches = self.plan.pipelines[placement.pipeline_index].num_microbatches
            microbatches, samples = data, global_batch_size(self.plan, args.micro_batch_size)
            tokens = samples * args.seq_length
        if self.monitor:
            self.monitor.before_step(self.iteration + 1)
            if isinstance(data, PackedSteps):
                self.monitor.use_microbatches(step.shapes)
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        reports = placement.forward_backward(
            forward_step_func=_forward_step, data_iterator=microbatches, model=[self.model],
            num_microbatches=num_microbatches, seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size, forward_only=False, **placement.schedule_kwargs)
        _, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=_scheduler_unit(args, self.plan))
        self.iteration += 1
        loss = self._global_loss(reports)
        self.losses.append(loss)
        replan = self.monitor.after_step(self.iteration, log) if self.monitor else None
        return loss, grad_norm, replan, samples, tokens

    def _migrate(self, plan: Plan, log) -> None:
        """Move to ``plan`` now (collective over every rank): new stage models, state resharded, same run."""
        report_rank = min(plan.used_ranks)
        old_scheduler = self.scheduler
        placement, report = migrate(
            self.placement, lambda: build_plan_placement(self.args, self.spec, plan, self.host, self.numerics),
            self.iteration)
        self.plan, self.placement = plan, placement
        self.scheduler = _make_scheduler(self.args, placement, plan)
        if self.scheduler is not None and old_scheduler is not None:
            self.scheduler.load_state_dict(old_scheduler.state_dict())
        elif self.scheduler is not None:  # this rank was idle: replay the schedule to the current step
            self.scheduler.step(increment=self.iteration * _scheduler_unit(self.args, plan))
        if self.monitor:
            self.monitor.use_plan(plan)
            if placement.active:
                self.monitor.attach(_transformer_layers(placement.model))
        sent = torch.tensor([float(report.bytes_sent), float(report.bytes_kept)], dtype=torch.float64)
        dist.all_reduce(sent)
        if self.host.rank == report_rank:
            log(f"migrated to a new plan after step {self.iteration} in {report.seconds:.2f} s: "
                f"{sent[0] / 2**20:.2f} MiB sent between ranks, {sent[1] / 2**20:.2f} MiB kept in place\n"
                f"{format_plan(plan)}")

    def _global_loss(self, reports: list[dict]) -> float:
        """Mean per-token loss of the whole global batch: sums from every pipeline's last stage."""
        total = torch.zeros(2, dtype=torch.float64)
        if self.placement.is_last_stage and self.placement.tp_rank == 0:
            for report in reports:
                total += report["lm loss"].double().cpu()
        dist.all_reduce(total, group=self.placement.report_group)
        return float(total[0] / total[1])


def _forward_step(data_iterator, model):
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


def format_log_line(*, iteration: int, train_iters: int, consumed: int, step_ms: float, lr: float, gbs: int,
                    loss: float, grad_norm: float | None, tokens_per_s: float) -> str:
    """A log line in Megatron-LM's format."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    norm = f" grad norm: {grad_norm:.3f} |" if grad_norm is not None else ""
    return (f" [{stamp}] iteration {iteration:8d}/{train_iters:8d} | consumed samples: {consumed:12d} | "
            f"elapsed time per iteration (ms): {step_ms:.1f} | learning rate: {lr:.6E} | global batch size: "
            f"{gbs:5d} | lm loss: {loss:.6E} |{norm} tokens/s: {tokens_per_s:.0f} |")


def select_runtime(args: argparse.Namespace, plan: Plan) -> str:
    """``megatron`` (its parallel_state grid) for uniform plans unless asked otherwise; ``plan`` for the rest."""
    if args.hetu_runtime == "megatron" and uniform_shape(plan) is None:
        raise PlanError("--hetu-runtime megatron can only run a uniform TP x PP x DP plan (same shape, TP degree "
                        "and microbatches in every pipeline, Megatron's rank order, no unused ranks); use "
                        "--hetu-runtime plan or auto")
    online = args.hetu_migrate or args.hetu_straggler_replan == "online"
    if online and args.hetu_runtime == "megatron":
        raise PlanError("changing plans online (--hetu-migrate, --hetu-straggler-replan online) needs the plan "
                        "runtime (Megatron's parallel_state cannot change layout in a running job); drop "
                        "--hetu-runtime megatron")
    if args.hetu_runtime == "plan" or uniform_shape(plan) is None or online:
        checkpointing.check_plan_runtime(args)
        if args.use_distributed_optimizer:
            raise PlanError("--use-distributed-optimizer (ZeRO-1) is not yet supported on the plan runtime; drop "
                            "it or run a uniform plan")
        return "plan"
    return "megatron"


def _make_scheduler(args, placement: Placement, plan: Plan):
    """Megatron's LR/weight-decay scheduler, stepped in samples as Megatron-LM does (None on idle ranks)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if not placement.active:
        return None
    gbs = _scheduler_unit(args, plan)
    decay_iters = args.lr_decay_iters or args.train_iters
    return OptimizerParamScheduler(
        placement.optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * gbs, lr_decay_steps=decay_iters * gbs,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=decay_iters * gbs, wd_incr_style="constant")


def _scheduler_unit(args, plan: Plan) -> int:
    """What one step advances the LR schedule by: its samples, as Megatron-LM counts; with --hetu-packing a
    global batch's sequence count varies (token budgets), so the schedule counts steps."""
    return 1 if args.hetu_packing != "off" else global_batch_size(plan, args.micro_batch_size)


def _transformer_layers(model) -> list:
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return [m for m in model.modules() if isinstance(m, TransformerLayer)]


def _straggler_monitor(args, spec: ModelSpec, plan: Plan, h: host.Host, placement: Placement):
    """The straggler monitor (on every rank, idle ones too), or None when --hetu-straggler-interval is 0."""
    if not args.hetu_straggler_interval:
        return None
    monitor = StragglerMonitor(
        rank=h.rank, plan=plan, spec=spec, micro_batch=args.micro_batch_size,
        interval=args.hetu_straggler_interval,
        policy=StragglerPolicy(threshold=args.hetu_straggler_threshold,
                               min_change=args.hetu_straggler_min_change, window=args.hetu_straggler_window),
        events=parse_schedule(args.hetu_emulate_slowdown or ""),
        gpus_per_node=args.hetu_gpus_per_node or h.world_size, replan_output=args.hetu_replan_output)
    if args.hetu_emulate_layer_ms:
        monitor.timer.nominal_s = args.hetu_emulate_layer_ms / 1e3
    if placement.active:
        monitor.attach(_transformer_layers(placement.model))
    return monitor


@dataclass(frozen=True)
class LaunchCheck:
    """What a launch is, decided from the flags alone (no process group): the launcher checks it before it
    starts any rank, and every rank builds on it."""

    tokenizer: object
    spec: ModelSpec
    plan: Plan
    migrations: list[tuple[int, Plan]]
    runtime: str
    """``megatron`` or ``plan`` (select_runtime)."""


def check_launch(args: argparse.Namespace, world_size: int) -> LaunchCheck:
    """The model, the plan (validated against the model and ``world_size``), pending migrations and the runtime;
    PlanError / ValueError naming the rule, the values and the fix for anything that cannot run."""
    tokenizer = make_tokenizer(args.tokenizer_type, args.vocab_size)
    spec = model_spec_from_args(args, tokenizer.vocab_size)
    plan = plan_from_args(args, spec, world_size)
    migrations = []
    for step, path in parse_migrations(args.hetu_migrate or ""):
        target = load_plan(path).validate(spec, world_size)
        if target.num_microbatches != plan.num_microbatches and args.hetu_packing == "off":
            raise PlanError(f"--hetu-migrate plan {path!r} runs {target.num_microbatches} microbatches per step but "
                            f"the run has {plan.num_microbatches}; keep the global batch the same")
        check_runnable(target)
        migrations.append((step, target))
    runtime = select_runtime(args, plan)
    if runtime == "plan":
        check_runnable(plan)
    return LaunchCheck(tokenizer=tokenizer, spec=spec, plan=plan, migrations=migrations, runtime=runtime)


def build_trainer(args: argparse.Namespace) -> Trainer:
    """Check the plan, start the process group, then place this rank and build its scheduler and dataset."""
    # the plan is checked against the model before any process group exists
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    launch = check_launch(args, world_size)
    tokenizer, spec, plan, migrations, runtime = (launch.tokenizer, launch.spec, launch.plan, launch.migrations,
                                                  launch.runtime)
    # packed documents are read (and checked) before any process group exists
    documents = open_documents(args, tokenizer) if args.hetu_packing != "off" else None
    force = {"auto": None, "on": True, "off": False}[args.hetu_cpu_patches]
    h = host.init_distributed(force_cpu=force, timeout_minutes=args.distributed_timeout_minutes,
                              backend=args.distributed_backend)
    numerics = TrainingNumerics(bf16=args.bf16, hidden_dropout=args.hidden_dropout,
                                attention_dropout=args.attention_dropout, init_method_std=args.init_method_std,
                                variable_seq_lengths=args.hetu_packing != "off")
    build = build_megatron_placement if runtime == "megatron" else build_plan_placement
    placement = build(args, spec, plan, h, numerics)

    scheduler = _make_scheduler(args, placement, plan)
    gbs = global_batch_size(plan, args.micro_batch_size)
    data_spec = DataSpec(mock=args.mock_data, data_path=tuple(args.data_path or ()), split=args.split,
                         seq_length=args.seq_length, seed=args.seed, cache_path=args.data_cache_path)
    dataset = None
    if documents is None:  # every rank, idle ones too: Megatron's builder makes index caches on rank 0, barriers
        dataset = build_train_dataset(data_spec, tokenizer, args.train_iters * gbs)
    where = plan.stage_of(h.rank)
    table = memory_table(placement.model, args.optimizer, args.bf16,
                         f"pipeline {where[0]} stage {where[1]}" if where else "unused")
    if table:
        logger.info("%s", table)
    if h.rank == 0:
        logger.info("plan (%s runtime, %s on %s, Megatron-core CPU patches: %s):\n%s", runtime, h.backend,
                    h.device.type, "on" if h.cpu_patched else "off", format_plan(plan))
    trainer = Trainer(args=args, spec=spec, plan=plan, host=h, placement=placement, scheduler=scheduler,
                      dataset=dataset, monitor=_straggler_monitor(args, spec, plan, h, placement),
                      numerics=numerics, migrations=migrations, documents=documents)
    if args.load:
        checkpointing.load(trainer, args.load)
    return trainer
