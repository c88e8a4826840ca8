"""HotSPa: which parallel strategy trains which sequences of a step (pure: numpy and PyYAML, no torch).

A step's global batch is split by length into groups; each group trains under its own strategy (a plan over the
same ranks), one group after another, and one strategy, the *home*, holds the optimizer (HotSPa, SOSP'24). This
module decides the groups; hetu_ext.megatron.switching runs them.

Strategies come from a YAML file (``--hetu-hotspa FILE``)::

    home: long            # the strategy holding the optimizer (default: the one taking the longest sequences)
    home_first: true      # run the home's group first (default) or last
    strategies:
      - name: short
        dp: 2             # a uniform TP x PP x DP shape (tp, pp default 1; dp default: the ranks left) ...
        max_len: 256      # ... and the longest sequence it takes (tokens)
      - name: long
        plan: plans/long.yaml   # ... or a plan file (a path relative to this file)
        max_len: 1024

or from ``auto``: every uniform TP x PP x DP shape over the world whose memory (the cost table's model) holds at
least one pack, grouped by :func:`auto_groups`: a dynamic program over split points of the step's sorted lengths
that minimises the sum over groups of the packer's predicted time plus the predicted switch time.

Fixed grouping: every sequence goes to the strategy with the smallest ``max_len`` that takes it. A group with fewer
sequences than its strategy has pipelines moves up into the next strategy (which takes longer ones, so it takes
them too); the longest group, if short of sequences, borrows the longest sequences of the groups below it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hetu_ext.data.cost import CostTable
from hetu_ext.data.packing import Assignment, ReplicaSpec, assign
from hetu_ext.data.packing_bound import lower_bound_s
from hetu_ext.keys import check_keys, read_yaml
from hetu_ext.model import inventory
from hetu_ext.model.spec import ModelSpec

from hetu_ext.plan.hotspa.relaxation import relaxation
from hetu_ext.plan.core.io import load_plan
from hetu_ext.plan.core.plan import Plan, PlanError, uniform_plan, validate_plan
from hetu_ext.plan.core.replicas import replica_specs

_FILE_KEYS = {"home", "home_first", "strategies"}
_STRATEGY_KEYS = {"name", "plan", "tp", "pp", "dp", "max_len"}


@dataclass(frozen=True)
class Strategy:
    name: str
    plan: Plan
    max_len: int
    """The longest sequence (tokens) this strategy takes."""


@dataclass(frozen=True)
class Strategies:
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
                         base: Path = Path(".")) -> Strategies:
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
    return Strategies(items=tuple(items), home=home, home_first=home_first)


def load_strategies(path: str | Path, *, model: ModelSpec, world_size: int, flag: str = "--hetu-hotspa"
                    ) -> Strategies:
    """Read ``--hetu-hotspa FILE`` (or ``--hetu-strategies FILE``: ``flag``); ValueError (one line) naming the
    file and what is wrong."""
    path = Path(path)
    data = read_yaml(path, flag)
    return strategies_from_dict(data, model=model, world_size=world_size, where=f"{flag} {str(path)!r}",
                                base=path.parent)


def auto_strategies(model: ModelSpec, world_size: int, cost: CostTable, max_pp: int = 8) -> Strategies:
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
    return Strategies(items=tuple(items), home=home)


@dataclass(frozen=True)
class Group:
    """Sequences (indices into the step's lengths) trained under one strategy."""

    strategy: int
    indices: tuple[int, ...]
    predicted_s: float = 0.0
    """The packer's predicted time of this group under its strategy (slowest pipeline)."""


def check_capacity(lengths: Sequence[int], strategies: Strategies) -> None:
    longest = max(lengths, default=0)
    if longest > strategies.capacity:
        raise ValueError(f"HotSPa: a sequence of {longest} tokens is longer than every strategy takes (the largest "
                         f"capacity is {strategies.capacity} tokens); add a strategy with max_len >= {longest} or "
                         "split documents at that length")


def fixed_groups(lengths: Sequence[int], strategies: Strategies) -> list[Group]:
    """Each sequence to the smallest strategy that takes it (module docstring); groups in strategy order, empty
    ones dropped."""
    check_capacity(lengths, strategies)
    s = np.asarray(lengths, dtype=np.int64)
    caps = np.array([st.max_len for st in strategies.items])
    which = np.searchsorted(caps, s, side="left")  # first strategy with max_len >= length
    order = np.argsort(s, kind="stable")
    members = [[int(i) for i in order if which[i] == k] for k in range(len(caps))]
    pipelines = [len(st.plan.pipelines) for st in strategies.items]
    for k in range(len(members) - 1):
        if 0 < len(members[k]) < pipelines[k]:
            members[k + 1] = members[k] + members[k + 1]
            members[k] = []
    last = max((k for k, m in enumerate(members) if m), default=None)
    if last is not None and len(members[last]) < pipelines[last]:
        for k in range(last - 1, -1, -1):  # borrow the longest shorter sequences
            while members[k] and len(members[last]) < pipelines[last]:
                members[last].insert(0, members[k].pop())
        if len(members[last]) < pipelines[last]:
            raise ValueError(f"HotSPa: the step has {len(s)} sequences, fewer than the {pipelines[last]} pipelines "
                             f"of strategy {strategies.items[last].name!r}; raise the global batch")
        for k in range(last):
            if 0 < len(members[k]) < pipelines[k]:
                members[last] = members[k] + members[last]
                members[k] = []
    return [Group(strategy=k, indices=tuple(m)) for k, m in enumerate(members) if m]


def run_order(groups: list[Group], strategies: Strategies) -> list[Group]:
    """Groups in running order: the home's first (or last, ``home_first: false``), the others shortest first."""
    home = [g for g in groups if g.strategy == strategies.home]
    others = sorted((g for g in groups if g.strategy != strategies.home), key=lambda g: g.strategy)
    return home + others if strategies.home_first else others + home


def auto_groups(lengths: Sequence[int], strategies: Strategies, group_s: Callable[[int, list[int]], float],
                switch_s: Sequence[float], *, points: int = 16,
                exact: Callable[[int, list[int]], float] | None = None, alone_margin: float = 0.1,
                relaxed: Callable[[list[int], float], list[Group] | None] | None = None,
                slowest: Callable[[int, list[int]], tuple[list[int], float]] | None = None,
                fill: Callable[[int, list[int], list[int]], list[int] | None] | None = None,
                moves: int = 1000) -> list[Group]:
    """The grouping minimising ``sum over groups (group_s(strategy, lengths) + switch_s[strategy])`` (switch 0 for
    home): a dynamic program over split points of the sorted lengths (every capacity boundary and ``points``
    quantiles), each contiguous run of lengths given the strategy that takes its longest and has no more
    pipelines than sequences. ``group_s`` may be an estimate (the packer's bound); with ``exact`` (the packer)
    the program's grouping is then improved by exactly priced merges of its groups (:func:`_merge_exactly`) and
    compared with the home alone, so an estimate's error never makes a step slower than running it all under the
    home strategy; then with every strategy alone whose estimate is within ``alone_margin`` of that exact price
    (:func:`_best_alone`). ``relaxed`` (with ``exact``): a second candidate grouping of the lengths (e.g.
    :meth:`GroupPricer.relaxed`, the mixed-integer relaxation's, which is not bound to contiguous runs: it tops up
    the long sequences' pipelines with short ones; called with the lengths and the exact price to beat), taken
    when its exact price is lower. ``slowest`` (with ``exact``; e.g. :meth:`GroupPricer.slowest`): the sequences
    on a group's slowest pipeline and its excess over the mean pipeline; :func:`_move_exactly` tries moving them
    to other groups, up to ``moves`` exact prices. ``fill`` (with ``exact``; e.g. :meth:`GroupPricer.fill`): the
    grouping is then rebuilt around each group's own sequences, its pipelines topped up with other groups' ones
    (:func:`_top_up`), taken when its exact price is lower."""
    check_capacity(lengths, strategies)
    s = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(s, kind="stable")
    sorted_s = s[order]
    n = s.size
    cuts = {0, n}
    cuts.update(int(np.searchsorted(sorted_s, st.max_len, side="right")) for st in strategies.items)
    cuts.update(int(round(n * q / points)) for q in range(1, points))
    cuts = sorted(c for c in cuts if 0 <= c <= n)
    pipelines = [len(st.plan.pipelines) for st in strategies.items]
    best = {0: (0.0, [])}
    for j in cuts[1:]:
        options = []
        for i in cuts:
            if i >= j or i not in best:
                continue
            longest = int(sorted_s[j - 1])
            for k, st in enumerate(strategies.items):
                if st.max_len < longest or pipelines[k] > j - i:
                    continue
                t = group_s(k, sorted_s[i:j].tolist()) + (0.0 if k == strategies.home else switch_s[k])
                options.append((best[i][0] + t, best[i][1] + [(k, i, j, t)]))
        if options:
            best[j] = min(options, key=lambda o: o[0])
    if n not in best:
        raise ValueError(f"HotSPa auto: no grouping of the step's {n} sequences fits the strategies "
                         f"{[st.name for st in strategies.items]}; raise the global batch")
    merged: dict[int, list[int]] = {}
    for k, i, j, _ in best[n][1]:
        merged.setdefault(k, []).extend(int(x) for x in order[i:j])
    groups = [Group(strategy=k, indices=tuple(ix)) for k, ix in sorted(merged.items())]
    if exact is None:
        return groups
    if len(groups) > 1:
        groups = _merge_exactly(groups, s, strategies, exact, switch_s)
    if slowest is not None and len(groups) > 1:
        groups = _move_exactly(groups, s, strategies, exact, switch_s, slowest, budget=moves)
    if relaxed is not None:  # called with the lengths and the price to beat
        price = _exact_total(groups, s, strategies, exact, switch_s)
        other = relaxed(s.tolist(), price)
        if other and slowest is not None and len(other) > 1:
            other = _move_exactly(other, s, strategies, exact, switch_s, slowest, budget=moves)
        if other and _exact_total(other, s, strategies, exact, switch_s) < price:
            groups = other
    if fill is not None and len(groups) > 1:
        groups = _top_up(groups, s, strategies, exact, switch_s, fill)
    return _best_alone(groups, s, strategies, group_s, exact, switch_s, margin=alone_margin)


class _Prices:
    """Memoised exact price of a group (its packer time plus its switch, none for the home), keyed by strategy
    and sorted indices; ``computed`` counts the prices not found in the memo."""

    def __init__(self, s: np.ndarray, strategies: Strategies, exact, switch_s) -> None:
        self.s, self.strategies, self.exact, self.switch_s = s, strategies, exact, switch_s
        self.memo: dict[tuple[int, tuple[int, ...]], float] = {}
        self.computed = 0

    def __call__(self, strategy: int, indices: Sequence[int]) -> float:
        key = (strategy, tuple(sorted(indices)))
        if key not in self.memo:
            self.computed += 1
            self.memo[key] = self.exact(strategy, [int(self.s[i]) for i in key[1]]) + \
                (0.0 if strategy == self.strategies.home else self.switch_s[strategy])
        return self.memo[key]


def _exact_total(groups: list[Group], s: np.ndarray, strategies: Strategies, exact, switch_s) -> float:
    return sum(exact(g.strategy, [int(s[i]) for i in g.indices])
               + (0.0 if g.strategy == strategies.home else switch_s[g.strategy]) for g in groups)


def _move_exactly(groups: list[Group], s: np.ndarray, strategies: Strategies, exact, switch_s, slowest, *,
                  budget: int) -> list[Group]:
    """Local search priced by ``exact``: a sequence on a group's slowest pipeline (``slowest``; the least
    balanced group first, its sequences shortest first) moves to another group whose strategy takes it when the
    exact total falls (first such move, then again), until no move helps or ``budget`` prices are spent. The
    relaxation and the dynamic program both place a few sequences where the packer cannot fit them (e.g. 0.3 s
    more on a pipeline already at the group's pace); the moves also top up a long group's idle pipelines with
    short sequences (16 GPUs, 16K, Wikipedia: 8.82 s -> 8.61 s on one step, 1.3 s of pricing)."""
    price = _Prices(s, strategies, exact, switch_s)

    groups = list(groups)
    total = sum(price(g.strategy, g.indices) for g in groups)
    moved = True
    while moved and price.computed < budget:
        moved = False
        donors = []  # (its slowest pipeline's excess over its mean pipeline, group, members sorted, their positions)
        for a, donor in enumerate(groups):
            order = tuple(sorted(donor.indices))
            lengths = [int(s[i]) for i in order]
            members, excess = slowest(donor.strategy, lengths)
            donors.append((excess, a, order, sorted(members, key=lambda p: lengths[p])))
        for _, a, order, positions in sorted(donors, key=lambda d: -d[0]):  # the least balanced group first
            donor = groups[a]
            for pos in positions:
                i = order[pos]
                rest = tuple(x for x in order if x != i)
                if len(rest) < len(strategies.items[donor.strategy].plan.pipelines):
                    continue
                for b, taker in enumerate(groups):
                    if b == a or strategies.items[taker.strategy].max_len < s[i] or price.computed >= budget:
                        continue
                    grown = taker.indices + (i,)
                    new = total - price(donor.strategy, donor.indices) - price(taker.strategy, taker.indices) \
                        + price(donor.strategy, rest) + price(taker.strategy, grown)
                    if new < total * (1 - 1e-9):
                        groups[a] = Group(strategy=donor.strategy, indices=rest)
                        groups[b] = Group(strategy=taker.strategy, indices=grown)
                        total, moved = new, True
                        break
                if moved or price.computed >= budget:
                    break
            if moved or price.computed >= budget:
                break
    return groups


def _top_up(groups: list[Group], s: np.ndarray, strategies: Strategies, exact, switch_s, fill) -> list[Group]:
    """Rebuild around one group at a time, priced by ``exact``: the group keeps its *core* (the sequences no other
    group's strategy holds; or, as a second try, all of its own) under its strategy or any other that holds them,
    ``fill`` tops its pipelines up with the longest sequences of the other groups (and its own left out) that fit
    under its slowest pipeline's level, and what it leaves goes to the other group holding the most sequences
    that takes it. The first rebuild that lowers the exact total is kept, then the next group. The relaxation
    prices a group of long sequences as if its pipelines were filled evenly; the packer of those sequences alone
    leaves pipelines idle that shorter sequences fill for free (32 GPUs, 16K, Wikipedia: the 9 sequences TP 1
    cannot hold and 28 others under TP 2 x DP 16 instead of 65 under TP 4 x DP 8, the step 8.358 s -> 8.271 s).
    Only strategies without pipelines are filled (:meth:`GroupPricer.fill`)."""
    price = _Prices(s, strategies, exact, switch_s)
    total = sum(price(g.strategy, g.indices) for g in groups)
    for a in range(len(groups)):
        g = groups[a]
        others = [h for b, h in enumerate(groups) if b != a]
        longest_other = max(strategies.items[h.strategy].max_len for h in others)
        own = [i for i in g.indices if s[i] > longest_other]
        used = {h.strategy for h in others}
        tries = [(k, core) for k in range(len(strategies.items)) for core in (own, list(g.indices))
                 if core and strategies.items[k].max_len >= s[core].max() and k not in used]
        for k, core in tries:
            holds = strategies.items[k].max_len
            kept_core = set(core)
            spare = [i for i in g.indices if i not in kept_core]
            pool = [i for h in others for i in h.indices if s[i] <= holds] + spare
            picked = fill(k, [int(s[i]) for i in core], [int(s[i]) for i in pool])
            if picked is None:  # (its time is no sum to fill up to a level)
                continue
            taken = {pool[p] for p in picked}
            kept = [[i for i in h.indices if i not in taken] for h in others]
            for i in spare:
                if i in taken:
                    continue
                takers = [b for b, h in enumerate(others) if strategies.items[h.strategy].max_len >= s[i]]
                if not takers:
                    break
                kept[max(takers, key=lambda b: len(kept[b]))].append(i)
            else:
                rebuilt = [Group(strategy=k, indices=tuple(sorted(kept_core | taken)))]
                rebuilt += [Group(strategy=h.strategy, indices=tuple(sorted(ix))) for h, ix in zip(others, kept)]
                if all(len(r.indices) >= len(strategies.items[r.strategy].plan.pipelines) for r in rebuilt):
                    new = sum(price(r.strategy, r.indices) for r in rebuilt)
                    if new < total * (1 - 1e-9):
                        total = new
                        groups = sorted(rebuilt, key=lambda r: r.strategy)
                        break
    return groups


def _best_alone(groups: list[Group], s: np.ndarray, strategies: Strategies, group_s, exact, switch_s, *,
                margin: float) -> list[Group]:
    """``groups`` or one strategy alone taking every sequence, whichever is exactly cheaper: the program's
    estimate can miss that a strategy other than the home trains the whole step faster even after its switch
    (e.g. a step whose longest sequence a faster shape holds). Strategies are priced exactly only when their
    estimate plus switch is within ``margin`` of the best exact total so far (ties: ``groups``)."""
    def switch(k: int) -> float:
        return 0.0 if k == strategies.home else switch_s[k]

    best = _exact_total(groups, s, strategies, exact, switch_s)
    chosen = groups
    everything = s.tolist()
    order = sorted((group_s(k, everything) + switch(k), k) for k, st in enumerate(strategies.items)
                   if st.max_len >= int(s.max()) and len(st.plan.pipelines) <= s.size
                   and not (len(groups) == 1 and groups[0].strategy == k))
    for estimate, k in order:
        if estimate > best * (1 + margin):
            break
        t = exact(k, everything) + switch(k)
        if t < best:
            best, chosen = t, [Group(strategy=k, indices=tuple(range(s.size)))]
    return chosen


def _merge_exactly(groups: list[Group], s: np.ndarray, strategies: Strategies,
                   exact: Callable[[int, list[int]], float], switch_s: Sequence[float]) -> list[Group]:
    """Greedy merging priced by ``exact``: while moving one group's sequences into another group (whose strategy
    takes them) lowers the exact total, make the best such move. The dynamic program prices each group with an
    estimate that is blind to what the packer adds (a group's fill and drain on every pipeline, its packs'
    overheads), which on a few long sequences can favour a group of its own that the exact price does not; the
    home alone is also priced (it is where merging ends when the home takes every sequence)."""
    home = strategies.home
    prices = _Prices(s, strategies, exact, switch_s)

    def price(group: Group) -> float:
        return prices(group.strategy, group.indices)

    total = sum(price(g) for g in groups)
    while len(groups) > 1:
        moves = []
        for a, donor in enumerate(groups):
            longest = int(s[list(donor.indices)].max())
            for b, taker in enumerate(groups):
                if a != b and strategies.items[taker.strategy].max_len >= longest:
                    merged = Group(strategy=taker.strategy, indices=taker.indices + donor.indices)
                    rest = [g for c, g in enumerate(groups) if c not in (a, b)]
                    moves.append((sum(price(g) for g in rest) + price(merged), rest + [merged]))
        best = min(moves, key=lambda m: m[0], default=None)
        if best is None or best[0] >= total:
            break
        total, groups = best
    alone = Group(strategy=home, indices=tuple(range(s.size)))
    if strategies.items[home].max_len >= int(s.max()) and len(strategies.items[home].plan.pipelines) <= s.size \
            and price(alone) <= total:
        return [alone]
    return sorted(groups, key=lambda g: g.strategy)


PAIR_ANCHOR_LEVELS = 48
"""Thresholds of the anchor rows (row 7) in a two-strategy program of :func:`grouping_bound_s`: the whole program's
12, spread over every length any strategy holds, leave a pipelined group's longest members between two of them
(32 GPUs at 16K on Wikipedia: 5.17 s for a TP 1 x PP 8 x DP 4 group whose packer bound is 5.35 s); with two
strategies, 48 still solve in seconds."""


def grouping_bound_s(lengths: Sequence[int], strategies: Strategies, spec: ModelSpec, cost: CostTable, *,
                     fixed_s: Sequence[float] | None = None, time_limit_s: float = 120.0,
                     min_strategies: int = 1, upper_s: float | None = None, bisections: int = 3,
                     by_pairs: bool = True) -> float:
    """A lower bound on ``sum over groups (the packer's time of the group under its strategy + fixed_s[k])``
    over every grouping of ``lengths`` into groups under ``strategies`` (any split, contiguous or not; at least
    one sequence per pipeline of a group's strategy), ``fixed_s[k]`` a time every used strategy adds (its
    all-reduce, its switch; default 0): what HotSPa can reach at best under the packer's cost model. The
    mixed-integer relaxation of :mod:`hetu_ext.plan.hotspa.relaxation` (its docstring has the proof), solved by
    scipy's HiGHS; its dual bound is returned, so a time limit keeps it a bound.

    ``upper_s``: the price of a grouping already known (e.g. the best strategy alone); groupings dearer than it
    need no bound, which lets the relaxation count every pipeline's fill and drain (row 1); the result is then
    ``min(upper_s, relaxation)``, and ``bisections`` more relaxations look for a lower U still out of reach
    (``min(U, relaxation at U)`` is a bound for every U; each halves the interval, each is a HiGHS solve).
    ``min_strategies``: bound only the groupings that use at least that many strategies (2 with each strategy
    alone priced exactly apart, e.g. by the packer, gives a tighter bound on every grouping: the least of the
    two); infinity when fewer strategies hold a sequence than that.

    ``by_pairs`` (with ``upper_s`` and ``min_strategies=2``): a grouping of two strategies or more uses exactly
    two, or at least three, so the least of one program per pair of strategies (only groupings using both; a
    small program, so the anchor rows get :data:`PAIR_ANCHOR_LEVELS` thresholds) and of the whole program with at
    least three is a bound too. Each program only asks for groupings within U (none: U bounds them). Measured:
    one Wikipedia step over 32 GPUs (15 strategies, 106 programs) in about 60 s on 2 cores."""
    check_capacity(lengths, strategies)
    plans = [st.plan for st in strategies.items]
    replicas = [replica_specs(st.plan, spec, cost, max_pack_tokens=st.max_len) for st in strategies.items]
    fixed = list(fixed_s) if fixed_s is not None else [0.0] * len(plans)
    every = tuple(range(len(plans)))
    programs = [(every, min_strategies, {})]
    if by_pairs and upper_s is not None and min_strategies == 2 and len(plans) > 2:
        longest = max(lengths, default=0)
        holds = [max(r.token_capacity for r in reps) >= longest for reps in replicas]
        rows = {"anchor_levels": PAIR_ANCHOR_LEVELS, "binary": 2 * max(len(reps) for reps in replicas) + 16}
        programs = [(every, 3, {})] + [((k, q), 2, rows) for k in every for q in every[k + 1:] if holds[k] or holds[q]]

    def bound(program, upper: float | None) -> float:
        keep, least, rows = program
        return relaxation(lengths, [plans[k] for k in keep], [replicas[k] for k in keep],
                          fixed_s=[fixed[k] for k in keep], upper_s=upper, min_strategies=least,
                          time_limit_s=time_limit_s, cutoff=upper is not None and len(programs) > 1, **rows).bound_s

    try:
        values = [bound(program, upper_s) for program in programs]
    except RuntimeError:  # HiGHS bounded one program not at all within its time: the whole one, as without pairs
        programs = [(every, min_strategies, {})]
        values = [bound(programs[0], upper_s)]
    best = min(values)
    if upper_s is None or not np.isfinite(best):
        return best
    # min(U, relaxation at U) bounds every grouping for any U: bisect for the largest U every program proves out
    # of reach (one that proved the first U out of reach proved its groupings all cost U or more: no new solve)
    open_ = [p for p, v in zip(programs, values) if v < upper_s * (1 - 1e-9)]
    lo, hi = best, upper_s
    for _ in range(bisections):
        if hi - lo <= 1e-4 * hi:
            break
        mid = (lo + hi) / 2
        try:
            proven = all(bound(program, mid) >= mid * (1 - 1e-9) for program in open_)
        except RuntimeError:  # no bound within the time: not proven
            proven = False
        if proven:
            lo = best = mid
        else:
            hi = mid
    return best


# ---------------------------------------------------------------------------------------------- switch volume

def _parts(spec: ModelSpec) -> dict:
    """Elements of each part of a Megatron GPT model (local layer spec, learned positions): per layer what TP
    splits (the four weight matrices, the column-parallel biases) and what every TP rank holds whole (layernorms,
    the row-parallel biases); the word embeddings (vocab-parallel), positions, final layernorm, output layer."""
    h = spec.hidden_size
    split, replicated = inventory.layer_params_by_split(spec)
    position = spec.max_position_embeddings * h if spec.position_embedding_type == "learned_absolute" else 0
    return {"split": split, "replicated": replicated, "word": spec.padded_vocab_size * h, "position": position,
            "final_norm": inventory.final_norm_params(spec), "output": spec.padded_vocab_size * h}


def _holdings(plan: Plan, spec: ModelSpec) -> dict[int, list[tuple[tuple, float, float]]]:
    """rank -> (part, start, stop): the fraction [start, stop) of each part it holds; a part is (layer, "split" or
    "replicated") or ("word" | "position" | "final_norm" | "output",). A pipeline's last stage keeps its own
    copy of the word embeddings when they are tied to the output layer (Megatron's shared embedding)."""
    out: dict[int, list] = {}
    for pipeline in plan.pipelines:
        for stage in pipeline.stages:
            parts = [((layer, "split"), True) for layer in stage.layers] + \
                [((layer, "replicated"), False) for layer in stage.layers]
            if stage.has_embedding:
                parts += [(("word",), True), (("position",), False)]
            if stage.has_output:
                parts.append((("final_norm",), False))
                if spec.untie_embeddings_and_output_weights:
                    parts.append((("output",), True))
                elif not stage.has_embedding:
                    parts.append((("word",), True))
            for t, rank in enumerate(stage.ranks):
                out.setdefault(rank, []).extend((part, t / stage.tp, (t + 1) / stage.tp) if split else (part, 0.0, 1.0)
                                                for part, split in parts)
    return out


def switch_elements(source: Plan, target: Plan, spec: ModelSpec) -> dict[int, float]:
    """rank -> parameter elements it must receive to hold ``target``'s shards when it holds ``source``'s: what
    a switch moves per rank, the receiving side (weights one way, gradients the other are the same volume)."""
    sizes = _parts(spec)
    have, need = _holdings(source, spec), _holdings(target, spec)
    out = {}
    for rank, wanted in need.items():
        mine: dict[tuple, list[tuple[float, float]]] = {}
        for part, a, b in have.get(rank, []):
            mine.setdefault(part, []).append((a, b))
        total = 0.0
        for part, a, b in wanted:
            overlap = sum(max(0.0, min(b, d) - max(a, c)) for c, d in mine.get(part, []))
            total += (b - a - overlap) * sizes[part[-1]]
        out[rank] = total
    return out


def switch_seconds(home: Plan, target: Plan, spec: ModelSpec, *, weight_bytes: int, grad_bytes: int = 4,
                   bandwidth: float) -> float:
    """Predicted seconds of switching to ``target`` and back: the weights in (``weight_bytes`` per element) and
    the gradients out (fp32), over the slowest rank's link of ``bandwidth`` bytes/s."""
    into = switch_elements(home, target, spec)
    back = switch_elements(target, home, spec)
    ranks = set(into) | set(back)
    return max((into.get(r, 0.0) * weight_bytes + back.get(r, 0.0) * grad_bytes) / bandwidth for r in ranks)


def allreduce_seconds(plan: Plan, spec: ModelSpec, *, bandwidth: float, grad_bytes: int = 4) -> float:
    """Predicted seconds of a data-parallel gradient all-reduce under ``plan`` (ring: 2 (d-1)/d of each rank's
    gradient bytes, ``d`` the pipelines), the slowest rank's."""

    d = len(plan.pipelines)
    if d == 1:
        return 0.0
    worst = 0.0
    for stage in plan.pipelines[0].stages:
        elements = inventory.layer_params(spec, tp=stage.tp) * stage.num_layers
        if stage.has_embedding:
            elements += spec.padded_vocab_size * spec.hidden_size / stage.tp
        worst = max(worst, 2 * (d - 1) / d * elements * grad_bytes / bandwidth)
    return worst


def group_seconds(plan: Plan, spec: ModelSpec, cost: CostTable, lengths: list[int], max_len: int) -> float:
    """The packer's predicted time of these sequences under ``plan`` (the slowest pipeline, Hydraulis packing)."""
    replicas: list[ReplicaSpec] = replica_specs(plan, spec, cost, max_pack_tokens=max_len)
    if not lengths:
        return 0.0
    return max(assign(lengths, replicas, method="hetu").predicted_s)


RELAXED_NODES = 200
"""Branch-and-bound nodes the planner's relaxation may take (a node count, not a clock: the same on every rank)."""
RELAXED_TIME_LIMIT_S = 60.0
"""A backstop only: the node limit ends it first on the benchmarks' steps (up to 2,000 sequences, 20 strategies)."""


class GroupPricer:
    """Predicted seconds of a group of sequences under each strategy, with the strategies' replica specs built
    once: ``exact`` runs the packer (Hydraulis's two-stage assignment), ``estimate`` is its certified lower bound
    (hetu_ext.data.packing_bound; the packer lands within a few percent of it), cheap enough for the dynamic
    program's many candidate groups."""

    def __init__(self, strategies: Strategies, spec: ModelSpec, cost: CostTable) -> None:
        self._strategies = strategies
        self._replicas = [replica_specs(s.plan, spec, cost, max_pack_tokens=s.max_len) for s in strategies.items]
        self._packed: dict[int, tuple[list[int], Assignment]] = {}  # per strategy, exact's last lengths and packing

    def estimate(self, k: int, lengths: list[int]) -> float:
        """Identical pipelines (a uniform strategy): work spread evenly over the ``d`` pipelines, packs of the
        capacity, plus the fill and drain of one average pack (O(n)); other plans: the packer's lower bound."""
        if not lengths:
            return 0.0
        replicas = self._replicas[k]
        s = np.asarray(lengths, dtype=np.float64)
        if any(r != replicas[0] for r in replicas[1:]):
            return lower_bound_s(s.astype(np.int64), replicas)
        first, d = replicas[0], len(replicas)
        tokens, squares = float(s.sum()) / d, float((s * s).sum()) / d
        packs = max(1.0, np.ceil(tokens / first.token_capacity))
        return first.microbatch_s(squares, tokens) + first.stage_costs[0].c * (packs - 1) \
            + (first.pp - 1) * first.microbatch_s(squares / packs, tokens / packs)

    def bound(self, k: int, lengths: list[int]) -> float:
        """The packer's certified lower bound (hetu_ext.data.packing_bound): never above :meth:`exact`."""
        return lower_bound_s(np.asarray(lengths, dtype=np.int64), self._replicas[k]) if lengths else 0.0

    def relaxed(self, lengths: Sequence[int], fixed_s: Sequence[float], *, upper_s: float | None = None,
                node_limit: int = RELAXED_NODES) -> list[Group] | None:
        """The grouping of :func:`hetu_ext.plan.hotspa.relaxation.relaxation` (``fixed_s[k]``: what a used
        strategy adds; ``upper_s``: a known grouping's price), stopped after ``node_limit`` branch-and-bound nodes
        (deterministic: every rank gets the same groups), without rows 5 to 7 and the buckets' extra lines and
        sums (they tighten the bound but slow the search for a grouping: 16 GPUs at 32K, 200 nodes, 9.29 s with row
        5, 9.17 s without; with row 6 and the lines a step's grouping took up to 17.5 s; with the sums the
        Wikipedia row at 8 GPUs and 16K lost 0.6%; with row 7 a step of the 32-GPU 16K one took 13.4 s, not 9.5 s,
        for the same grouping);
        None when it found none or a group breaks HotSPa's rules (a sequence longer than its strategy takes, fewer
        sequences than pipelines)."""
        plans = [st.plan for st in self._strategies.items]
        out = relaxation(lengths, plans, self._replicas, fixed_s=fixed_s, upper_s=upper_s, node_limit=node_limit,
                         time_limit_s=RELAXED_TIME_LIMIT_S, explicit_pipelines=0, microbatch_rows=False,
                         anchor_rows=False, bucket_lines=False, bucket_sums=False, pack_rows=0)
        if not out.groups:
            return None
        groups = [Group(strategy=k, indices=tuple(sorted(ix))) for k, ix in sorted(out.groups.items())]
        for g in groups:
            st = self._strategies.items[g.strategy]
            if len(g.indices) < len(st.plan.pipelines) or max(lengths[i] for i in g.indices) > st.max_len:
                return None
        return groups

    def fill(self, k: int, core: list[int], pool: list[int]) -> list[int] | None:
        """Positions in ``pool`` (lengths) that top strategy k's pipelines up once the packer has packed ``core``:
        every pipeline, the least loaded first, takes the longest pool sequences whose time (plus ``c`` for each
        pack its tokens now need past the capacity) still fits under the slowest pipeline's level. None for
        pipelined or unlike replicas (their time is not a sum of their sequences')."""
        replicas = self._replicas[k]
        first = replicas[0]
        if first.pp != 1 or any(r != first for r in replicas[1:]):
            return None
        out = assign(core, replicas, method="hetu")
        level = max(out.predicted_s)
        cost, cap = first.stage_costs[0], first.token_capacity
        free = sorted((i for i, x in enumerate(pool) if x <= cap), key=lambda i: -pool[i])
        picked = []
        for p in np.argsort(out.predicted_s, kind="stable"):
            load = out.predicted_s[p]
            tokens = sum(core[i] for mb in out.microbatches[p] for i in mb)
            left = []
            for i in free:
                x = pool[i]
                more = cost.document_s(x) + cost.c * (-(-(tokens + x) // cap) - -(-tokens // cap))
                if load + more <= level:
                    load, tokens = load + more, tokens + x
                    picked.append(i)
                else:
                    left.append(i)
            free = left
        return picked

    def slowest(self, k: int, lengths: list[int]) -> tuple[list[int], float]:
        """Indices into ``lengths`` of the sequences on the slowest pipeline of the packer's assignment (the one
        :meth:`exact` made for these lengths, else packed again), and that pipeline's seconds over the mean
        pipeline's."""
        last = self._packed.get(k)
        if last is None or last[0] != list(lengths):
            self.exact(k, lengths)
            last = self._packed[k]
        out = last[1]
        worst = int(np.argmax(out.predicted_s))
        return [i for mb in out.microbatches[worst] for i in mb], out.predicted_s[worst] - float(
            np.mean(out.predicted_s))

    def exact(self, k: int, lengths: list[int]) -> float:
        """The packer's slowest replica (seconds); the packing is kept for :meth:`packed`."""
        if not lengths:
            return 0.0
        out = assign(lengths, self._replicas[k], method="hetu")
        self._packed[k] = (list(lengths), out)
        return max(out.predicted_s)

    def packed(self, k: int, lengths: Sequence[int], replicas: Sequence[ReplicaSpec]) -> Assignment | None:
        """The packing :meth:`exact` made for strategy k, if its last call had these lengths (in this order) and
        the pricer's replicas equal ``replicas`` (then it is what ``assign(lengths, replicas, method="hetu")``
        returns: the packer is deterministic); else None."""
        last = self._packed.get(k)
        if last is None or list(self._replicas[k]) != list(replicas) or last[0] != list(lengths):
            return None
        return last[1]
