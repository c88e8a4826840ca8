"""Train Megatron-core's GPTModel (TP 1, PP 1) with DeepSpeed's engine and ZeRO stage 0/1/2/3, and save with
``engine.save_checkpoint``: the same model, initial weights, samples, loss normalisation, Adam, clipping and LR
schedule as hetu_ext's Megatron path with the same flags, so its checkpoints can be checked against that path.

What matches and why:

* Model: :func:`hetu_ext.megatron.model.build_gpt_stage` with weights from :func:`init_weights` (seed, key, layer);
  with ``--bf16`` wrapped in Megatron's Float16Module as hetu_ext's path does, and DeepSpeed's ``bf16`` mode
  (bf16 weights, fp32 partitions of the master weights and moments).
* Data: Megatron-core's GPTDataset, sample ids of step g from the uniform plan of the DP ranks (rank = pipeline).
* Loss: each microbatch's per-token mean; DeepSpeed divides by the accumulation steps and averages gradients over
  the DP ranks, which equals Megatron's token sum over the global batch's token count (every sample has
  ``seq_length`` loss tokens here), up to the order of floating-point sums.
* Optimizer: torch's AdamW (the class Megatron-core uses without Apex/TE) as a client optimizer with Megatron's
  parameter groups (no weight decay for biases and 1-D tensors, ``wd_mult`` 0); Megatron's
  OptimizerParamScheduler sets LR and weight decay per step; DeepSpeed clips by the global norm
  (``gradient_clipping``): grads / ((norm + 1e-6) / clip) where Megatron multiplies by clip / (norm + 1e-6).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hetu_ext.config import RunConfig
from hetu_ext.metrics import format_log_line

from . import engine_state
from .packs import even_packs
from .config import (  # noqa: F401 - the flags and the config, re-exported where callers found them
    ZERO_STAGES,
    ZeroConfig,
    add_deepspeed_args,
    check_supported,
    deepspeed_config,
)

logger = logging.getLogger(__name__)

CLIENT_STATE_KEY = "hetu_ext"
"""Key of ``client_state`` in the saved model states: iteration, losses and the data settings."""


def param_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Megatron-core's default groups: weight decay except on biases and 1-D tensors (``wd_mult`` 0)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (no_decay if name.endswith(".bias") or p.dim() == 1 else decay).append(p)
    return [{"params": decay, "wd_mult": 1.0, "lr_mult": 1.0},
            {"params": no_decay, "wd_mult": 0.0, "lr_mult": 1.0}]


@dataclass
class DeepSpeedGPT:
    """A DeepSpeed engine around GPTModel, with Megatron's LR schedule and dataset."""

    config: RunConfig
    engine: Any
    scheduler: Any
    dataset: Any
    plan: Any
    device: torch.device
    iteration: int = 0
    losses: list[float] = field(default_factory=list)
    weighting: Any = None
    """A :class:`~hetu_ext.deepspeed.weighting.MicrobatchWeighting` when per-rank counts differ (ZeRO-1)."""
    packed: Any = None
    """--hetu-packing: :class:`~hetu_ext.megatron.packed_data.PackedSteps` of this rank (``dataset`` is None)."""
    repack: Callable[[dict[int, float]], Any] | None = None
    """--hetu-packing: the packed steps for given slowdowns (the straggler monitor's, on a change)."""
    schedule_unit: int = 1
    """What one step advances the LR schedule by: the global batch's samples (1 with --hetu-packing)."""
    _tokens: int = 0
    rank_tokens: list[int] = field(default_factory=list)
    """This rank's loss tokens in each step of this run (its share of the global batch's)."""
    rank_microbatches: list[int] = field(default_factory=list)
    """This rank's microbatches (forward and backward passes) in each step of this run."""

    def train(self, log: Callable[[str], None] = logger.info,
              after_step: Callable[[int], None] | None = None, stop_at: int | None = None) -> list[float]:
        """Train to ``--train-iters`` (or to iteration ``stop_at``, if sooner: ``--exit-interval``); returns the
        global per-step losses (the same on every rank). Rank 0 gives ``log`` a Megatron-LM log line every
        ``--log-interval`` steps and at the last (the Megatron path's format; step time and tokens/s averaged
        over the interval). ``after_step(iteration)`` runs after each step on every rank (periodic saves)."""
        training, rank = self.config.training, dist.get_rank()
        gbs = self.engine.train_batch_size()
        watchdog = None
        if self.config.parallel.hang_timeout:  # --hetu-hang-timeout: a rank that completes no step exits (code 3)
            from hetu_ext.runtime.watchdog import StepWatchdog

            watchdog = StepWatchdog(self.config.parallel.hang_timeout, rank=rank)
        try:
            end = training.train_iters if stop_at is None else min(stop_at, training.train_iters)
            self._train_steps(end, rank, gbs, log, after_step, watchdog)
        finally:
            if watchdog is not None:
                watchdog.stop()
        return self.losses

    def _train_steps(self, end: int, rank: int, gbs: int, log: Callable[[str], None],
                     after_step: Callable[[int], None] | None, watchdog) -> None:
        """The steps of :meth:`train` up to iteration ``end`` (``watchdog``: --hetu-hang-timeout's, beaten after
        each step, or None)."""
        window_start, window_iters = time.perf_counter(), 0
        while self.iteration < end:
            total = self._step(rank, log)
            if watchdog is not None:
                watchdog.beat(self.iteration + 1)
            self.scheduler.step(increment=self.schedule_unit)
            self.iteration += 1
            self.losses.append(float(total[0] / total[1]))
            window_iters += 1
            if self.iteration % (self.config.logging.log_interval or 1) == 0 or self.iteration == end:
                step_s = (time.perf_counter() - window_start) / window_iters
                if rank == 0:
                    log(format_log_line(self._record(gbs, step_s)))
                window_start, window_iters = time.perf_counter(), 0
            if after_step is not None:
                after_step(self.iteration)

    def _batches(self, ranges: list[range]) -> list[dict[str, torch.Tensor]]:
        """Microbatches of these sample ids (global batch g: samples [gB, (g + 1)B))."""
        out = []
        for ids in ranges:
            samples = [self.dataset[i] for i in ids]
            out.append({key: torch.stack([s[key] for s in samples]).to(self.device)
                        for key in ("tokens", "labels", "loss_mask", "position_ids")})
        return out

    def _my_batches(self, rank: int) -> list[dict[str, Any]]:
        """This rank's microbatches of the next step: packs, or samples of the uniform plan, the weighted counts
        of microbatches (ZeRO-0/1) or the weighted samples over the same microbatch count (ZeRO-2/3)."""
        from hetu_ext.plan.core.batches import microbatch_samples

        from .weighting import budget_microbatches, rank_plan

        weighting, mbs = self.weighting, self.config.training.micro_batch_size
        if weighting is not None:
            weighting.before_step(self.iteration + 1)
        if self.packed is not None:
            batches = self.packed.step(self.iteration).microbatches
            return batches if self.engine.zero_optimization_stage() < 2 else even_packs(batches)
        if weighting is not None and weighting.per_rank:
            return self._batches(budget_microbatches(weighting.counts, rank, self.iteration, weighting.per_rank))
        plan = self.plan if weighting is None else \
            rank_plan(weighting.counts, self.plan.pipelines[0].stages[0].layer_stop)
        return self._batches(microbatch_samples(plan, rank, self.iteration, mbs))

    def _step(self, rank: int, log: Callable[[str], None]) -> torch.Tensor:
        """One global batch; returns (loss sum, loss tokens) over every rank (float64)."""
        weighting = self.weighting
        unmanaged = weighting is not None or self.packed is not None  # this rank's backwards, then one step()
        batches = self._my_batches(rank)
        if unmanaged:  # the global batch's loss tokens: each rank's loss is a share of their mean
            tokens = torch.stack([b["loss_mask"].sum() for b in batches]).sum().double().reshape(1)
            dist.all_reduce(tokens)
            scale = dist.get_world_size() / float(tokens)  # DeepSpeed averages gradients over the ranks
        total = torch.zeros(2, dtype=torch.float64)
        for batch in batches:
            per_token = self.engine(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                                    packed_seq_params=batch.get("packed_seq_params"))
            mask = batch["loss_mask"].view(-1).float()
            loss_sum = torch.sum(per_token.view(-1).float() * mask)
            if unmanaged:
                self.engine.backward(loss_sum * scale, scale_wrt_gas=False)
            else:  # DeepSpeed's accumulation: it divides by the steps and updates at the boundary
                self.engine.backward(loss_sum / mask.sum())
                self.engine.step()
            total += torch.stack([loss_sum.detach(), mask.sum()]).double()
        if unmanaged:
            self.engine.step()  # the caller-owned accumulation boundary: reduce once, update
        dist.all_reduce(total)
        self._tokens = int(total[1])
        self.rank_tokens.append(int(sum(int(b["loss_mask"].sum()) for b in batches)))
        self.rank_microbatches.append(len(batches))
        if weighting is not None:
            work = None if self.packed is None else float(sum(b["loss_mask"].numel() for b in batches))
            if weighting.after_step(self.iteration + 1, log, work=work) and self.repack is not None:
                self.packed.close()  # the packer's shares follow the measured slowdowns from the next step
                self.packed = self.repack(weighting.assumed)
        return total

    def _record(self, gbs: int, step_s: float) -> dict[str, Any]:
        """The last step as a metrics step record (the fields format_log_line reads)."""
        norm = self.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else None
        tokens = self._tokens or gbs * self.config.model.seq_length
        return {"iteration": self.iteration, "train_iters": self.config.training.train_iters, "loss": self.losses[-1],
                "lr": self.engine.optimizer.param_groups[0]["lr"], "grad_norm": norm, "samples": gbs,
                "tokens": tokens, "consumed_samples": self.iteration * gbs, "step_ms": step_s * 1e3,
                "tokens_per_s": tokens / step_s}

    def data_settings(self) -> dict[str, Any]:
        """What fixes the samples of step g (the data position is the iteration; the Megatron path's keys)."""
        return {"global_batch_size": self.engine.train_batch_size(), "seed": self.config.training.seed,
                "seq_length": self.config.model.seq_length, "split": self.config.data.split,
                "mock_data": bool(self.config.data.mock_data), "packing": self.config.packing.method,
                "global_batch_tokens": self.config.packing.global_batch_tokens}

    def save(self, directory: str) -> str:
        """``engine.save_checkpoint`` (collective) with hetu_ext's client state (iteration, losses, LR schedule,
        data settings, every rank's RNG states); returns the tag.

        ``latest`` names the tag only once every rank has written its files: DeepSpeed's rank 0 writes it before
        the closing barrier, so a rank lost in the middle of a save left ``latest`` naming an incomplete tag, and
        an elastic restart then failed to load it. Here DeepSpeed writes no ``latest``; after its closing barrier
        rank 0 replaces it atomically."""
        from hetu_ext.megatron.state import rng_state

        rng: list = [None] * dist.get_world_size()
        dist.all_gather_object(rng, rng_state(dist.get_rank()))
        tag = f"global_step{self.engine.global_steps}"
        order = [name for name, _, _ in engine_state.stage0_parameters(self.engine)] \
            if engine_state.layout(self.engine) == "params" else None  # what ZeRO-0's optimizer state numbers
        state = {CLIENT_STATE_KEY: {"iteration": self.iteration, "losses": list(self.losses),
                                    "scheduler": self.scheduler.state_dict(), "data": self.data_settings(),
                                    "rng": rng, "parameter_order": order}}
        self.engine.save_checkpoint(directory, tag=tag, client_state=state, save_latest=False)  # ends in a barrier
        if dist.get_rank() == 0:
            partial = os.path.join(directory, f".latest.{os.getpid()}")
            with open(partial, "w") as f:
                f.write(tag)
            os.replace(partial, os.path.join(directory, "latest"))
        return tag

    def load(self, directory: str, step: int | None = None):
        """``--load``: a DeepSpeed ZeRO or hetu checkpoint saved on any number of ranks (engine_load.py); ``step``
        (``--ckpt-step``): that step's checkpoint instead of the newest."""
        from .engine_load import load

        return load(self, directory, step)


def _import_deepspeed():
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    return deepspeed


SHM_COMM_OP = "deepspeed_shm_comm"
"""DeepSpeed's shared-memory all-reduce (a C++ op, JIT-compiled): used only by DeepSpeed inference."""


@contextlib.contextmanager
def _without_shm_comm_op(deepspeed) -> Iterator[None]:
    """``deepspeed.init_distributed`` without compiling DeepSpeed's shared-memory all-reduce op.

    On the CPU accelerator DeepSpeed's TorchBackend JIT-compiles ``deepspeed_shm_comm`` on its first start (measured
    here: 2 min 45 s of the 3 min first start of a 2-rank run on 2 shared cores; then cached in
    ``TORCH_EXTENSIONS_DIR``). Only ``inference_all_reduce`` (DeepSpeed inference) uses it; training all-reduces
    through torch.distributed. DeepSpeed builds it only when ``deepspeed.ops.__compatible_ops__`` marks it
    compatible, so it is marked incompatible for the call and the entry restored after. Where that registry is
    missing (another DeepSpeed), nothing is changed and DeepSpeed builds as it would."""
    ops = getattr(deepspeed.ops, "__compatible_ops__", None)
    if not isinstance(ops, dict):
        logger.debug("deepspeed.ops.__compatible_ops__ not found: DeepSpeed may compile %s", SHM_COMM_OP)
        yield
        return
    missing = object()
    before = ops.get(SHM_COMM_OP, missing)
    ops[SHM_COMM_OP] = False
    try:
        yield
    finally:
        if before is missing:
            ops.pop(SHM_COMM_OP, None)
        else:
            ops[SHM_COMM_OP] = before


def build(config: RunConfig, zero: ZeroConfig) -> DeepSpeedGPT:
    """Start gloo/NCCL (or reuse a started process group), build the model and wrap it in DeepSpeed."""
    deepspeed = _import_deepspeed()
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from hetu_ext.megatron import host
    from hetu_ext.megatron.data import DataSpec, build_train_dataset, make_tokenizer
    from hetu_ext.megatron.tokenizers import tokenizer_files
    from hetu_ext.megatron.launch_plan import model_spec
    from hetu_ext.megatron.model import (
        TrainingNumerics,
        build_gpt_stage,
        transformer_config,
        with_precision,
    )
    from hetu_ext.megatron.state import scheduler_settings
    from hetu_ext.megatron.weights import init_weights
    from hetu_ext.plan import uniform_plan

    parallel = config.parallel
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    if config.training.optimizer != "adam" or tp != 1 or pp != 1 or parallel.context_parallel_size != 1:
        raise ValueError("the DeepSpeed path trains Adam with TP 1, PP 1 and CP 1 (ZeRO shards over data parallel "
                         f"ranks); got --optimizer {config.training.optimizer} TP {tp} PP {pp} CP "
                         f"{parallel.context_parallel_size}: drop those flags")
    tokenizer = make_tokenizer(config.data.tokenizer_type, config.data.vocab_size, tokenizer_files(config.data))
    spec = model_spec(config.model, tokenizer.vocab_size)
    h = host.init_distributed(force_cpu=not torch.cuda.is_available(),
                              timeout_minutes=parallel.distributed_timeout_minutes,
                              backend=parallel.distributed_backend)
    with _without_shm_comm_op(deepspeed):
        deepspeed.init_distributed(dist_backend=h.backend)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    training, model_cfg = config.training, config.model
    tensor_parallel.model_parallel_cuda_manual_seed(training.seed)
    # the trainer's numerics from the same settings (dropout, init, --bf16, --recompute-*)
    numerics = TrainingNumerics.of(model_cfg, training, variable_seq_lengths=config.packing.method != "off")
    tconfig = transformer_config(spec, numerics, tp=1, pp=1, on_cpu=h.device.type == "cpu")
    model = build_gpt_stage(spec, tconfig, pre_process=True, post_process=True).to(h.device)
    init_weights(model, seed=training.seed, std=model_cfg.init_method_std, num_layers=spec.num_layers)
    model = with_precision(model, tconfig, numerics)  # --bf16: Megatron's Float16Module, as hetu_ext's path
    ds_config = deepspeed_config(config, zero, h.world_size)
    if training.bf16:
        ds_config["bf16"] = {"enabled": True}
    optimizer = torch.optim.AdamW(param_groups(model), lr=training.lr, betas=(training.adam_beta1, training.adam_beta2),
                                  eps=training.adam_eps, weight_decay=training.weight_decay)
    engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    engine_state.undo_initial_step(engine)  # ZeRO-0 --bf16: DeepSpeed's state-creating step on zero gradients
    gbs = ds_config["train_batch_size"]
    packed = config.packing.method != "off"
    unit = 1 if packed else gbs  # with packing a global batch's sequence count varies: the schedule counts steps
    scheduler = OptimizerParamScheduler(ds_optimizer, init_lr=0.0, **scheduler_settings(training, unit))
    plan = uniform_plan(world_size=h.world_size, num_layers=spec.num_layers,
                        num_microbatches=ds_config["gradient_accumulation_steps"])
    data = config.data
    data_spec = DataSpec(mock=data.mock_data, data_path=tuple(data.data_path or ()), split=data.split,
                         seq_length=model_cfg.seq_length, seed=training.seed, cache_path=data.data_cache_path)
    dataset = None if packed else build_train_dataset(data_spec, tokenizer, training.train_iters * gbs)
    if h.rank == 0:
        logger.info("DeepSpeed ZeRO-%d on %d %s rank(s): %s", zero.stage, h.world_size, h.device.type, ds_config)
    run = DeepSpeedGPT(config=config, engine=engine, scheduler=scheduler, dataset=dataset, plan=plan,
                       device=h.device, schedule_unit=unit)
    if packed:
        run.repack = _packer(config, spec, plan, h, tokenizer, gbs)
        run.packed = run.repack({})
    if zero.microbatches or zero.straggler_interval:
        run.weighting = _weighting(config, zero, h, ds_config["gradient_accumulation_steps"],
                                   budgets=zero.stage >= 2 and not packed)
        run.weighting.attach(model.module.decoder.layers if hasattr(model, "module") else model.decoder.layers)
        run.weighting.exclude_collectives(engine)
    return run


def _packer(config: RunConfig, spec, plan, h, tokenizer, gbs: int) -> Callable[[dict[int, float]], Any]:
    """--hetu-packing: slowdowns -> this rank's packed steps (the Megatron path's packer over one-stage
    pipelines, rank r = pipeline r; every rank plans every pipeline's share, so all agree)."""
    from hetu_ext.megatron.packed_data import build_packed_steps, open_documents

    documents = open_documents(config.data, config.packing, tokenizer, seed=config.training.seed)
    return lambda slowdowns: build_packed_steps(config.packing, spec, plan, h.rank, documents, h.device,
                                                seed=config.training.seed, global_batch_size=gbs,
                                                slowdowns=slowdowns or None)


def _weighting(config: RunConfig, zero: ZeroConfig, h, per_rank: int, budgets: bool):
    """The straggler weighting: counts of microbatches (ZeRO-0/1, or packs), or under ZeRO-2/3 (``budgets``) of
    samples over ``per_rank`` microbatches on every rank."""
    from hetu_ext.plan.malleus.straggler_policy import StragglerPolicy
    from hetu_ext.runtime.straggler import parse_schedule

    from .weighting import MicrobatchWeighting

    straggler, training = config.straggler, config.training
    share = per_rank * (training.micro_batch_size if budgets else 1)
    counts = zero.microbatches or tuple(share for _ in range(h.world_size))
    return MicrobatchWeighting(
        rank=h.rank, world=h.world_size, counts=counts, interval=zero.straggler_interval,
        policy=StragglerPolicy(threshold=straggler.threshold, min_change=straggler.min_change,
                               window=straggler.window),
        events=parse_schedule(straggler.emulate_slowdown or ""),
        nominal_s=straggler.emulate_layer_ms / 1e3 if straggler.emulate_layer_ms else None,
        nominal_tokens=training.micro_batch_size * config.model.seq_length, per_rank=per_rank if budgets else 0)
