"""Hydraulis's candidates as a HotSPa strategies file (YAML) and the plan files it names."""

from __future__ import annotations

from collections.abc import Callable

from hetu_ext.plan.core.plan import Plan
from hetu_ext.plan.core.strategies import Strategy, StrategySet


def replicas_of(strategy: Strategy) -> list[tuple[int, int, int, int]]:
    """(TP, PP, count, CP) of a strategy's pipelines, larger TP first (the first stage's TP and CP stand for the
    pipeline)."""
    counts: dict[tuple[int, int, int], int] = {}
    for p in strategy.plan.pipelines:
        key = (p.stages[0].tp, p.pp, p.stages[0].cp)
        counts[key] = counts.get(key, 0) + 1
    return [(tp, pp, n, cp) for (tp, pp, cp), n in sorted(counts.items(), key=lambda x: (-x[0][0], -x[0][1],
                                                                                           -x[0][2]))]


def strategies_yaml(strategies: StrategySet, plan_file: Callable[[int], str]) -> tuple[str, dict[str, Plan]]:
    """The candidates in the HotSPa strategies-file format (hetu_ext.plan.hotspa) and the plan files it names:
    the home, when it is Megatron's grid, as ``tp``/``pp``/``dp``, the others as ``plan: FILE``
    (``plan_file(k)``; the caller writes the returned plans there)."""
    import yaml

    from hetu_ext.plan.core.plan import uniform_shape

    out, files = [], {}
    for k, s in enumerate(strategies.items):
        shape = uniform_shape(s.plan) if k == strategies.home else None
        entry = {"name": s.name}
        if shape is not None:
            entry.update(tp=shape[0], pp=shape[1], dp=shape[2])
        else:
            entry["plan"] = plan_file(k)
            files[entry["plan"]] = s.plan
        entry["max_len"] = s.max_len
        out.append(entry)
    text = yaml.safe_dump({"home": strategies.items[strategies.home].name, "strategies": out}, sort_keys=False,
                          default_flow_style=None)
    return text, files
