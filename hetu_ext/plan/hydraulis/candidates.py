"""Hydraulis's candidate strategies (pure): the dynamic program's solutions for every longest bucket (and for
sampled global batches), laid out as plans, the home first (the package docstring, step 4)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from hetu_ext.data.cost import CostTable
from hetu_ext.data.lengths import split_long
from hetu_ext.model.spec import ModelSpec
from hetu_ext.plan.core.plan import Plan, PlanError, uniform_plan, validate_plan
from hetu_ext.plan.core.replicas import ReplicaShape
from hetu_ext.plan.core.strategies import Strategy, StrategySet
from hetu_ext.plan.lobra import Deployment, deployment_plan
from hetu_ext.plan.hydraulis.dynamic_program import group_cost, length_histogram, shape_pool, solve


def shapes_name(counts: Sequence[tuple[ReplicaShape, int]]) -> str:
    """``2xTP8PP1+4xTP2PP1`` (``TP2PP1CP4`` for a CP shape): replicas per shape, larger TP first."""
    return "+".join(f"{n}x{s.name}" for s, n in sorted(counts, key=lambda x: (-x[0].tp, -x[0].pp, -x[0].cp)) if n)


def shapes_plan(counts: Sequence[tuple[ReplicaShape, int]], *, model: ModelSpec, world_size: int,
                gpus_per_node: int) -> Plan:
    """The replicas as a Plan over ``world_size`` ranks (hetu_ext.plan.lobra.deployment_plan's layout: larger TP
    first, TP groups inside nodes, layers split evenly), ranks left over unused; PlanError if it does not fit."""
    plan = deployment_plan(Deployment(counts=tuple(counts), step_s=0.0), num_layers=model.num_layers,
                           gpus_per_node=gpus_per_node)
    used = set(plan.used_ranks)
    if max(used) >= world_size:
        raise PlanError(f"the replicas {shapes_name(counts)} need ranks up to {max(used)} with TP groups inside "
                        f"nodes of {gpus_per_node}; more than the world size {world_size}")
    plan = Plan(pipelines=plan.pipelines, unused_ranks=tuple(r for r in range(world_size) if r not in used))
    validate_plan(plan, model, world_size)
    return plan


def candidate_strategies(model: ModelSpec, world_size: int, cost: CostTable, lengths: Sequence[int], *,
                         max_len: int, gpus_per_node: int = 8, slowdowns: Mapping[int, float] | None = None,
                         limit: int = 8, batch_tokens: int | None = None, buckets: int = 32,
                         sampled_batches: int = 0, seed: int = 0, cp_degrees: tuple[int, ...] = (1,)) -> StrategySet:
    """Hydraulis's candidate plans for ``lengths`` (a sample of the data's sequence lengths, e.g. a length
    file's; split at ``max_len``) on ``world_size`` GPUs: module docstring, steps 1-4. Each Strategy's
    ``max_len`` is its largest replica's capacity; the home (``StrategySet.home``) is the homogeneous plan that
    holds ``max_len`` at the lowest predicted time on the histogram. At most ``limit`` strategies (home
    included). ``batch_tokens``: tokens per global batch (the histogram's scale; default: ``lengths`` is one
    batch). ``slowdowns`` (rank -> factor): every shape is priced at the largest factor (conservative; the
    Selector prices each plan on its own ranks). ``sampled_batches`` (with ``batch_tokens``): also the program's
    plan for each of that many global batches drawn from ``lengths`` (seeded by ``seed``; plans fitted to one
    step's mix rather than the whole file's), after the others, within ``limit``. ValueError (one line) when
    nothing fits. ``cp_degrees``: CP shapes in the pool (:func:`shape_pool`); the home is CP-free (it holds the
    optimizer, through the switching layer, which does not run CP yet)."""
    if world_size < 1 or max_len < 1 or limit < 1:
        raise ValueError(f"Hydraulis: world_size, max_len and limit must be >= 1, got {world_size}, {max_len}, "
                         f"{limit}")
    if max_len > model.seq_length:
        raise ValueError(f"Hydraulis: max_len {max_len} exceeds the model's seq_length {model.seq_length}; raise "
                         "--seq-length or lower the max length")
    pool = shape_pool(model, cost, world_size=world_size, max_len=max_len, gpus_per_node=gpus_per_node,
                      slowdowns=slowdowns, cp_degrees=cp_degrees)
    if not pool:
        raise ValueError(f"Hydraulis: no TP x PP replica of at most {world_size} GPUs holds one token in "
                         f"{cost.device_memory_bytes} bytes per GPU; use more GPUs or GPUs with more memory")
    hist = length_histogram(lengths, max_len=max_len, edges=[s.capacity for s in pool], buckets=buckets,
                            batch_tokens=batch_tokens)
    longest = float(hist.longest[-1])
    homes = [k for k, s in enumerate(pool) if s.capacity >= max_len and world_size % s.gpus == 0 and s.cp == 1]
    if not homes:
        raise ValueError(f"Hydraulis: no homogeneous TP x PP x DP over {world_size} GPUs holds max_len {max_len} "
                         f"tokens (the largest capacity is {max(s.capacity for s in pool)}); use more GPUs, GPUs "
                         "with more memory, or a shorter max length")
    total = (float(hist.squares.sum()), float(hist.tokens.sum()))
    home_k = min(homes, key=lambda k: (float(group_cost(pool[k], *total, longest, world_size // pool[k].gpus)), k))
    found: list[tuple[int, dict[int, int]]] = []  # (largest bucket it answers, replicas per shape)
    for j, sol in enumerate(solve(pool, hist, world_size)):
        if sol is None:
            continue
        counts = sol.counts(pool)
        for entry in found:
            if entry[1] == counts:
                found.remove(entry)
                break
        found.append((j, counts))
    home_counts = {home_k: world_size // pool[home_k].gpus}
    by_bucket = [c for _, c in sorted(found, key=lambda e: -e[0]) if c != home_counts]
    chosen = [home_counts] + by_bucket[:1]  # the home, the program's plan for the whole histogram
    if sampled_batches and batch_tokens:  # the program on single global batches drawn from the lengths: plans
        pieces = split_long(np.asarray(lengths, dtype=np.int64).reshape(-1), max_len).length  # fitted to a step
        for batch in sample_batches(pieces, tokens=batch_tokens, count=sampled_batches, seed=seed):
            step = length_histogram(batch, max_len=max_len, edges=[s.capacity for s in pool], buckets=buckets)
            sol = solve(pool, step, world_size)[-1]
            if sol is not None and sol.counts(pool) not in chosen:
                chosen.append(sol.counts(pool))
    # then mixes next to those (a step's longest sequences may need a replica more or fewer), then the program's
    # plans for the histogram without its longest buckets (steps without their longest sequences), until `limit`
    chosen += [c for c in _neighbours(chosen, pool) if c not in chosen]
    chosen += [c for c in by_bucket[1:] if c not in chosen]
    items, home_name = [], None
    for counts in chosen:
        if len(items) >= limit:
            break
        pairs = [(pool[k], n) for k, n in sorted(counts.items())]
        name = shapes_name(pairs)
        cap = max(s.capacity for s, _ in pairs)
        if counts is home_counts:
            s = pool[home_k]
            plan = uniform_plan(world_size=world_size, tp=s.tp, pp=s.pp, cp=s.cp, num_layers=model.num_layers,
                                num_microbatches=world_size // s.gpus)
            home_name = name
        else:
            try:
                plan = shapes_plan(pairs, model=model, world_size=world_size, gpus_per_node=gpus_per_node)
            except PlanError:
                continue
        items.append(Strategy(name=name, plan=plan, max_len=cap))
    items.sort(key=lambda s: (s.max_len, s.name))
    return StrategySet(items=tuple(items), home=[s.name for s in items].index(home_name))


def _neighbours(chosen: list[dict[int, int]], pool: Sequence[ReplicaShape], steps: Sequence[int] = (1, -1, 2, 3)
                ) -> list[dict[int, int]]:
    """Mixes next to the program's: ``step`` more replicas of one of a mix's shapes, the GPUs taken from another
    with fewer GPUs per replica (negative: the other way), larger shapes first. A step's few longest sequences
    decide how many replicas of the shapes that hold them it needs, and a histogram's program can miss by one or
    two: on held-out code lengths (7B, 64 GPUs, 16K) 17 TP 2 replicas beside TP 1 ones packed a batch in 9.36 s,
    18 in 8.81 s. All +1 steps first, then -1, +2, ...; mixes that do not fit are left out."""
    out: list[dict[int, int]] = []
    for step in steps:
        for counts in chosen:
            shapes = sorted(counts, key=lambda k: (-pool[k].gpus, -pool[k].capacity))
            for i, big in enumerate(shapes):
                for small in shapes[i + 1:]:
                    moved = step * pool[big].gpus
                    if pool[small].gpus >= pool[big].gpus or moved % pool[small].gpus:
                        continue
                    new = dict(counts)
                    new[big] += step
                    new[small] -= moved // pool[small].gpus
                    if new[big] < 0 or new[small] < 0:
                        continue
                    new = {k: n for k, n in new.items() if n}
                    if new and new not in out:
                        out.append(new)
    return out


def sample_batches(lengths: np.ndarray, *, tokens: int, count: int, seed: int) -> list[list[int]]:
    """``count`` global batches: lengths drawn in a seeded random order until ``tokens`` tokens (at least one)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        order = rng.permutation(lengths.size)
        cum = np.cumsum(lengths[order])
        out.append(lengths[order[:int(np.searchsorted(cum, tokens)) + 1]].tolist())
    return out
