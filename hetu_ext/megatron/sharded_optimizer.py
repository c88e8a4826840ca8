"""``--use-distributed-optimizer`` on the plan runtime: Megatron's own optimizer over the boxes this rank owns.

Megatron's DistributedOptimizer shards over one uniform data-parallel group; under a heterogeneous plan each
element's holders differ (plan/core/optimizer_shards.py). We keep Megatron's optimizer classes and math
(``FP32Optimizer``, or ``Float16OptimizerWithFloat16Params`` under --bf16: clipping by the global norm, Adam or
SGD, fp32 masters) and only change what they are given: for every box this rank owns, a parameter that is a
*view* of the model's parameter (``main_grad`` a view of DDP's gradient buffer), in the parameter groups
Megatron's ``_get_param_groups`` makes for the whole model (weight decay, LR multipliers). So Adam's moments,
and under --bf16 the fp32 masters, exist for owned elements only; fp32 models step their owned elements in place.
After the step the updated weights are all-gathered over each holder set (runtime/sharded_optimizer.py).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass

import torch

from hetu_ext.runtime.sharded_optimizer import OwnedBox, ShardedGradSync


@dataclass(frozen=True)
class OwnedState:
    """One owned box: its weight (a view of the model's parameter), fp32 master (--bf16) and optimizer state."""

    key: str
    index: tuple[int, ...]
    box: tuple[tuple[int, int], ...]
    weight: torch.Tensor
    master: torch.Tensor | None
    state: dict


@dataclass
class ShardedState:
    """What a sharded optimizer keeps, for checkpoints, migration and the memory table."""

    sync: ShardedGradSync
    optimizer: object
    """Megatron's optimizer over the owned views."""
    params: list[tuple[OwnedBox, torch.nn.Parameter]]

    def entries(self) -> list[OwnedState]:
        opt = self.optimizer.optimizer
        out = []
        for owned, param in self.params:
            master = getattr(param, "main_param", None)
            state = opt.state.get(master if master is not None else param, {}) if opt is not None else {}
            out.append(OwnedState(owned.cell.key, owned.cell.index, owned.box, param, master, state))
        return out

    def owned_numel(self) -> int:
        return sum(p.numel() for _, p in self.params)


def sharded_state(optimizer) -> ShardedState | None:
    """The sharded optimizer's state, or None for Megatron's own optimizers."""
    return getattr(optimizer, "hetu_sharded", None)


def param_groups(model_chunks: list[torch.nn.Module], opt_config) -> list[dict]:
    """Megatron's parameter groups for ``model_chunks`` (collective: all_gather_object over the world, so idle
    ranks call it too, with an empty module)."""
    from megatron.core.optimizer import _get_param_groups

    return _get_param_groups(model_chunks, opt_config, None)


def build_sharded_optimizer(opt_config, model: torch.nn.Module, sync: ShardedGradSync, pg_collection,
                            stats_group):
    """Megatron's optimizer over the boxes ``sync`` says this rank owns; its ``step`` then gathers the updated
    weights. ``stats_group``: every rank of the plan (the grad norm sums each rank's owned elements)."""
    from megatron.core.optimizer import _get_megatron_optimizer_based_on_param_groups

    groups = param_groups([model], opt_config)
    by_param: dict[int, list[OwnedBox]] = defaultdict(list)
    for owned in sync.owned:
        by_param[id(owned.local.param)].append(owned)
    pairs = []
    for group in groups:
        if group["is_expert_parallel"]:
            raise NotImplementedError("expert-parallel parameters are not supported by the sharded optimizer")
        views = []
        for p in group["params"]:
            for owned in by_param.pop(id(p), []):
                view = torch.nn.Parameter(owned.param_view(), requires_grad=True)
                view.main_grad = owned.grad_view()
                views.append(view)
                pairs.append((owned, view))
        group["params"] = views
    if by_param:
        raise AssertionError(f"{len(by_param)} owned tensors are not trainable parameters of the stage model")
    config = dataclasses.replace(opt_config, use_distributed_optimizer=False)
    optimizer = _get_megatron_optimizer_based_on_param_groups(config, [model], groups,
                                                              model_parallel_group=stats_group,
                                                              pg_collection=pg_collection)
    inner_step = optimizer.step

    def step():
        result = inner_step()
        sync.gather()
        return result

    optimizer.step = step
    optimizer.hetu_sharded = ShardedState(sync=sync, optimizer=optimizer, params=pairs)
    return optimizer


def join_sharded_setup(opt_config) -> None:
    """An idle rank's share of the set-up: the same collective as :func:`build_sharded_optimizer`."""
    param_groups([torch.nn.Module()], opt_config)
