"""Run any valid Plan on Megatron-core: each rank builds its stage, each pipeline runs Megatron's schedule.

Megatron's ``parallel_state`` knows one uniform TP x PP x DP grid. Here nothing global is set: every stage is a
Megatron-core GPTModel built for its own layers and TP group and fed its groups through ``pg_collection``; its
DistributedDataParallel and optimizer get the same collection; each pipeline runs Megatron's 1F1B schedule with
its own microbatch count and a ``p2p_communicator`` that routes between stages of different TP degrees. What
Megatron cannot know, the plan's replicas being shaped differently, is handled in the one hook it offers after
backward, ``finalize_model_grads_func``: every gradient element is summed over the stages that hold it
(runtime/grad_sync.py), then divided by the global batch's token count.

The stage model is built with ``num_layers`` = the stage's layer count and pre/post-processing flags set from the
plan, so Megatron sees a one-stage model and numbers its layers locally; the global layer number is restored
where tensors get their global identity (weights.local_shards(layer_offset=...)).
"""

from __future__ import annotations

import copy
import dataclasses

import torch
import torch.distributed as dist

from hetu_ext.config import TrainingConfig
from hetu_ext.plan import ModelSpec, Plan, PlanError
from hetu_ext.plan.core.layout import ShardInfo, in_place_lanes, reduction_layout
from hetu_ext.plan.core.optimizer_shards import optimizer_shards
from hetu_ext.plan.core.plan import neighbours
from hetu_ext.runtime.grad_sync import GradSync, LocalTensor
from hetu_ext.runtime.groups import PlanGroups, add_lane_groups, build_groups
from hetu_ext.runtime.sharded_optimizer import ShardedGradSync

from .launch_plan import check_runnable
from .model import TrainingNumerics, build_gpt_stage, optimizer_config, transformer_config, with_precision
from .p2p import StagePosition
from .placement import Placement
from .sharded_optimizer import build_sharded_optimizer, join_sharded_setup
from .weights import init_weights, local_shards


def _pg_collection(groups: PlanGroups, tp=None):
    """The groups a stage model sees: its TP group (``tp``, default the stage's), its CP group (RoPE's chunks, the
    core attention's key/value gather, the schedule's tensor shapes; itself without CP), itself for everything
    else (the gradient reductions over DP x CP are runtime/grad_sync.py's)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    one, tp = groups.single, tp or groups.tp
    return ProcessGroupCollection(
        tp=tp, pp=one, mp=tp, cp=groups.cp or one, tp_cp=tp, tp_dp_cp=tp, dp=one, dp_cp=one, intra_dp_cp=one, ep=one,
        expt_tp=tp, tp_ep=tp, tp_ep_pp=tp, expt_dp=one, intra_expt_dp=one, embd=None, pos_embd=None,
        inter_dist_opt=None, intra_dist_opt=None, hcp=None)


def _buffer_offset(param: torch.Tensor, buffers: list[torch.Tensor]) -> int:
    """Element offset of a parameter's gradient in the concatenation of DDP's grad buffers (-1 if absent)."""
    grad = getattr(param, "main_grad", None)
    base = 0
    for buffer in buffers:
        end = buffer.data_ptr() + buffer.numel() * buffer.element_size()
        if grad is not None and buffer.data_ptr() <= grad.data_ptr() < end:
            return base + (grad.data_ptr() - buffer.data_ptr()) // grad.element_size()
        base += buffer.numel()
    return -1


def tp_partial_grads(model, config) -> list[torch.Tensor]:
    """The ``main_grad`` of every parameter that each TP rank of a stage holds whole but computes the gradient of
    only in part: the norms under sequence parallelism (1/TP of the sequence each) and the query/key norms (1/TP of
    the heads each). Megatron's finalize_model_grads sums the same ones over TP, by the same rule."""
    return [param.main_grad for name, param in model.named_parameters() if param.requires_grad and (
        (config.sequence_parallel and getattr(param, "sequence_parallel", False))
        or (config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)))]


def sum_over_group(grads: list[torch.Tensor], group) -> None:
    """All-reduce (sum) ``grads`` in place over ``group``, as one flat buffer."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    for grad, summed in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(summed)


def _probe_layer(training: TrainingConfig, spec: ModelSpec, numerics: TrainingNumerics, groups: PlanGroups, host,
                 converter=None):
    """One transformer layer of the model on an idle rank (TP 1, its own group): the straggler monitor times it
    so that an idle rank's speed is measured on the same work as the others' and it can be brought back."""
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(training.seed, tp_rank=0, ep_rank=0, etp_rank=0,
                                                     force_reset_rng=True)
    one = dataclasses.replace(spec, num_layers=1)
    config = transformer_config(one, numerics, tp=1, pp=1, on_cpu=host.device.type == "cpu")
    model = build_gpt_stage(one, config, pre_process=False, post_process=False,
                            pg_collection=_pg_collection(groups, tp=groups.single), converter=converter)
    return model.decoder.layers[0].to(host.device)


def _join_optimizer_setup(training: TrainingConfig, spec: ModelSpec, numerics: TrainingNumerics, groups: PlanGroups,
                          host) -> None:
    """An idle rank's share of the optimizer set-up: get_megatron_optimizer aligns parameter groups across ranks
    with all_gather_object over the whole world (0.16.1, optimizer/__init__.py:_get_param_groups), so an idle
    rank runs it too, on a module with no trainable parameter, and drops the result."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.transformer.module import MegatronModule

    config = transformer_config(dataclasses.replace(spec, num_layers=1), numerics, tp=1, pp=1,
                                on_cpu=host.device.type == "cpu")
    idle = MegatronModule(config)
    idle.placeholder = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
    opt_config = optimizer_config(training, numerics)
    pgc = _pg_collection(groups)
    idle = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(), module=idle,
                                   pg_collection=pgc)
    get_megatron_optimizer(opt_config, [idle], use_gloo_process_groups=False, pg_collection=pgc)


@dataclasses.dataclass
class _Stage:
    """This rank's stage under a plan: the DDP-wrapped stage model and what the gradient sync and optimizer need."""

    model: object
    config: object
    pgc: object
    stage: object
    tp_rank: int
    cp_rank: int
    shard_kwargs: dict
    shards: list[ShardInfo]
    """This rank's pieces of the global tensors, gathered by every rank to derive the plan's layout."""
    local: dict
    flat: list


def _build_stage(training: TrainingConfig, spec: ModelSpec, plan: Plan, host, numerics: TrainingNumerics,
                 groups: PlanGroups, where: tuple[int, int], converter) -> _Stage:
    """The stage model of this rank's place ``where`` (pipeline, stage): Megatron-core's GPTModel for its layers,
    initialised layout-independently, Float16Module under --bf16 / --fp16, Megatron's DDP around it."""
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    stage = plan.pipelines[where[0]].stages[where[1]]
    cp_rank, tp_rank = stage.position(host.rank)
    tensor_parallel.model_parallel_cuda_manual_seed(training.seed, tp_rank=tp_rank, ep_rank=0, etp_rank=0,
                                                     force_reset_rng=True)
    pgc = _pg_collection(groups)
    stage_spec = dataclasses.replace(spec, num_layers=stage.num_layers)
    config = transformer_config(stage_spec, numerics, tp=stage.tp, pp=1, on_cpu=host.device.type == "cpu",
                                cp=stage.cp)
    model = build_gpt_stage(stage_spec, config, pre_process=stage.has_embedding,
                            post_process=stage.has_output, pg_collection=pgc, converter=converter,
                            layer_offset=stage.layer_start)
    model.to(host.device)
    shard_kwargs = {"layer_offset": stage.layer_start, "metadata": {"dp_cp_group": groups.single}}
    init_weights(model, seed=training.seed, std=numerics.init_method_std, num_layers=spec.num_layers,
                 **shard_kwargs)
    model = with_precision(model, config, numerics)
    if numerics.half:
        # Float16Module casts inputs on the first stage and outputs back to fp32 on the last, asking its
        # pg_collection's pp group; the stage model's is a single rank, so tell it the plan's position
        position = StagePosition(where[1], plan.pipelines[where[0]].pp)
        model.pg_collection = copy.copy(model.pg_collection)
        model.pg_collection.pp = position
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=numerics.grad_reduce_in_fp32,
                                               overlap_grad_reduce=False)
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model, pg_collection=pgc)
    local, shards = {}, []
    flat = [b.grad_data for b in model.buffers + model.expert_parallel_buffers]
    for s in local_shards(model, **shard_kwargs):
        box = tuple((sl.start, sl.stop) for sl in s.slices)
        shards.append(ShardInfo(rank=host.rank, stage=where, tp_index=tp_rank, key=s.key, index=s.index,
                                box=box, offset=_buffer_offset(s.param, flat), cp_index=cp_rank))
        if (s.key, s.index) in local:
            raise PlanError(f"{s.key}{list(s.index)} appears twice on rank {host.rank}")
        local[(s.key, s.index)] = LocalTensor(param=s.param, box=box,
                                               shape=tuple(s.data.shape) if s.gated else None)
    return _Stage(model=model, config=config, pgc=pgc, stage=stage, tp_rank=tp_rank, cp_rank=cp_rank,
                  shard_kwargs=shard_kwargs, shards=shards, local=local, flat=flat)


def _finalize_func(sync, groups: PlanGroups, partial: list[torch.Tensor], normaliser: dict, *, is_last: bool,
                   tp_rank: int):
    """Megatron's ``finalize_model_grads_func`` for a plan: DDP's own (single-rank) sync, the TP-partial sums, every
    element summed over its holders (``sync``), then divided by the global batch's token count (or
    ``normaliser["tokens"]``)."""

    def finalize(model_chunks, num_tokens=None, pg_collection=None, force_all_reduce=False):
        for chunk in model_chunks:
            chunk.finish_grad_sync()
        if partial:  # TP copies of a stage are identical from here on, as the layout assumes
            sum_over_group(partial, groups.tp)
        sync.reduce()
        if normaliser.get("tokens") is not None:
            tokens = torch.tensor([float(normaliser["tokens"])], dtype=torch.float64)
        else:
            tokens = torch.zeros(1, dtype=torch.float64)
            if is_last and tp_rank == 0 and num_tokens is not None:
                tokens += float(num_tokens)
            dist.all_reduce(tokens, group=groups.used)
        for chunk in model_chunks:
            chunk.scale_gradients(1.0 / float(tokens))

    return finalize


def ensure_memory_buffer() -> None:
    """Create Megatron's global scratch buffer if no one did: its layers draw from it (the local attention's
    matmul input, sequence parallelism's all-gathers). In Megatron-core 0.16.1 the only public code that creates it
    is ``parallel_state.initialize_model_parallel`` (its last line), which also sets the uniform TP x PP x DP
    grid's ~50 globals that the plan runtime must not set; ``get_global_memory_buffer`` (public) asserts on a
    missing buffer and ``destroy_global_memory_buffer`` (public) only clears it. No public seam creates the buffer
    alone, so the private setter ``_set_global_memory_buffer`` is called, only when the public getter finds
    none (its assertion, or None under ``python -O``); the module global itself is never read or written here."""
    from megatron.core import parallel_state

    try:
        present = parallel_state.get_global_memory_buffer() is not None
    except AssertionError:
        present = False
    if not present:
        parallel_state._set_global_memory_buffer()


@dataclasses.dataclass
class _Shards:
    """Every rank's pieces of the global tensors under a plan (all-gathered), and the gradient reduction's layout
    derived from them; ``optimizer``: with the sharded optimizer, which holder owns each element's state."""

    all: list[ShardInfo]
    layout: object
    optimizer: object = None


def _collect_shards(built: _Stage | None, groups: PlanGroups, sharded_optimizer: bool) -> _Shards:
    """Collective over the world (idle ranks give nothing): every rank's shards, the reduction lanes and, with the
    sharded optimizer, a group per holder set (hetu_ext.plan.core.optimizer_shards)."""
    everyone: list = [None] * groups.world_size
    dist.all_gather_object(everyone, built.shards if built is not None else [])
    all_shards = [s for part in everyone for s in part]
    layout = reduction_layout(all_shards)
    add_lane_groups(groups, list(layout.lanes))
    shards = _Shards(all=all_shards, layout=layout)
    if sharded_optimizer:
        shards.optimizer = optimizer_shards(all_shards)
        add_lane_groups(groups, [h for h in shards.optimizer.holder_sets() if h not in layout.lanes])
    return shards


def _idle_placement(training: TrainingConfig, spec: ModelSpec, numerics: TrainingNumerics, groups: PlanGroups, host,
                    *, sharded_optimizer: bool, with_optimizer: bool, converter) -> Placement:
    """A rank the plan leaves unused: its share of the optimizer's collective set-up, and a probe layer."""
    if sharded_optimizer:
        join_sharded_setup(optimizer_config(training, numerics))
    elif with_optimizer:
        _join_optimizer_setup(training, spec, numerics, groups, host)
    return Placement(active=False, probe_layer=_probe_layer(training, spec, numerics, groups, host, converter))


def _sync_and_optimizer(training: TrainingConfig, numerics: TrainingNumerics, built: _Stage, groups: PlanGroups,
                        shards: _Shards, *, sharded_optimizer: bool, with_optimizer: bool):
    """The gradient sync over each element's holders and the optimizer (None without): (sync, optimizer).
    Sharded (--use-distributed-optimizer): reduce-scatter to each element's owner, owners step, all-gather;
    else Megatron's optimizer over the summed gradients. Either way the global gradient norm counts every
    element once over the whole plan."""
    from megatron.core.optimizer import get_megatron_optimizer

    opt_config = optimizer_config(training, numerics)
    optimizer = None
    if sharded_optimizer:
        sync = ShardedGradSync(shards=shards.optimizer, groups=groups, local=built.local)
        optimizer = build_sharded_optimizer(opt_config, built.model, sync, built.pgc, groups.used)
    else:
        sync = GradSync(layout=shards.layout, groups=groups, local=built.local, flat_buffers=built.flat,
                        in_place=in_place_lanes(shards.layout, shards.all))
        if with_optimizer:
            optimizer = get_megatron_optimizer(opt_config, [built.model], use_gloo_process_groups=False,
                                               pg_collection=built.pgc)
    for inner in getattr(optimizer, "chained_optimizers", [optimizer] if optimizer is not None else []):
        inner.get_main_grads_for_grad_norm = sync.owned_grads
        inner.grad_stats_parallel_group = groups.used
    return sync, optimizer


def _finish_placement(plan: Plan, host, numerics: TrainingNumerics, built: _Stage, groups: PlanGroups,
                      where: tuple[int, int], sync, optimizer) -> Placement:
    """Megatron's hooks on the stage's config (no_sync, finalize_model_grads_func, grad_scale_func), the
    point-to-point routes between stages, and the schedule of this rank's pipeline."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from .p2p import StageP2P

    model, config, stage = built.model, built.config, built.stage
    normaliser: dict = {}
    """``normaliser["tokens"]``, when set: divide gradients by it instead of this schedule's token count (HotSPa
    runs one step as several schedules and normalises by the whole step's tokens)."""
    partial = tp_partial_grads(model, config) if stage.tp > 1 else []
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = _finalize_func(sync, groups, partial, normaliser, is_last=stage.has_output,
                                                      tp_rank=built.tp_rank)
    config.grad_scale_func = optimizer.scale_loss if optimizer is not None else None
    p2p = StageP2P(neighbours(plan, host.rank), config, dtype=numerics.dtype, device=host.device,
                   sequence_group=groups.tp if config.sequence_parallel else None)
    return Placement(active=True, pipeline_index=where[0], model=model, optimizer=optimizer, config=config,
                     is_last_stage=stage.has_output, tp_rank=built.tp_rank, cp_rank=built.cp_rank,
                     cp_size=stage.cp, report_group=groups.used,
                     schedule_kwargs={"p2p_communicator": p2p, "pg_collection": built.pgc},
                     forward_backward=get_forward_backward_func(pp_size=plan.pipelines[where[0]].pp, vp_size=None),
                     grad_sync=sync, shard_kwargs=built.shard_kwargs, normaliser=normaliser)


def build_plan_placement(training: TrainingConfig, spec: ModelSpec, plan: Plan, host, numerics: TrainingNumerics,
                         *, use_distributed_optimizer: bool = False, with_optimizer: bool = True,
                         converter=None) -> Placement:
    """Groups, stage model, DDP, optimizer, schedule and gradient sync for this rank under ``plan`` (reads the
    seed and the optimizer settings of ``training``; collective over the world). ``use_distributed_optimizer``:
    each element's optimizer state on one of its holders (megatron/sharded_optimizer.py).
    ``with_optimizer=False``: a compute placement (HotSPa's strategies, megatron/switching.py): no optimizer;
    its gradients are reduced over its own holders, then pulled into the home placement's. ``converter``: a model
    converter for every stage model built (model.build_gpt_stage; LoRA's adapters).

    Four steps: the stage (:func:`_build_stage`), every rank's shards and the reduction layout
    (:func:`_collect_shards`), the gradient sync and optimizer (:func:`_sync_and_optimizer`), Megatron's hooks
    and the schedule (:func:`_finish_placement`)."""
    check_runnable(plan)
    ensure_memory_buffer()
    groups = build_groups(plan)
    where = plan.stage_of(host.rank)
    sharded = use_distributed_optimizer and with_optimizer
    built = _build_stage(training, spec, plan, host, numerics, groups, where, converter) if where is not None \
        else None
    shards = _collect_shards(built, groups, sharded)
    if built is None:
        return _idle_placement(training, spec, numerics, groups, host, sharded_optimizer=sharded,
                               with_optimizer=with_optimizer, converter=converter)
    sync, optimizer = _sync_and_optimizer(training, numerics, built, groups, shards, sharded_optimizer=sharded,
                                          with_optimizer=with_optimizer)
    return _finish_placement(plan, host, numerics, built, groups, where, sync, optimizer)
