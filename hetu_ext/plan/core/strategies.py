"""StrategySet (pure): a named plan over the job's ranks and the longest sequence it takes, and the set a step
chooses among (:class:`StrategySet`: HotSPa's groups of one step, Hydraulis's candidates), read from a strategies
file (YAML: ``--hetu-hotspa FILE`` / ``--hetu-strategies FILE``, the format in :mod:`hetu_ext.plan.hotspa`'s
docstring). HotSPa's ``auto`` set is built in :mod:`hetu_ext.plan.hotspa.strategies`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hetu_ext.keys import check_keys, read_yaml
from hetu_ext.model.spec import ModelSpec
from hetu_ext.plan.core.io import load_plan
from hetu_ext.plan.core.plan import Plan, PlanError, uniform_plan, validate_plan


_FILE_KEYS = {"home", "home_first", "strategies"}


_STRATEGY_KEYS = {"name", "plan", "tp", "pp", "dp", "max_len"}


@dataclass(frozen=True)
class Strategy:
    name: str
    plan: Plan
    max_len: int
    """The longest sequence (tokens) this strategy takes."""


@dataclass(frozen=True)
class StrategySet:
    """The candidate strategies, ordered by ``max_len``, and which one is home."""

    items: tuple[Strategy, ...]
    home: int
    """Index into ``items`` of the strategy that holds the optimizer."""
    home_first: bool = True

    @property
    def capacity(self) -> int:
        return max(s.max_len for s in self.items)


def _strategy(raw: dict, where: str, *, model: ModelSpec, world_size: int, base: Path) -> Strategy:
    raw = check_keys(raw, _STRATEGY_KEYS, where, type_error=ValueError)
    if "max_len" not in raw:
        raise ValueError(f"{where}: max_len (the longest sequence it takes, tokens) is required")
    max_len = raw["max_len"]
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"{where}: max_len must be an integer >= 1, got {max_len!r}")
    if max_len > model.seq_length:
        raise ValueError(f"{where}: max_len {max_len} exceeds --seq-length {model.seq_length} (the longest "
                         "sequence the model's positions take); lower max_len or raise --seq-length")
    name = str(raw.get("name", f"strategy{where[-2:-1]}"))
    if "plan" in raw:
        if {"tp", "pp", "dp"} & set(raw):
            raise ValueError(f"{where}: give either plan: FILE or a tp/pp/dp shape, not both")
        path = Path(raw["plan"])
        plan = load_plan(path if path.is_absolute() else base / path)
    else:
        shape = {k: raw.get(k, 1) for k in ("tp", "pp")}
        for key, value in shape.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{where}: {key} must be an integer >= 1, got {value!r}")
        dp = raw.get("dp", world_size // (shape["tp"] * shape["pp"]))
        if shape["tp"] * shape["pp"] * dp > world_size or dp < 1:
            raise ValueError(f"{where}: tp {shape['tp']} x pp {shape['pp']} x dp {dp} = "
                             f"{shape['tp'] * shape['pp'] * dp} ranks does not fit the world size {world_size}; "
                             "shrink the shape or launch more ranks")
        try:
            plan = uniform_plan(world_size=shape["tp"] * shape["pp"] * dp, num_layers=model.num_layers,
                                num_microbatches=dp, **shape)
        except PlanError as exc:
            raise ValueError(f"{where}: {exc}") from exc
    try:
        validate_plan(plan, model, world_size=world_size)
    except PlanError as exc:
        raise ValueError(f"{where}: {exc}") from exc
    return Strategy(name=name, plan=plan, max_len=max_len)


def strategies_from_dict(data, *, model: ModelSpec, world_size: int, where: str = "HotSPa strategies",
                         base: Path = Path(".")) -> StrategySet:
    data = check_keys(data, _FILE_KEYS, where, type_error=ValueError)
    items_raw = data.get("strategies")
    if not isinstance(items_raw, list) or not items_raw:
        raise ValueError(f"{where}: 'strategies' must be a non-empty list of strategies (each a tp/pp/dp shape or "
                         "plan: FILE, with max_len)")
    items = [_strategy(raw, f"{where} strategies[{i}]", model=model, world_size=world_size, base=base)
             for i, raw in enumerate(items_raw)]
    names = [s.name for s in items]
    if len(set(names)) != len(names):
        raise ValueError(f"{where}: strategy names must differ, got {names}")
    items.sort(key=lambda s: s.max_len)
    home_name = data.get("home", items[-1].name)
    if home_name not in [s.name for s in items]:
        raise ValueError(f"{where}: home {home_name!r} is not a strategy; choose one of {names}")
    home_first = data.get("home_first", True)
    if not isinstance(home_first, bool):
        raise ValueError(f"{where}: home_first must be true or false, got {home_first!r}")
    home = [s.name for s in items].index(home_name)
    return StrategySet(items=tuple(items), home=home, home_first=home_first)


def load_strategies(path: str | Path, *, model: ModelSpec, world_size: int, flag: str = "--hetu-hotspa"
                    ) -> StrategySet:
    """Read ``--hetu-hotspa FILE`` (or ``--hetu-strategies FILE``: ``flag``); ValueError (one line) naming the
    file and what is wrong."""
    path = Path(path)
    data = read_yaml(path, flag)
    return strategies_from_dict(data, model=model, world_size=world_size, where=f"{flag} {str(path)!r}",
                                base=path.parent)
