"""HotSPa's ``auto`` strategies (pure): every uniform TP x PP x DP shape over the job's ranks whose memory holds a
pack. The types and the strategies file live in :mod:`hetu_ext.plan.core.strategies` (Hydraulis's candidates are
the same :class:`~hetu_ext.plan.core.strategies.StrategySet`)."""

from __future__ import annotations

from hetu_ext.data.cost import CostTable
from hetu_ext.model.spec import ModelSpec
from hetu_ext.plan.core.plan import uniform_plan
from hetu_ext.plan.core.replicas import replica_specs
from hetu_ext.plan.core.strategies import Strategy, StrategySet


def auto_strategies(model: ModelSpec, world_size: int, cost: CostTable, max_pp: int = 8) -> StrategySet:
    """Every uniform TP x PP x DP over ``world_size`` (TP degrees of ``cost``, PP <= ``max_pp`` dividing the
    layers) whose memory holds a pack, ``max_len`` = its capacity (the cost table's memory model, at most
    --seq-length); home: the one holding the longest sequences (ties: the fastest per token)."""
    items = []
    for tp in sorted(cost.per_tp):
        for pp in range(1, min(max_pp, model.num_layers) + 1):
            if world_size % (tp * pp) or model.num_layers % pp:
                continue
            plan = uniform_plan(world_size=world_size, tp=tp, pp=pp, num_layers=model.num_layers,
                                num_microbatches=world_size // (tp * pp))
            try:
                replicas = replica_specs(plan, model, cost, max_pack_tokens=model.seq_length)
            except ValueError:
                continue  # not one token fits
            items.append(Strategy(name=f"tp{tp}pp{pp}dp{world_size // (tp * pp)}", plan=plan,
                                  max_len=min(r.token_capacity for r in replicas)))
    if not items:
        raise ValueError(f"HotSPa auto: no TP x PP x DP shape over {world_size} ranks holds one token in "
                         f"{cost.device_memory_bytes} bytes per device; use more ranks")
    items.sort(key=lambda s: (s.max_len, -len(s.plan.pipelines)))
    longest = max(s.max_len for s in items)
    home = min((i for i, s in enumerate(items) if s.max_len == longest),
               key=lambda i: replica_specs(items[i].plan, model, cost, max_pack_tokens=longest)[0]
               .microbatch_s(longest * longest, longest) / len(items[i].plan.pipelines))
    return StrategySet(items=tuple(items), home=home)
