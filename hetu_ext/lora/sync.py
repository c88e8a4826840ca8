"""Adapters' gradients and optimizer step under any plan: reduction, per-tenant clipping, absent tenants skipped.

After backward (Megatron's ``finalize_model_grads_func`` seam):

1. the replicated factors whose gradient is a partial sum over a stage's TP ranks (column A, row B; see
   hetu_ext.lora.layers) are all-reduced over the stage's TP group;
2. every adapter element is summed over the stages holding it (hetu_ext.plan.layout's cells and lanes over the
   adapters' own shards, hetu_ext.runtime.grad_sync): the frozen base has no gradient and is not reduced;
3. no division: the loss is already each tenant's token mean over the global batch (hetu_ext.lora.train).

The step (:meth:`LoRASync.step`) clips each tenant's adapter by its own global norm (every element counted once
over the plan) and hands the optimizer only the tenants that had data in the step: an absent tenant's
parameters get no gradient, so Adam leaves them, their moments and their step count untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hetu_ext.errors import HetuExtError
from hetu_ext.plan.layout import ShardInfo, reduction_layout
from hetu_ext.runtime.grad_sync import GradSync, LocalTensor

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
        """Per-tenant clipping, then the optimizer step for the present tenants; returns the global norm."""
        inners = getattr(optimizer, "chained_optimizers", [optimizer])
        for inner in inners:
            inner.prepare_grads()  # param.grad = param.main_grad
        squares = torch.zeros(len(self.tenants), dtype=torch.float64)
        for shard, slices, t in self.owned:
            squares[t] += shard.view(shard.param.main_grad)[slices].double().square().sum()
        dist.all_reduce(squares, group=self.used_group)
        norms = squares.sqrt()
        self.tenant_norms = norms.tolist()
        for t, params in self.params_of.items():
            if not present[t]:
                for p in params:
                    p.grad = None  # Adam skips it: weights, moments and step count stay as they are
                continue
            coef = clip_grad / (float(norms[t]) + 1.0e-6) if clip_grad > 0 else 1.0
            if coef < 1.0:  # Megatron's clip rule, per tenant
                for p in params:
                    p.main_grad.mul_(coef)
        for inner in inners:
            inner.step_with_ready_grads()
        return float(squares.sum().sqrt())


def attach_sync(placement, plan, tenants: tuple[str, ...], rank: int) -> LoRASync:
    """Build the adapters' reduction for this rank (collective over the world: every rank calls it) and make it
    the stage's finalize_model_grads_func."""
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
    if not placement.active:
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
                    params_of=params_of, owned=owned)
    placement.config.finalize_model_grads_func = lora.finalize
    return lora
