"""The training loop of ``launch/pretrain_gpt.py`` on Megatron-core's own parts.

Megatron-core's GPTModel, its DistributedDataParallel, its optimizer and LR scheduler, and its pipeline schedule
do the work; this module wires them together the way Megatron-LM's ``training.py`` does. Where a rank sits and
what it holds comes from a runtime: Megatron's own ``parallel_state`` grid for uniform plans
(uniform_runtime.py) or the plan runtime for any plan (plan_runtime.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hetu_ext.checkpoint.parts import Checkpointable
from hetu_ext.config import RunConfig
from hetu_ext.megatron import checkpointing, host
from hetu_ext.megatron.activations import report_first_step
from hetu_ext.megatron.data import DataSpec, build_datasets, make_tokenizer
from hetu_ext.megatron.launch_plan import check_launch, save_format
from hetu_ext.megatron.checkpoint_target import CheckpointTarget
from hetu_ext.megatron.memory import memory_table
from hetu_ext.megatron.migrate import migrate
from hetu_ext.megatron.model import TrainingNumerics, transformer_layers
from hetu_ext.megatron.monitor import StragglerMonitor
from hetu_ext.megatron.packed_data import PackedSteps, StepData, open_documents
from hetu_ext.megatron.placement import Placement
from hetu_ext.megatron.state import check_norm_convention
from hetu_ext.megatron.switching import SwitchedSteps, Switching
from hetu_ext.megatron.tokenizers import tokenizer_files
from hetu_ext.megatron.uniform_runtime import build_megatron_placement
from hetu_ext.metrics import MetricsWriter, peak_tflops
from hetu_ext.model import inventory
from hetu_ext.plan import ModelSpec, Plan, format_plan
from hetu_ext.plan.core.batches import BatchRamp, batch_ramp, check_ramp, global_batch_size
from hetu_ext.runtime.straggler import CostFn, LayerTimer
from hetu_ext.runtime.watchdog import StepWatchdog
from hetu_ext.train.step import (
    MicrobatchSteps, PackedDocumentSteps, StepKind, SwitchedGroupSteps, forward_step, run_step)
from hetu_ext.train.eval import Evaluation, check_evaluation, eval_samples
from hetu_ext.train.records import open_metrics, report_migration, step_record, window_line

from .components import emulated_layer_cost, make_scheduler, plan_id, straggler_monitor
from .plugin import TrainerPlugin

logger = logging.getLogger(__name__)

PROCESS_START = time.time()
"""When this process started training code (Megatron-LM's ``_TRAIN_START_TIME``): --exit-duration-in-mins counts
from here."""


def _restart_clock_in_child() -> None:
    """A forked process is a new process: a fork server that imported this module long before (the test harness's
    preload) must not hand its children its own start time."""
    global PROCESS_START
    PROCESS_START = time.time()


os.register_at_fork(after_in_child=_restart_clock_in_child)


@dataclass
class Trainer:
    """The state of one rank's training: its placement under the plan, LR scheduler and data."""

    config: RunConfig
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
    metrics: MetricsWriter | None = None
    """The metrics file (and TensorBoard / W&B), open on the logging rank only (after a re-plan that moves the
    logging rank, the new one appends to the same file)."""
    flops_per_token: float = 0.0
    """Training FLOPs per token of the model (metrics' utilisation estimate)."""
    peak_tflops: float | None = None
    """The device's dense bf16 peak (None: unknown, e.g. a CPU): the denominator of ``mfu``."""
    plan_key: str = ""
    """:func:`plan_id` of the current plan, hashed when the plan is set (the step record carries it)."""
    timer: LayerTimer | None = None
    """The layers' timer: the monitor's, or one of its own for --hetu-emulate-cost without the monitor."""
    layer_cost: Callable[[int], CostFn] | None = None
    """--hetu-emulate-cost: TP degree -> one layer's emulated seconds for a microbatch's shape."""
    iteration: int = 0
    losses: list[float] = field(default_factory=list)
    skipped_iterations: int = 0
    """--fp16: this process's steps whose update was skipped (their gradients overflowed)."""
    switching: Switching | None = None
    """--hetu-hotspa: the home (``placement``) and the strategies' compute placements."""
    overruns: int = 0
    """Layer passes of the last step, over all used ranks, whose real time exceeded the emulated one."""
    plugin: TrainerPlugin = field(default_factory=TrainerPlugin)
    """What a plug-in changes (hetu_ext.train.plugin: its placements, step kind, checkpoint parts; LoRA's
    tenants); the default is the plain run."""
    steps: StepKind | None = None
    """What a step is (hetu_ext.train.step): set by a plug-in (LoRA's tenants); else derived from the run:
    switching (--hetu-hotspa, --hetu-strategies), packed documents, or plain microbatches."""
    checkpoint_formats: tuple = ()
    """Other frameworks' checkpoints ``--load`` reads (:class:`~hetu_ext.megatron.checkpointing.TrainerCheckpoints`:
    DeepSpeed ZeRO's), given where the command line is read (hetu_ext.cli.train.build_run)."""
    activations_reported: bool = False
    """The first step's activation memory was logged (measured beside the inventory's: activations.py)."""
    evaluation: Evaluation | None = None
    """--eval-iters: the validation (and test) split and when to evaluate on it (hetu_ext.train.eval)."""
    ramp: BatchRamp | None = None
    """--rampup-batch-size: each step's global batch; the data position is the samples consumed before a step."""

    @property
    def step_kind(self) -> StepKind:
        if self.steps is None:
            self.steps = SwitchedGroupSteps() if self.switching is not None else \
                PackedDocumentSteps() if self.documents is not None else MicrobatchSteps()
        return self.steps

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
        cfg = self.config
        train_iters = cfg.training.train_iters
        if cfg.training.eval_iters and self.evaluation is None:  # a plug-in's trainer that did not build it
            check_evaluation(cfg)
            raise ValueError(f"--eval-iters {cfg.training.eval_iters}: this trainer builds no evaluation")
        save_dir, save_interval = cfg.checkpoint.save, cfg.checkpoint.save_interval
        data = None
        window: list[dict] = []  # the step records since the last log line
        step_start = time.perf_counter()  # a step's time runs from the previous step's end (data and saves included)
        # --hetu-hang-timeout: the step-progress watchdog (None when 0)
        watchdog = StepWatchdog(cfg.parallel.hang_timeout, rank=self.host.rank) if cfg.parallel.hang_timeout else None
        while self.iteration < train_iters and not cfg.training.skip_train:
            placement = self.placement
            replan = None
            if not placement.active:
                if watchdog is not None:
                    watchdog.pause()  # idle in this plan: no steps to time
                replan = self._skip_idle(train_iters, log)
            else:
                if data is None:
                    data = self._open_data()
                # the first step logs this rank's activation memory (not while switching: the compute
                # placements' weights are not this model's parameters)
                measure = not self.activations_reported and self.switching is None and self.numerics is not None
                with report_first_step(self) if measure else contextlib.nullcontext():
                    result = run_step(self, self.step_kind, data, log)
                self.activations_reported = True
                replan = result.replan
                if watchdog is not None:
                    watchdog.beat(self.iteration)
                step_s, step_start = time.perf_counter() - step_start, time.perf_counter()
                window.append(step_record(self, result, step_s=step_s,
                                          consumed=self._consumed(data, result.samples)))
                if self.iteration % cfg.logging.log_interval == 0 or self.iteration == train_iters:
                    if self.host.rank == self.log_rank:
                        log(window_line(window))
                    window = []
                if self.evaluation is not None and self.evaluation.after_step(self, log, watchdog):
                    step_start = time.perf_counter()  # evaluating is no step (before the save: Megatron-LM's order)
                exiting = bool(cfg.training.exit_duration_in_mins) and self._time_is_up(log)
                if exiting:  # --exit-duration-in-mins: the run ends at this step, so its save (the interval's or
                    # the final one below) is the last one and completes before returning, as Megatron-LM's
                    cfg = self.config = dataclasses.replace(cfg, training=dataclasses.replace(
                        cfg.training, train_iters=self.iteration))
                if save_dir and save_interval and self.iteration % save_interval == 0:
                    self._save(save_dir)
                if exiting:
                    break
            if self.migrations and self.migrations[0][0] == self.iteration:
                replan = self.migrations.pop(0)[1]
            elif cfg.straggler.replan != "online":
                replan = None
            if replan is not None:
                self._migrate(replan, log)
                if isinstance(data, (PackedSteps, SwitchedSteps)):
                    data.close()
                data = None
                window, step_start = [], time.perf_counter()  # migrating is no step
        if watchdog is not None:
            watchdog.stop()  # the final save and barrier are no steps
        if save_dir and self.placement.active and (not save_interval or self.iteration % save_interval) \
                and not cfg.training.skip_train:
            self._save(save_dir)
        # after the final save, as Megatron-LM's pretrain; not after an early exit (Megatron-LM exits before it)
        if self.evaluation is not None and self.placement.active and (self.iteration >= train_iters
                                                                      or cfg.training.skip_train):
            self.evaluation.at_end(self, log)
        if isinstance(data, (PackedSteps, SwitchedSteps)):
            data.close()
        if self.plan.unused_ranks:
            dist.barrier()  # release the idle ranks
        if self.metrics is not None:
            self.metrics.close()
        return self.losses

    def _skip_idle(self, train_iters: int, log):
        """A rank the plan leaves unused skips ahead to the next migration or exchange of timings (it takes part in
        both; an idle rank's probe layer is timed there) or to the end; returns the monitor's proposed plan."""
        pending = [step for step, _ in self.migrations if step > self.iteration]
        if self.monitor:  # idle ranks take part in every exchange of timings
            pending.append((self.iteration // self.monitor.interval + 1) * self.monitor.interval)
        self.iteration = min(min(pending, default=train_iters), train_iters)
        if not self.monitor:
            return None
        if self.placement.probe_layer is not None and self.iteration % self.monitor.interval == 0:
            self.monitor.probe(self.placement.probe_layer, self.iteration)
        return self.monitor.after_step(self.iteration, log)

    def _time_is_up(self, log) -> bool:
        """--exit-duration-in-mins: this process has run longer than the limit on some used rank (a MAX over the
        used ranks, as Megatron-LM's all-reduce after every step; the plan has no idle rank, build_run checks)."""
        minutes = (time.time() - PROCESS_START) / 60.0
        done = torch.tensor([int(minutes > self.config.training.exit_duration_in_mins)], device=self.host.device)
        dist.all_reduce(done, op=dist.ReduceOp.MAX, group=self.placement.report_group)
        if done.item() and self.host.rank == self.log_rank:
            log(f"exiting program after {minutes:.2f} minutes (--exit-duration-in-mins "
                f"{self.config.training.exit_duration_in_mins}), at iteration {self.iteration}")
        return bool(done.item())

    def _consumed(self, data, samples_per_step: int) -> int:
        if isinstance(data, (PackedSteps, SwitchedSteps)):
            return data.consumed(self.iteration)
        if self.ramp is not None:
            return self.ramp.consumed(self.iteration)
        return self.iteration * samples_per_step

    def _open_data(self):
        """This pipeline's data from the current step on, as the step kind reads it."""
        return self.step_kind.open(self)

    def run_schedule(self, placement: Placement, step: StepData) -> list:
        """One schedule (Megatron's) over ``step``'s microbatches on ``placement``; its loss reports."""
        return placement.forward_backward(
            forward_step_func=forward_step, data_iterator=iter(step.microbatches),
            model=[placement.model], num_microbatches=len(step.microbatches), seq_length=self.spec.seq_length,
            micro_batch_size=self.config.training.micro_batch_size, forward_only=False, **placement.schedule_kwargs)

    def _migrate(self, plan: Plan, log) -> None:
        """Move to ``plan`` now (collective over every rank): new stage models, state resharded, same run."""
        report_rank = min(plan.used_ranks)
        old_scheduler = self.scheduler
        placement, report = migrate(self.placement, lambda: self.build_placement(plan), self.iteration,
                                    plugin_pieces=self.plugin.migration_pieces)
        self.plan, self.placement, self.plan_key = plan, placement, plan_id(plan)
        self.placement_changed()
        self.scheduler = make_scheduler(self.config.training, self.config.packing, placement, plan)
        # a rank idle in the old plan takes the schedule of one that was not: replaying the flags' schedule to the
        # iteration would count the steps --fp16 skipped (and, under --rampup-batch-size, the wrong samples)
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, old_scheduler.state_dict() if old_scheduler is not None else None)
        schedule = next((s for s in everyone if s is not None), None)
        if self.scheduler is not None and schedule is not None:
            self.scheduler.load_state_dict(schedule)
        self.follow_log_rank()
        if self.monitor:
            self.monitor.use_plan(plan)
        self.attach_timer()
        report_migration(self, report, log, reporting=self.host.rank == report_rank)

    def build_placement(self, plan: Plan) -> Placement:
        """This rank's placement under ``plan``, a migration's destination (collective; the plug-in's hook: it
        may add its own parts before the state moves)."""
        return self.plugin.build_placement(self.config, self.spec, plan, self.host, self.numerics)

    def placement_changed(self) -> None:
        """After a migration built the new placement and moved the state (collective): the plug-in re-attaches."""
        self.plugin.placement_changed(self)

    @property
    def parts(self) -> list[Checkpointable]:
        """What a checkpoint of this run holds, in restore order (hetu_ext/train/parts.py, or the plug-in's)."""
        return self.plugin.parts(self)

    def checkpoint_target(self) -> CheckpointTarget:
        """This rank's parts and position as a save or load takes them (hetu_ext.megatron.checkpoint_target)."""
        packed = self.config.packing.method != "off"
        consumed = None if packed else self.ramp.consumed(self.iteration) if self.ramp is not None else \
            self.iteration * global_batch_size(self.plan, self.config.training.micro_batch_size)
        return CheckpointTarget(parts=self.parts, config=self.config, plan=self.plan, host=self.host,
                                placement=self.placement, iteration=self.iteration, log_rank=self.log_rank,
                                consumed_samples=consumed, formats=self.checkpoint_formats,
                                hetu_only=self.plugin.hetu_only, label=self.plugin.checkpoint_label)

    def _save(self, directory: str) -> None:
        """Save (collective) and record a ``checkpoint_save`` event: the seconds training was blocked; the total
        when the save completed before returning (the last one, torch_dist), else null (persisting in the
        background, committed by the writer thread)."""
        start = time.perf_counter()
        background = checkpointing.save(self.checkpoint_target(), directory)
        blocking_s = time.perf_counter() - start
        if self.metrics is not None:
            self.metrics.event("checkpoint_save", iteration=self.iteration, directory=directory,
                               format="hetu" if self.plugin.hetu_only else save_format(self.config.checkpoint,
                                                                                       self.config.parallel),
                               blocking_s=blocking_s, total_s=None if background else blocking_s)

    def load(self, directory: str) -> bool:
        """Restore the latest checkpoint under ``directory`` (collective); records a ``checkpoint_load`` event."""
        start = time.perf_counter()
        check_norm_convention(self.config, directory)
        loaded = checkpointing.load(self.checkpoint_target(), directory)
        if loaded and self.metrics is not None:
            seconds = time.perf_counter() - start
            self.metrics.event("checkpoint_load", iteration=self.iteration, directory=directory,
                               blocking_s=seconds, total_s=seconds)
        return loaded

    def follow_log_rank(self) -> None:
        """Open the metrics writer on the plan's logging rank, close it elsewhere (collective-free)."""
        if self.host.rank == self.log_rank and self.metrics is None:
            self.metrics = open_metrics(self.config)
        elif self.host.rank != self.log_rank and self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        if self.monitor is not None:
            self.monitor.metrics = self.metrics

    def attach_timer(self, placement: Placement | None = None, plan: Plan | None = None) -> None:
        """Time (and emulate) a placement's transformer layers (default: the current one) at its stage's TP."""
        placement, plan = placement or self.placement, plan or self.plan
        if self.timer is None or not placement.active:
            return
        stage = plan.pipelines[placement.pipeline_index].stages[plan.stage_of(self.host.rank)[1]]
        cost = self.layer_cost(stage.tp) if self.layer_cost else None
        self.timer.attach(transformer_layers(placement.model), cost=cost)

    def build_strategy(self, k: int) -> Placement:
        """HotSPa: strategy ``k``'s compute placement (collective; no optimizer; the plug-in's hook), its layers
        timed."""
        plan = self.switching.strategies.items[k].plan
        placement = self.plugin.build_placement(self.config, self.spec, plan, self.host, self.numerics,
                                                with_optimizer=False)
        self.attach_timer(placement, plan)
        return placement

    def global_loss(self, reports: list[dict], local: torch.Tensor | None = None) -> float:
        """Mean per-token loss of the whole global batch: sums from every pipeline's last stage (``local``: this
        rank's (loss, tokens) sums, when several placements ran). Also sums, over the used ranks, the layer passes
        whose real time overran the emulated one (``self.overruns``)."""
        total = torch.zeros(3, dtype=torch.float64)
        if local is not None:
            total[:2] = local
        elif self.placement.is_last_stage and self.placement.tp_rank == 0:
            for report in reports:
                total[:2] += report["lm loss"].double().cpu()
        if self.timer is not None:
            total[2] = self.timer.take_overruns()
        dist.all_reduce(total, group=self.placement.report_group)
        self.overruns = int(total[2])
        return float(total[0] / total[1])


@dataclass
class _Launch:
    """What build_trainer decides before any process group exists."""

    config: RunConfig
    spec: ModelSpec
    plan: Plan
    runtime: str
    launch: object
    ramp: BatchRamp | None
    tokenizer: object
    documents: object | None


def _check_launch(config: RunConfig, plugin: TrainerPlugin) -> _Launch:
    """The plug-in's settings, the plan against the model, the save format, the tokenizer and any documents:
    every check that needs no process group (pure but for reading the data)."""
    config = plugin.configure(config)
    check_evaluation(config)
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    launch = check_launch(config, world_size)
    runtime = plugin.runtime or launch.runtime
    ramp = batch_ramp(config.training)
    check_ramp(launch.plan, ramp, config.training.micro_batch_size)
    if config.checkpoint.format == "auto":  # the format --save writes on this runtime, decided once
        config = dataclasses.replace(config, checkpoint=dataclasses.replace(
            config.checkpoint, format=save_format(config.checkpoint, config.parallel, runtime)))
    tokenizer = make_tokenizer(config.data.tokenizer_type, config.data.vocab_size, tokenizer_files(config.data))
    documents = plugin.documents(config, tokenizer)
    if documents is None and config.packing.method != "off":  # packed documents: read (and checked) before groups
        documents = open_documents(config.data, config.packing, tokenizer, seed=config.training.seed)
    return _Launch(config=config, spec=launch.spec, plan=launch.plan, runtime=runtime, launch=launch, ramp=ramp,
                   tokenizer=tokenizer, documents=documents)


def _datasets(config: RunConfig, spec: ModelSpec, plan: Plan, ramp: BatchRamp | None, tokenizer):
    """The training split and the evaluation (every rank, idle ones too: Megatron's builder makes index caches on
    rank 0, barriers)."""
    training, data = config.training, config.data
    gbs = global_batch_size(plan, training.micro_batch_size)
    data_spec = DataSpec(mock=data.mock_data, data_path=tuple(data.data_path or ()), split=data.split,
                         seq_length=spec.seq_length, seed=training.seed, cache_path=data.data_cache_path)
    train_samples = training.train_iters * gbs if ramp is None else ramp.consumed(training.train_iters)
    dataset, valid, test = build_datasets(data_spec, tokenizer, (train_samples, *eval_samples(training, gbs)))
    return dataset, Evaluation.of(training, data.split, valid, test)


def _log_placement(config: RunConfig, plan: Plan, h: host.Host, placement: Placement, numerics: TrainingNumerics,
                   runtime: str) -> None:
    where = plan.stage_of(h.rank)
    table = memory_table(placement.model, config.training.optimizer, numerics.half,
                         f"pipeline {where[0]} stage {where[1]}" if where else "unused", optimizer=placement.optimizer)
    if table:
        logger.info("%s", table)
    if h.rank == 0:
        logger.info("plan (%s runtime, %s on %s, Megatron-core CPU patches: %s):\n%s", runtime, h.backend,
                    h.device.type, "on" if h.cpu_patched else "off", format_plan(plan))


def build_trainer(config: RunConfig, *, checkpoint_formats: tuple = (), plugin: TrainerPlugin | None = None
                  ) -> Trainer:
    """Check the plan, start the process group, then place this rank and build its scheduler and dataset.
    ``checkpoint_formats``: other frameworks' checkpoints ``--load`` reads (Trainer.checkpoint_formats).
    ``plugin``: what a plug-in changes (hetu_ext.train.plugin; LoRA's tenants: hetu_ext.lora.plugin), at the
    hooks named there; None: the plain run."""
    plugin = plugin or TrainerPlugin()
    if config.lora.tenants and type(plugin) is TrainerPlugin:  # never train a plug-in's run as a plain one
        raise ValueError("--hetu-lora-tenants: LoRA tenants are built by hetu_ext.lora.train.build_lora_trainer "
                         "(hetu_ext.cli.train.build_run chooses it); build_trainer trains the plain model only")
    start = _check_launch(config, plugin)
    config, spec, plan, training = start.config, start.spec, start.plan, start.config.training
    force = {"auto": None, "on": True, "off": False}[config.parallel.cpu_patches]
    h = host.init_distributed(force_cpu=force, timeout_minutes=config.parallel.distributed_timeout_minutes,
                              backend=config.parallel.distributed_backend)
    numerics = TrainingNumerics.of(config.model, training, variable_seq_lengths=start.documents is not None,
                                   sequence_parallel=config.parallel.sequence_parallel and plugin.sequence_parallel)
    if start.runtime == "megatron":
        placement = build_megatron_placement(training, spec, plan, h, numerics,
                                             use_distributed_optimizer=config.parallel.use_distributed_optimizer)
    else:
        placement = plugin.build_placement(config, spec, plan, h, numerics)
    scheduler = make_scheduler(training, config.packing, placement, plan)
    dataset, evaluation = _datasets(config, spec, plan, start.ramp, start.tokenizer) if start.documents is None \
        else (None, None)
    _log_placement(config, plan, h, placement, numerics, start.runtime)
    flops = inventory.training_flops_per_token(spec, seq_length=spec.seq_length, causal=True)  # MFU's convention
    monitor = straggler_monitor(config.straggler, plugin.monitor_micro_batch or training.micro_batch_size,
                                config.logging.log_interval, spec, plan, h, placement,
                                optimizer_sharded=start.runtime == "plan" and config.parallel.use_distributed_optimizer)
    layer_cost = emulated_layer_cost(config.straggler)
    trainer = Trainer(config=config, spec=spec, plan=plan, host=h, placement=placement, scheduler=scheduler,
                      dataset=dataset, monitor=monitor, evaluation=evaluation, ramp=start.ramp,
                      numerics=numerics, migrations=start.launch.migrations, documents=start.documents,
                      flops_per_token=flops, plugin=plugin,
                      peak_tflops=peak_tflops(torch.cuda.get_device_name() if h.device.type == "cuda" else None),
                      plan_key=plan_id(plan), layer_cost=layer_cost, checkpoint_formats=tuple(checkpoint_formats),
                      timer=monitor.timer if monitor else (LayerTimer() if layer_cost else None))
    if start.launch.strategies is not None:
        trainer.switching = Switching(start.launch.strategies, home=placement, build=trainer.build_strategy,
                                      ranks_per_node=config.straggler.gpus_per_node)
    plugin.attach(trainer)
    trainer.attach_timer()
    trainer.follow_log_rank()
    if config.checkpoint.load and os.path.isdir(config.checkpoint.load):  # else: --load is --save, not made yet
        trainer.load(config.checkpoint.load)
    if config.checkpoint.save:  # the run's identity; another run's checkpoints there are refused before training
        checkpointing.prepare_save(trainer.checkpoint_target(), config.checkpoint.save)
    return trainer
