"""LobRA's deployment search (pure): the enumeration, scored by the capacity bound and evaluated exactly, its
mixes and exchanges, and a deployment laid out as a plan (the package docstring, steps 2-3)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hetu_ext.data.packing import ReplicaSpec
from hetu_ext.plan.core.plan import Pipeline, Plan, Stage
from hetu_ext.plan.core.replicas import ReplicaShape
from hetu_ext.plan.lobra.bounds import SortedLengths
from hetu_ext.plan.lobra.search import rank_fillings
from hetu_ext.plan.lobra.step_time import joint_time_s


@dataclass(frozen=True)
class Deployment:
    """Replicas per strategy, and the predicted mean step time of the tenants' batches on them."""

    counts: tuple[tuple[ReplicaShape, int], ...]
    step_s: float

    @property
    def gpus(self) -> int:
        return sum(s.gpus * n for s, n in self.counts)

    def describe(self) -> str:
        return " + ".join(f"{n} x {s.name}" for s, n in self.counts if n)

    def replicas(self) -> list[ReplicaSpec]:
        return [s.replica for s, n in self.counts for _ in range(n)]


def plan_deployment(pool: list[ReplicaShape], batches: list[list[np.ndarray]], *, world_size: int, max_len: int,
                    keep: int = 8, exchange_rounds: int = 16) -> Deployment:
    """The deployment minimising the mean step time of ``batches`` (module docstring, steps 2-3): every filling
    scored by :func:`capacity_bound_s` summed over the steps, the ``keep`` best (and every one-strategy filling)
    evaluated with the two-stage assignment (found by branch and bound, the same fillings in the same order as
    scoring every one: :func:`hetu_ext.plan.lobra.search.rank_fillings`), and the best mix of every two strategies
    (:func:`_two_strategy_mixes`); then the best is improved by trading one strategy's replicas for
    another's while that lowers the exact mean step time (:func:`_exchange`, at most ``exchange_rounds``
    trades)."""
    steps = [np.concatenate(step) for step in batches]
    longest = max(int(step.max()) for step in steps)
    candidates = rank_fillings(pool, [SortedLengths.of(step) for step in steps], world_size=world_size,
                               longest=longest, keep=keep).candidates
    if not candidates:
        raise ValueError(f"no deployment of {world_size} GPUs holds the longest sequence ({longest} tokens); "
                         "use more GPUs, GPUs with more memory, or a shorter max length")
    best = None
    for chosen in candidates:
        replicas = [s.replica for s, n in chosen for _ in range(n)]
        step = float(np.mean([joint_time_s(b, replicas) for b in steps]))
        if best is None or step < best.step_s:
            best = Deployment(counts=chosen, step_s=step)
    best = min([best, *_two_strategy_mixes(pool, steps, world_size=world_size, longest=longest)],
               key=lambda d: d.step_s)
    return _exchange(best, pool, steps, world_size=world_size, longest=longest, rounds=exchange_rounds)


def _two_strategy_mixes(pool: list[ReplicaShape], steps: list[np.ndarray], *, world_size: int, longest: int
                        ) -> list[Deployment]:
    """Per pair of strategies (a, b), the best of the deployments of n replicas of b and the rest of the GPUs in
    a's, priced exactly on a coarse grid of n (about 9 points) and then every n within one grid step of its best
    (the mean step time is not monotone in n: a few larger replicas only help once they hold every long
    sequence)."""
    out = []
    smallest = min(s.gpus for s in pool)  # as fillings: fewer idle GPUs than the smallest strategy needs

    def price(counts) -> float:
        replicas = [s.replica for s, n in counts for _ in range(n)]
        return float(np.mean([joint_time_s(b, replicas) for b in steps]))

    for a in pool:
        for b in pool:
            if b.gpus <= a.gpus or b is a:
                continue
            top = world_size // b.gpus

            def mix(n: int):
                counts = ((a, (world_size - n * b.gpus) // a.gpus), (b, n))
                counts = tuple((s, k) for s, k in counts if k)
                idle = world_size - sum(s.gpus * k for s, k in counts)
                return counts if counts and idle < smallest and max(s.capacity for s, _ in counts) >= longest \
                    else None

            stride = max(1, top // 8)
            priced: dict[int, float] = {}
            for n in range(0, top + 1, stride):
                if mix(n) is not None:
                    priced[n] = price(mix(n))
            if not priced:
                continue
            centre = min(priced, key=priced.get)
            for n in range(max(0, centre - stride + 1), min(top, centre + stride - 1) + 1):
                if n not in priced and mix(n) is not None:
                    priced[n] = price(mix(n))
            n = min(priced, key=lambda k: (priced[k], k))
            out.append(Deployment(counts=mix(n), step_s=priced[n]))
    return out


def _exchange(best: Deployment, pool: list[ReplicaShape], steps: list[np.ndarray], *, world_size: int, longest: int,
              rounds: int) -> Deployment:
    """Local search from ``best``: trade the GPUs of 1, 2, 4, ... replicas of a strategy for replicas of another
    (as many as those GPUs make, or back), keep the best trade priced exactly, while one lowers the mean step time
    (at most ``rounds`` trades; each trade keeps the GPUs used and a replica holding the longest sequence)."""
    evaluated: dict[tuple[int, ...], float] = {}

    def price(counts: tuple[int, ...]) -> float:
        if counts not in evaluated:
            replicas = [s.replica for s, n in zip(pool, counts) for _ in range(n)]
            evaluated[counts] = float(np.mean([joint_time_s(b, replicas) for b in steps]))
        return evaluated[counts]

    index = {id(s): k for k, s in enumerate(pool)}
    current = [0] * len(pool)
    for s, n in best.counts:
        current[index[id(s)]] = n
    now = tuple(current)
    evaluated[now] = best.step_s
    for _ in range(rounds):
        trades = []
        for i, big in enumerate(pool):
            for j, small in enumerate(pool):
                if i == j or big.gpus % small.gpus or big.gpus < small.gpus:
                    continue
                k = big.gpus // small.gpus
                step = 1
                while step * big.gpus <= world_size:
                    up, down = list(now), list(now)  # small -> big, big -> small, ``step`` big replicas' worth
                    up[j] -= k * step
                    up[i] += step
                    down[i] -= step
                    down[j] += k * step
                    trades += [tuple(up), tuple(down)]
                    step *= 2
        trades = [t for t in trades if min(t) >= 0 and sum(n * s.gpus for n, s in zip(t, pool)) <= world_size
                  and max(s.capacity for n, s in zip(t, pool) if n) >= longest]
        if not trades:
            break
        nxt = min(trades, key=lambda t: (price(t), t))
        if price(nxt) >= price(now):
            break
        now = nxt
    if now == tuple(current):
        return best
    return Deployment(counts=tuple((s, n) for s, n in zip(pool, now) if n), step_s=price(now))


def deployment_plan(deployment: Deployment, *, num_layers: int, gpus_per_node: int) -> Plan:
    """The deployment as a Plan: larger strategies first so that TP groups stay inside nodes; layers split evenly
    over each pipeline's stages; one microbatch (packed runs choose their count per step)."""
    pipelines, rank = [], 0
    for strategy, n in sorted(deployment.counts, key=lambda item: (-item[0].tp, -item[0].cp)):
        per = num_layers // strategy.pp
        width = strategy.tp * strategy.cp  # a stage: cp TP groups, side by side
        for _ in range(n):
            stages = []
            for p in range(strategy.pp):
                if rank % gpus_per_node + min(width, gpus_per_node) > gpus_per_node:
                    rank += gpus_per_node - rank % gpus_per_node  # not across a node boundary (never with powers of 2)
                stages.append(Stage(ranks=tuple(range(rank, rank + width)), layer_start=p * per,
                                    layer_stop=(p + 1) * per, has_embedding=p == 0, has_output=p == strategy.pp - 1,
                                    cp=strategy.cp))
                rank += width
            pipelines.append(Pipeline(stages=tuple(stages), num_microbatches=1))
    return Plan(pipelines=tuple(pipelines))
