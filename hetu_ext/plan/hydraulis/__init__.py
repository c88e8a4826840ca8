"""Hydraulis, part 2: heterogeneous parallel strategies chosen per step (pure: numpy, no torch).

Candidates are :class:`hetu_ext.plan.core.strategies.StrategySet` (each a plan over the same ranks and the longest sequence
it takes; the home holds the optimizer). Every step trains under one of them, switched to and from the home's
layout by hetu_ext.megatron.switching (one length group per step).

**Candidate strategies** (:func:`candidate_strategies`), as Hydraulis proposes them offline:

1. *Pool*: every replica shape TP x PP (TP a degree of the cost table, at most the GPUs per node, dividing the
   heads, the MLP width and the padded vocabulary; PP dividing the layers) with its
   :class:`~hetu_ext.data.packing.ReplicaSpec` from the cost table's memory model (``replica_specs``: the
   capacity is the longest microbatch its first stage holds with 1F1B's ``pp`` microbatches in flight, at most
   ``max_len``). A shape is dropped when another one of no more GPUs, no more stages, no smaller capacity and no
   larger a, b, c prices every group at most as high (it could replace it in any solution).
2. *Histogram*: the lengths (split at ``max_len``) in buckets whose edges are the pool's capacities and
   quantiles of the lengths; per bucket the count, tokens, squared tokens and the longest length. With
   ``batch_tokens`` the counts are scaled to one global batch of that many tokens.
3. *Dynamic program* over (GPUs, longest sequence): ``T[n][j]`` is the least time in which at most ``n`` GPUs
   train every sequence of buckets ``1..j``, the buckets cut into contiguous groups, each group trained by ``d``
   replicas of one shape that holds its longest sequence, the groups side by side (the slowest sets the time)::

       T[n][j] = min( T[n-1][j],  min over i < j, shape k holding bucket j, d >= 1 with d g_k <= n of
                      max(T[n - d g_k][i], cost_k(i, j, d)) )
       cost_k(i, j, d) = (a Q + b S) / d + c max(1, ceil(S / (d cap_k))) + (pp_k - 1)(a m^2 + b m + c)

   with ``Q`` / ``S`` the group's squared / plain tokens, ``m`` its longest sequence and (a, b, c) the shape's
   slowest stage: the work spread over the replicas, a microbatch overhead per pack, the pipeline's fill and
   drain of its longest microbatch. Vectorised over (i, n); O(B^2 K D) for B buckets, K shapes, D replicas.
4. *Candidates*: for every bucket ``j`` that may hold a step's longest sequence, the solution ``T[N][j]``
   (Hydraulis's candidate for that longest sequence), laid out as a :class:`~hetu_ext.plan.core.plan.Plan` (larger
   TP first, TP groups inside nodes; ranks left over are unused); duplicates dropped; the home first: the
   homogeneous plan (Megatron's grid of the shape that holds ``max_len`` at the lowest ``cost_k`` on the whole
   histogram), then the others, those answering the longest buckets first, ``limit`` in all.

**Per-step selection** (:func:`select_candidate`): among the candidates that hold the step's longest sequence,
the lowest predicted step time (the two-stage packer, exact) plus the switch from the home, priced exactly in
order of the certified lower bound; once one is priced, another is packed only if a second test
(hetu_ext.data.packing_bound.may_fit_within: where the long documents may go) leaves it a chance to beat it.
"""

from __future__ import annotations

from hetu_ext.plan.hydraulis.flops import flops_cost_table, sync_seconds
from hetu_ext.plan.hydraulis.dynamic_program import (
    MAX_PP, shape_pool, Histogram, length_histogram, group_cost, Solution, solve
)
from hetu_ext.plan.hydraulis.candidates import shapes_name, shapes_plan, candidate_strategies, sample_batches
from hetu_ext.plan.hydraulis.selection import select_candidate, Selector
from hetu_ext.plan.hydraulis.bound import one_plan_bound_s, switch_floors_s
from hetu_ext.plan.hydraulis.strategies_file import replicas_of, strategies_yaml
from hetu_ext.plan.hydraulis.report import candidates_report

__all__ = [
    "flops_cost_table", "sync_seconds", "MAX_PP", "shape_pool", "Histogram", "length_histogram", "group_cost",
    "Solution", "solve", "shapes_name", "shapes_plan", "candidate_strategies", "sample_batches", "select_candidate",
    "Selector", "one_plan_bound_s", "switch_floors_s", "replicas_of", "strategies_yaml", "candidates_report",
]
