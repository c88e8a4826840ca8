"""Step times of LobRA's deployments and of its baselines (pure): the two-stage assignment over heterogeneous
replicas, Megatron-style packs on homogeneous replicas, and the tenants one after another."""

from __future__ import annotations

import dataclasses

import numpy as np

from hetu_ext.data.lengths import concat_split
from hetu_ext.data.packing import ReplicaSpec, assign
from hetu_ext.plan.core.replicas import ReplicaShape


def joint_time_s(lengths: np.ndarray, replicas: list[ReplicaSpec]) -> float:
    """LobRA's step: the two-stage assignment of the whole batch over the replicas; the slowest replica's time."""
    return max(assign(lengths.tolist(), replicas, method="hetu").predicted_s)


def megatron_time_s(lengths: np.ndarray, replicas: list[ReplicaSpec], max_len: int, *, causal: bool) -> float:
    """Megatron-style step: sequences end to end cut every ``max_len`` tokens, packs dealt to replicas in equal
    runs; each piece attends to itself, or (``causal``) each pack attends over its whole length."""
    pieces = concat_split(lengths, max_len)
    if causal:
        total = int(pieces.length.sum())
        units = [max_len] * (total // max_len) + ([total % max_len] if total % max_len else [])
    else:
        units = pieces.length.tolist()
    return max(assign(units, replicas, method="megatron").predicted_s)


def smallest_holding(pool: list[ReplicaShape], length: int) -> ReplicaShape:
    """The strategy of fewest GPUs holding ``length`` tokens (ties: the fastest per token)."""
    fits = [s for s in pool if s.capacity >= length]
    if not fits:
        raise ValueError(f"no strategy holds a {length}-token sequence (largest capacity "
                         f"{max(s.capacity for s in pool)} tokens); lower the max length or use GPUs with more memory")
    return min(fits, key=lambda s: (s.gpus, s.replica.stage_costs[0].b * s.gpus))


def homogeneous_s(pool, batches, *, world_size: int, max_len: int, packing: str = "concat"
                  ) -> tuple[ReplicaShape, float]:
    """Mean step seconds of world_size // g replicas of the smallest strategy holding ``max_len``, with
    Megatron-style packs of ``max_len`` tokens (``concat``, ``concat-causal``) or LobRA's dispatch (``hetu``)."""
    strategy = smallest_holding(pool, max_len)
    if packing == "hetu":
        replicas = [strategy.replica] * (world_size // strategy.gpus)
        return strategy, float(np.mean([joint_time_s(np.concatenate(step), replicas) for step in batches]))
    replicas = [dataclasses.replace(strategy.replica, token_capacity=max_len)] * (world_size // strategy.gpus)
    times = [megatron_time_s(np.concatenate(step), replicas, max_len, causal=packing == "concat-causal")
             for step in batches]
    return strategy, float(np.mean(times))


def sequential_s(pool, batches, *, world_size: int, max_len: int) -> float:
    """Mean step seconds of the tenants trained one after another, each on all GPUs with the smallest strategy
    holding its own longest sequence and Megatron-style packs of that length."""
    total = 0.0
    for k in range(len(batches[0])):
        longest = min(max(int(step[k].max()) for step in batches), max_len)
        strategy = smallest_holding(pool, longest)
        replicas = [dataclasses.replace(strategy.replica, token_capacity=longest)] * (world_size // strategy.gpus)
        total += float(np.mean([megatron_time_s(step[k], replicas, longest, causal=False) for step in batches]))
    return total
