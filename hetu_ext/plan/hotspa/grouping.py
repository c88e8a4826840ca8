"""HotSPa's grouping of a step's sequences (pure): the fixed rule (each sequence to the smallest strategy taking
it), the order groups run in, and ``auto``'s dynamic program over split points with its exact refinements."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from hetu_ext.plan.core.strategies import StrategySet


@dataclass(frozen=True)
class Group:
    """Sequences (indices into the step's lengths) trained under one strategy."""

    strategy: int
    indices: tuple[int, ...]
    predicted_s: float = 0.0
    """The packer's predicted time of this group under its strategy (slowest pipeline)."""


def check_capacity(lengths: Sequence[int], strategies: StrategySet) -> None:
    longest = max(lengths, default=0)
    if longest > strategies.capacity:
        raise ValueError(f"HotSPa: a sequence of {longest} tokens is longer than every strategy takes (the largest "
                         f"capacity is {strategies.capacity} tokens); add a strategy with max_len >= {longest} or "
                         "split documents at that length")


def fixed_groups(lengths: Sequence[int], strategies: StrategySet) -> list[Group]:
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


def run_order(groups: list[Group], strategies: StrategySet) -> list[Group]:
    """Groups in running order: the home's first (or last, ``home_first: false``), the others shortest first."""
    home = [g for g in groups if g.strategy == strategies.home]
    others = sorted((g for g in groups if g.strategy != strategies.home), key=lambda g: g.strategy)
    return home + others if strategies.home_first else others + home


def auto_groups(lengths: Sequence[int], strategies: StrategySet, group_s: Callable[[int, list[int]], float],
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

    def __init__(self, s: np.ndarray, strategies: StrategySet, exact, switch_s) -> None:
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


def _exact_total(groups: list[Group], s: np.ndarray, strategies: StrategySet, exact, switch_s) -> float:
    return sum(exact(g.strategy, [int(s[i]) for i in g.indices])
               + (0.0 if g.strategy == strategies.home else switch_s[g.strategy]) for g in groups)


def _move_exactly(groups: list[Group], s: np.ndarray, strategies: StrategySet, exact, switch_s, slowest, *,
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


def _top_up(groups: list[Group], s: np.ndarray, strategies: StrategySet, exact, switch_s, fill) -> list[Group]:
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


def _best_alone(groups: list[Group], s: np.ndarray, strategies: StrategySet, group_s, exact, switch_s, *,
                margin: float) -> list[Group]:
    """``groups`` or one strategy alone taking every sequence, whichever is exactly cheaper: the program's
    estimate can miss that a strategy other than the home trains the whole step faster even after its switch
    (e.g. a step whose longest sequence a faster shape holds). StrategySet are priced exactly only when their
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


def _merge_exactly(groups: list[Group], s: np.ndarray, strategies: StrategySet,
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
