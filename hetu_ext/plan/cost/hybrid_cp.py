"""Megatron-core's hybrid context parallelism priced by the planners' cost (pure): the baseline a Megatron-LM user
gets for variable-length data with ``--hybrid-context-parallel`` and ``--max-seqlen-per-dp-cp-rank N``.

Megatron-core 0.16's ``BalancedCPScheduler`` (``megatron/core/pipeline_parallel/hybrid_cp_schedule.py``) gives
each sequence of ``s`` tokens a CP size, ``s / N`` rounded up to a power of two (:func:`cp_size`), weighs it by
``s^2 / cp``, and forms *groups*: in each, every one of the DP x CP ranks (all ranks over TP; no pipeline
parallelism) runs a list of sub-samples, each sequence on ``cp`` consecutive ranks, balanced by that weight;
groups run one after another. The benchmarks run Megatron's own scheduler to form the groups
(``benchmarks/hybrid_cp.py``); this module prices what it returns with the layer cost the planners use
(:func:`~hetu_ext.plan.core.replicas.cp_cost`: ``1 / cp`` of a sequence's work, the K/V exchange exposed): a
group takes its slowest rank's time, each sub-sample one microbatch (its own ``c``), and the step the groups'
sum (the gradient reduction is the caller's, as for the static strategies)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from hetu_ext.data.cost import LengthCost
from hetu_ext.model.spec import ModelSpec
from hetu_ext.plan.core.replicas import CP_LINK_BYTES_PER_S, cp_cost


def cp_size(seq_len: int, max_seqlen_per_rank: int) -> int:
    """Megatron's rule: the CP size of a sequence of ``seq_len`` tokens, ``seq_len / max_seqlen_per_rank``
    rounded up to a power of two (at least 1)."""
    if max_seqlen_per_rank < 1 or seq_len < 1:
        raise ValueError(f"hybrid CP: seq_len {seq_len} and max_seqlen_per_rank {max_seqlen_per_rank} must be "
                         ">= 1")
    return max(1, 2 ** math.ceil(math.log2(seq_len / max_seqlen_per_rank)))


def group_cp_sizes(sample_ids: Sequence[Sequence[int]]) -> dict[int, int]:
    """Sample id -> how many ranks of a group hold it (its CP size as scheduled: Megatron widens a sample's CP
    group to fill idle ranks), from the scheduler's per-rank sample ids."""
    out: dict[int, int] = {}
    for ids in sample_ids:
        for i in ids:
            out[i] = out.get(i, 0) + 1
    return out


def node_links(*, tp: int, gpus_per_node: int, intra_bytes_per_s: float,
               inter_bytes_per_s: float) -> Callable[[int], float]:
    """CP size -> the link its K/V exchange runs on, by LobRA's pool's rule (``hetu_ext.plan.lobra.pool``): a CP
    group of ``tp x cp`` GPUs within a node uses the intra-node link, a wider one the inter-node link (Megatron's
    scheduler puts a sub-sample on ``cp`` consecutive DP x CP ranks)."""
    return lambda cp: intra_bytes_per_s if tp * cp <= gpus_per_node else inter_bytes_per_s


def group_seconds(lengths: Sequence[Sequence[int]], sample_ids: Sequence[Sequence[int]], layer: LengthCost,
                  model: ModelSpec, *, tp: int, num_layers: int, link_bytes_per_s: float = CP_LINK_BYTES_PER_S,
                  link_for_cp: Callable[[int], float] | None = None) -> float:
    """Seconds of one group: per rank, the sum over its sub-samples (``lengths[r][k]`` tokens, sample
    ``sample_ids[r][k]``) of one microbatch of that sequence on its CP size; the slowest rank's.
    ``link_for_cp``: the link per CP size (:func:`node_links`) instead of one ``link_bytes_per_s`` for all."""
    sizes = group_cp_sizes(sample_ids)
    worst = 0.0
    for lens, ids in zip(lengths, sample_ids):
        total = 0.0
        for s, i in zip(lens, ids):
            link = link_for_cp(sizes[i]) if link_for_cp is not None else link_bytes_per_s
            cost = cp_cost(layer, model, tp=tp, cp=sizes[i], link_bytes_per_s=link)
            total += cost.times_layers(num_layers).microbatch_s([s])
        worst = max(worst, total)
    return worst


def step_seconds(groups: Sequence[tuple[Sequence[Sequence[int]], Sequence[Sequence[int]]]], layer: LengthCost,
                 model: ModelSpec, *, tp: int, num_layers: int, link_bytes_per_s: float = CP_LINK_BYTES_PER_S,
                 link_for_cp: Callable[[int], float] | None = None) -> float:
    """Seconds of a step's groups ``(lengths per rank, sample ids per rank)``, one after another."""
    return sum(group_seconds(lens, ids, layer, model, tp=tp, num_layers=num_layers,
                             link_bytes_per_s=link_bytes_per_s, link_for_cp=link_for_cp) for lens, ids in groups)


def fits(seq_len: int, max_seqlen_per_rank: int, capacity: int, ranks: int) -> bool:
    """Whether a sequence can run: its CP size fits the DP x CP ranks and its tokens per rank fit the
    ``capacity`` (tokens of one rank's microbatch, the memory bound at CP 1)."""
    c = cp_size(seq_len, max_seqlen_per_rank)
    return c <= ranks and math.ceil(seq_len / c) <= capacity
