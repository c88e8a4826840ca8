"""Adapters' gradients and optimizer step under any plan: reduction, per-tenant clipping, absent tenants skipped.

After backward (Megatron's ``finalize_model_grads_func`` seam):

1. the replicated factors whose gradient is a partial sum over a stage's TP ranks (column A, row B; see
   hetu_ext.lora.layers) are all-reduced over the stage's TP group;
2. every adapter element is summed over the stages holding it (hetu_ext.plan.core.layout's cells and lanes over the
   adapters' own shards, hetu_ext.runtime.grad_sync): the frozen base has no gradient and is not reduced;
3. no division: the loss is already each tenant's token mean over the global batch (hetu_ext.lora.train).

The step (:meth:`LoRASync.step`) clips each tenant's adapter by its own global norm (every element counted once
over the plan) in the fp32 gradient buffer, before Megatron's ``prepare_grads`` hands it to what the optimizer
steps (the parameters, or under --bf16 their fp32 masters), and hands the optimizer only the tenants that had data
in the step: an absent tenant's parameters (and masters) get no gradient, so Adam leaves them, their moments and
their step count untouched. With --use-distributed-optimizer the same happens on the boxes each rank owns
(reduce-scatter to the owners instead of the all-reduce of step 2; the updated boxes all-gathered after).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
import torch.distributed as dist

from hetu_ext.errors import HetuExtError
from hetu_ext.plan.core.layout import ShardInfo, reduction_layout
from hetu_ext.plan.core.optimizer_shards import optimizer_shards
from hetu_ext.runtime.groups import add_lane_groups
from hetu_ext.runtime.grad_sync import GradSync, LocalTensor
from hetu_ext.runtime.sharded_optimizer import ShardedGradSync

from .adapters import adapter_shards
from .layers import partial_grads


@dataclass
class LoRASync:
    """One rank's adapter gradient reduction and step (inactive on ranks the plan leaves unused)."""

    tenants: tuple[str, ...]
    active: bool = False
    sync: GradSync | None = None
    tp_group: object = None
    used_group: object = None
    partial: list = field(default_factory=list)
    params_of: dict[int, list] = field(default_factory=dict)
    """Tenant index -> its local adapter parameters."""
    owned: list = field(default_factory=list)
    """(adapter shard, slices of its box, tenant index) of the cells this rank counts in the tenants' norms."""
    tenant_norms: list[float] = field(default_factory=list)
    """Each tenant's gradient norm of the last step (before clipping)."""
    stepped_of: dict[int, list] = field(default_factory=dict)
    """Tenant index -> the parameters its optimizer steps: ``params_of``, or (sharded) views of its owned boxes."""
    tenant_of: dict[int, int] = field(default_factory=dict)
    """Local adapter parameter id -> tenant index."""
    sharded: ShardedGradSync | None = None
    """--use-distributed-optimizer: the adapters' reduce-scatter to their owners and all-gather after the step."""

    def finalize(self, model_chunks, num_tokens=None, pg_collection=None, force_all_reduce=False) -> None:
        """Megatron's finalize_model_grads_func: the reduction above (``num_tokens`` is not used: the loss is
        normalised per tenant already)."""
        for chunk in model_chunks:
            chunk.finish_grad_sync()
        if self.partial:
            grads = [p.main_grad for p in self.partial]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.tp_group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        self.sync.reduce()

    @torch.no_grad()
    def step(self, optimizer, *, present: list[bool], clip_grad: float) -> float:
        """Per-tenant clipping, then the optimizer step for the present tenants; returns the global norm.

        Clipping scales ``main_grad`` (the fp32 gradient buffer) *before* Megatron's ``prepare_grads`` hands it to
        the optimizer, so it acts whatever the optimizer steps: the parameters themselves (fp32), or their fp32
        master copies (--bf16: Float16OptimizerWithFloat16Params gives ``param.main_param`` the gradient). An
        absent tenant's gradient is then removed from what the optimizer steps (the master's, under --bf16), so
        Adam leaves its weights, moments and step count untouched."""
        inners = getattr(optimizer, "chained_optimizers", [optimizer])
        if any(getattr(inner, "grad_scaler", None) is not None for inner in inners):
            raise HetuExtError("per-tenant clipping needs unscaled gradients; a loss scaler (fp16) is not supported "
                               "with LoRA tenants")
        squares = torch.zeros(len(self.tenants), dtype=torch.float64)
        for grad, t in self.owned_grads():
            squares[t] += grad.double().square().sum()
        dist.all_reduce(squares, group=self.used_group)
        norms = squares.sqrt()
        self.tenant_norms = norms.tolist()
        for t, params in self.params_of.items():
            coef = clip_grad / (float(norms[t]) + 1.0e-6) if clip_grad > 0 else 1.0
            if present[t] and coef < 1.0:  # Megatron's clip rule, per tenant
                for p in params:
                    p.main_grad.mul_(coef)
        for inner in inners:
            inner.prepare_grads()  # param.grad = param.main_grad (fp32), or param.main_param.grad (--bf16)
        for t, params in self.stepped_of.items():
            if present[t]:
                continue
            for p in params:  # Adam skips it: weights, moments and step count stay as they are
                p.grad = None
                master = getattr(p, "main_param", None)
                if master is not None:
                    master.grad = None
        for inner in inners:
            inner.step_with_ready_grads()
        if self.sharded is not None:
            self.sharded.gather()  # the owners' updated boxes to every holder
        return float(squares.sum().sqrt())

    def owned_grads(self):
        """(gradient, tenant index) of every adapter element exactly once over the plan: this rank's cells of the
        reduction layout, or (--use-distributed-optimizer) the boxes it owns, whose gradient the reduce-scatter
        summed there."""
        if self.sharded is not None:
            for owned in self.sharded.owned:
                yield owned.grad_view(), self.tenant_of[id(owned.local.param)]
            return
        for shard, slices, t in self.owned:
            yield shard.view(shard.param.main_grad)[slices], t


def attach_sync(placement, plan, tenants: tuple[str, ...], rank: int, *, sharded_optimizer=None) -> LoRASync:
    """Build the adapters' reduction for this rank (collective over the world: every rank calls it) and make it
    the stage's finalize_model_grads_func. ``sharded_optimizer`` (Megatron's OptimizerConfig, for
    --use-distributed-optimizer; the placement was then built without an optimizer): each adapter element's Adam
    state on one of its holders (hetu_ext.plan.core.optimizer_shards over the adapters' own boxes), gradients
    reduce-scattered to their owners, Megatron's optimizer over the owned boxes (megatron/sharded_optimizer.py),
    the updated boxes all-gathered after the step; this becomes the placement's optimizer."""
    where = plan.stage_of(rank)
    offset = placement.shard_kwargs.get("layer_offset", 0) if placement.active else 0
    shards = adapter_shards(placement.model, layer_offset=offset) if placement.active else []
    infos = []
    if placement.active:
        for s in shards:
            box = tuple((sl.start, sl.stop) for sl in s.slices)
            infos.append(ShardInfo(rank=rank, stage=where, tp_index=placement.tp_rank, key=s.key, index=s.index,
                                   box=box))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, infos)
    layout = reduction_layout([i for part in everyone for i in part])
    opt_shards = optimizer_shards([i for part in everyone for i in part]) if sharded_optimizer is not None else None
    if opt_shards is not None:  # a group per holder set, created by every rank in the same order
        owner_groups = SimpleNamespace(rank=rank, lanes={})
        add_lane_groups(owner_groups, opt_shards.holder_sets())
    if not placement.active:
        if sharded_optimizer is not None:
            from hetu_ext.megatron.sharded_optimizer import join_sharded_setup

            join_sharded_setup(sharded_optimizer)
        return LoRASync(tenants=tenants)
    groups = placement.grad_sync.groups
    missing = [lane for lane, _ in layout.lanes_of(rank) if lane not in groups.lanes]
    if missing:
        raise HetuExtError(f"adapter gradient lanes {missing} are not lanes of the base model's layout; every "
                           "adapter is held by the stages holding its layer, so this is a bug")
    local = {(s.key, s.index): LocalTensor(param=s.param, box=tuple((sl.start, sl.stop) for sl in s.slices),
                                           shape=None if s.data is None else tuple(s.data.shape)) for s in shards}
    index_of = {name: k for k, name in enumerate(tenants)}
    params_of: dict[int, list] = {k: [] for k in range(len(tenants))}
    by_key = {}
    for s in shards:
        params_of[index_of[s.tenant]].append(s.param)
        by_key[(s.key, s.index)] = s
    owned = []
    for cell, owner in layout.owners.items():
        if owner == rank:
            s = by_key[(cell.key, cell.index)]
            slices = tuple(slice(c0 - b.start, c1 - b.start) for (c0, c1), b in zip(cell.box, s.slices))
            owned.append((s, slices, index_of[s.tenant]))
    lora = LoRASync(tenants=tenants, active=True, sync=GradSync(layout=layout, groups=groups, local=local),
                    tp_group=groups.tp, used_group=groups.used, partial=partial_grads(placement.model),
                    params_of=params_of, owned=owned, stepped_of=params_of,
                    tenant_of={id(p): t for t, params in params_of.items() for p in params})
    if opt_shards is not None:
        _shard_optimizer(lora, placement, sharded_optimizer, ShardedGradSync(
            shards=opt_shards, groups=dataclasses.replace(groups, lanes=owner_groups.lanes), local=local))
    placement.config.finalize_model_grads_func = lora.finalize
    return lora


def _shard_optimizer(lora: LoRASync, placement, opt_config, sharded: ShardedGradSync) -> None:
    """--use-distributed-optimizer: Megatron's optimizer over the adapter boxes this rank owns becomes the
    placement's; the step clips and skips tenants on those boxes (``stepped_of``) and gathers them after."""
    from hetu_ext.megatron.sharded_optimizer import build_sharded_optimizer

    groups = placement.grad_sync.groups
    optimizer = build_sharded_optimizer(opt_config, placement.model, sharded,
                                        placement.schedule_kwargs["pg_collection"], groups.used)
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner.get_main_grads_for_grad_norm = sharded.owned_grads
        inner.grad_stats_parallel_group = groups.used
    placement.optimizer = optimizer
    placement.config.grad_scale_func = optimizer.scale_loss
    lora.sync = lora.sharded = sharded
    lora.stepped_of = {t: [] for t in lora.params_of}
    for owned, view in optimizer.hetu_sharded.params:
        lora.stepped_of[lora.tenant_of[id(owned.local.param)]].append(view)
