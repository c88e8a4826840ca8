"""HotSPa's ``auto`` strategies (pure): every uniform TP x CP x PP x DP shape over the job's ranks whose memory holds a
pack. The types and the strategies file live in :mod:`hetu_ext.plan.core.strategies` (Hydraulis's candidates are
the same :class:`~hetu_ext.plan.core.strategies.StrategySet`)."""

from __future__ import annotations

from hetu_ext.data.cost import CostTable
from hetu_ext.model.spec import ModelSpec
from hetu_ext.plan.core.plan import uniform_plan
from hetu_ext.plan.core.replicas import replica_specs
from hetu_ext.plan.core.strategies import Strategy, StrategySet


def _shapes(model: ModelSpec, world_size: int, cost: CostTable, max_pp: int, cp_degrees: tuple[int, ...]):
    """(tp, cp, pp) of every uniform shape over ``world_size``: CP only without PP (it is the other way to hold a
    long sequence; CP x PP is left out to keep the space, and HotSPa's programs over pairs of strategies, small),
    and only where the sequence splits into 2 cp chunks."""
    for tp in sorted(cost.per_tp):
        for pp in range(1, min(max_pp, model.num_layers) + 1):
            for cp in cp_degrees:
                if world_size % (tp * cp * pp) or model.num_layers % pp or (cp > 1 and (
                        pp > 1 or model.seq_length % (2 * cp))):
                    continue
                yield tp, cp, pp


def auto_strategies(model: ModelSpec, world_size: int, cost: CostTable, max_pp: int = 8,
                    cp_degrees: tuple[int, ...] = (1,)) -> StrategySet:
    """Every uniform TP x CP x PP x DP over ``world_size`` (TP degrees of ``cost``, PP <= ``max_pp`` dividing the
    layers, CP of ``cp_degrees`` without PP: pass :data:`~hetu_ext.plan.core.replicas.CP_DEGREES` to price CP;
    the default leaves it out, since the switching layer that runs strategies does not run CP yet) whose memory holds a pack, ``max_len`` = its capacity (the cost
    table's memory model, at most --seq-length); home: the one holding the longest sequences (ties: the fastest
    per token)."""
    items = []
    for tp, cp, pp in _shapes(model, world_size, cost, max_pp, cp_degrees):
        dp = world_size // (tp * cp * pp)
        plan = uniform_plan(world_size=world_size, tp=tp, pp=pp, cp=cp, num_layers=model.num_layers,
                            num_microbatches=dp)
        try:
            replicas = replica_specs(plan, model, cost, max_pack_tokens=model.seq_length)
        except ValueError:
            continue  # not one token fits
        name = f"tp{tp}" + (f"cp{cp}" if cp > 1 else "") + f"pp{pp}dp{dp}"
        items.append(Strategy(name=name, plan=plan, max_len=min(r.token_capacity for r in replicas)))
    if not items:
        raise ValueError(f"HotSPa auto: no TP x PP x DP shape over {world_size} ranks holds one token in "
                         f"{cost.device_memory_bytes} bytes per device; use more ranks")
    items.sort(key=lambda s: (s.max_len, -len(s.plan.pipelines)))
    longest = max(s.max_len for s in items)
    home = min((i for i, s in enumerate(items) if s.max_len == longest),
               key=lambda i: replica_specs(items[i].plan, model, cost, max_pack_tokens=longest)[0]
               .microbatch_s(longest * longest, longest) / len(items[i].plan.pipelines))
    return StrategySet(items=tuple(items), home=home)
