"""Hydraulis, part 2: heterogeneous parallel strategies chosen per step (pure: numpy, no torch).

Candidates are :class:`hetu_ext.plan.hotspa.Strategies` (each a plan over the same ranks and the longest sequence
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

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from hetu_ext.data.cost import CostTable, LengthCost
from hetu_ext.plan.hotspa.relaxation import f_over_u
from hetu_ext.plan.hotspa import Strategies, Strategy, check_capacity
from hetu_ext.data.lengths import split_long
from hetu_ext.data.packing import Assignment, assign
from hetu_ext.plan.core.replicas import replica_specs
from hetu_ext.data.packing_bound import lower_bound_s, may_fit_within

from hetu_ext.model import inventory

from hetu_ext.plan.cost.stage import CostModel
from hetu_ext.plan.core.options import PLAIN, Options
from hetu_ext.plan.lobra import Deployment, deployment_plan, least_step_s
from hetu_ext.plan.lobra import Strategy as Shape
from hetu_ext.model.spec import ModelSpec
from hetu_ext.plan.core.plan import Plan, PlanError, uniform_plan, validate_plan

MAX_PP = 16
"""Deepest pipeline a pool shape may have."""


# ------------------------------------------------------------------------------------------------- cost model

def flops_cost_table(spec: ModelSpec, *, memory_bytes: float, tp_degrees: Sequence[int] = (1, 2, 4, 8),
                     cost: CostModel | None = None, options: Options = PLAIN,
                     world_size: int | None = None) -> CostTable:
    """Per-layer costs of training ``spec`` from hetu_ext.plan.cost.stage's device constants (an A100-class GPU by
    default), for the planning CLI and benchmarks when no measured table is given: per token
    3 x the inventory's matmul FLOPs (forward + backward; GPT: ``2 (4 h^2 + 2 h f)``) at ``flops_per_s x tp x
    efficiency`` plus the 4 TP all-reduces of ``h`` values (ring ``2 (t-1)/t``, intra-node link); per squared
    token 3 x its causal attention FLOPs (GPT: ``2 h``); 1e-4 s per microbatch. Memory: the inventory's
    activations per token without the score matrices (GPT: ``10 h + 24 h / t`` bytes, bf16, FlashAttention, no
    sequence parallelism), weights, gradients and Adam state ``dtype + grad + optimizer_state`` bytes per
    parameter a rank holds (split tensors divided by TP).

    ``options`` (hetu_ext.plan.core.options): recomputation adds the inventory's recomputed FLOPs (``full``: the whole
    forward and its 2 forward all-reduces again; ``selective``: the attention core) and keeps the inventory's
    activations for it (``full``: the layer input; the one layer recomputing at a time holds its whole activations
    for a microbatch of up to ``spec.seq_length`` tokens: that much is taken off the device memory, at the
    smallest TP degree, an upper bound); sequence parallelism (TP > 1) the same all-reduce bytes and the
    activations TP left whole split by TP; the distributed optimizer keeps the Adam state once over the
    ``world_size`` ranks (each rank's share, ``optimizer_state x parameters / world_size``, taken off the device
    memory; the per-layer fixed bytes are weights and gradients)."""
    cost = cost or CostModel()
    if options.distributed_optimizer and not world_size:
        raise ValueError("flops_cost_table: the distributed optimizer needs world_size (the ranks sharing the state)")
    h, f = spec.hidden_size, spec.ffn_hidden_size
    rc = options.recompute
    per_tp = {}
    for tp in tp_degrees:
        speed = cost.flops_per_s * tp * cost.tp_efficiency.get(tp, 0.8)
        comm = 0.0 if tp == 1 else 4 * 2 * (tp - 1) / tp * h * cost.dtype_bytes / cost.intra_node_bytes_per_s
        redo_a = inventory.layer_recompute_flops(spec, tokens=0.0, sum_sq=1.0, recompute=rc, causal=True)
        redo_b = inventory.layer_recompute_flops(spec, tokens=1.0, sum_sq=0.0, recompute=rc, causal=True)
        sp = options.sequence_parallel and tp > 1
        per_tp[tp] = LengthCost(
            a=(3 * inventory.attention_flops_per_square_token(spec, causal=True) + redo_a) / speed,
            b=(3 * inventory.layer_matmul_flops_per_token(spec) + redo_b) / speed
            + comm * (1.5 if rc == "full" else 1.0), c=1e-4,
            memory_per_token_bytes=inventory.activation_bytes_per_token(
                spec, tp=tp, attention_scores=False, sequence_parallel=sp, recompute=rc) * cost.dtype_bytes / 2,
            memory_fixed_bytes=inventory.layer_params(spec, tp=tp) * (
                cost.dtype_bytes + cost.grad_bytes + (0 if options.distributed_optimizer
                                                      else cost.optimizer_state_bytes)))
    memory = memory_bytes
    if options.distributed_optimizer:
        memory -= cost.optimizer_state_bytes * inventory.param_count(spec) / world_size
    if rc == "full":
        low = min(tp_degrees)
        memory -= spec.seq_length * inventory.activation_bytes_per_token(
            spec, tp=low, attention_scores=False, sequence_parallel=options.sequence_parallel and low > 1
        ) * cost.dtype_bytes / 2
    if memory <= 0:
        raise ValueError(f"flops_cost_table: the options {options.name} leave no memory of {memory_bytes:.3g} bytes")
    what = "" if options == PLAIN else f", {options.name}"
    return CostTable(per_tp=per_tp, device=f"flops-model({cost.flops_per_s / 1e12:g} TFLOP/s, "
                     f"TP link {cost.intra_node_bytes_per_s / 1e9:g} GB/s, h {h}, ffn {f}{what})",
                     device_memory_bytes=memory)


def sync_seconds(plan: Plan, spec: ModelSpec, *, bandwidth: float, grad_bytes: int = 4) -> float:
    """Predicted seconds of the data-parallel gradient all-reduce of ``plan`` (ring: ``2 (d-1)/d`` of each rank's
    gradient bytes over ``bandwidth`` bytes/s, ``d`` the pipelines), the slowest rank's; heterogeneous pipelines
    priced the same way (each rank's layers and embedding, divided by its TP degree). Equals
    hetu_ext.plan.hotspa.allreduce_seconds on a uniform plan."""
    d = len(plan.pipelines)
    if d == 1:
        return 0.0
    worst = 0.0
    for pipeline in plan.pipelines:
        for stage in pipeline.stages:
            elements = inventory.layer_params(spec, tp=stage.tp) * stage.num_layers
            if stage.has_embedding:
                elements += spec.padded_vocab_size * spec.hidden_size / stage.tp
            worst = max(worst, 2 * (d - 1) / d * elements * grad_bytes / bandwidth)
    return worst


# --------------------------------------------------------------------------------------------------- the pool

def _coefficients(shape: Shape) -> tuple[float, float, float]:
    """(a, b, c) of the shape's slowest stage (each the largest over its stages)."""
    stages = shape.replica.stage_costs
    return max(c.a for c in stages), max(c.b for c in stages), max(c.c for c in stages)


def shape_pool(model: ModelSpec, cost: CostTable, *, world_size: int, max_len: int, gpus_per_node: int = 8,
               slowdowns: Mapping[int, float] | None = None, prune: bool = True) -> list[Shape]:
    """Every replica shape TP x PP of at most ``world_size`` GPUs whose memory holds a token (module docstring,
    step 1), its capacity at most ``max_len``; with ``prune``, shapes another one dominates are dropped.
    ``slowdowns``: a straggler's factor scales the time of every shape (the pool prices a replica as if it
    included the slowest rank named, so the candidates stay conservative)."""
    slow = max(dict(slowdowns or {}).values(), default=1.0)
    out = []
    for tp in sorted(cost.per_tp):
        if tp > gpus_per_node or tp > world_size or inventory.tp_problems(model, tp):
            continue
        for pp in range(1, min(MAX_PP, model.num_layers) + 1):
            if model.num_layers % pp or tp * pp > world_size:
                continue
            plan = uniform_plan(world_size=tp * pp, tp=tp, pp=pp, num_layers=model.num_layers)
            try:
                (replica,) = replica_specs(plan, model, cost, max_pack_tokens=max_len,
                                           slowdowns=dict.fromkeys(range(tp * pp), slow))
            except ValueError:
                continue  # not one token fits
            out.append(Shape(tp=tp, pp=pp, capacity=replica.token_capacity, replica=replica))
    if not prune:
        return out
    keys = [(s.gpus, s.pp, -s.capacity, *_coefficients(s)) for s in out]
    return [s for k, s in enumerate(out) if not any(
        j != k and all(x <= y for x, y in zip(keys[j], keys[k])) and (keys[j] != keys[k] or j < k)
        for j in range(len(out)))]


# ---------------------------------------------------------------------------------------------- the histogram

@dataclass(frozen=True)
class Histogram:
    """Lengths in buckets (ascending, none empty): per bucket the count, tokens, squared tokens and longest."""

    count: np.ndarray
    tokens: np.ndarray
    squares: np.ndarray
    longest: np.ndarray

    def __len__(self) -> int:
        return int(self.count.size)


def length_histogram(lengths: Sequence[int] | np.ndarray, *, max_len: int, edges: Sequence[int] = (),
                     buckets: int = 32, batch_tokens: int | None = None) -> Histogram:
    """The lengths (pieces of at most ``max_len``, :func:`hetu_ext.data.lengths.split_long`) in buckets whose
    upper edges are ``edges`` (below ``max_len``), ``max_len`` and ``buckets`` quantiles (half by count, half by
    tokens); empty buckets dropped. ``batch_tokens``: counts scaled so that the whole is one global batch of that
    many tokens (else the lengths are one batch)."""
    s = split_long(np.asarray(lengths, dtype=np.int64).reshape(-1), max_len).length.astype(np.int64)
    if s.size == 0:
        raise ValueError("Hydraulis: no lengths given; pass a length file with one token count per line")
    s = np.sort(s)
    cut = {int(e) for e in edges if 0 < e < max_len} | {max_len}
    half = max(1, buckets // 2)
    cut |= {int(x) for x in np.quantile(s, np.arange(1, half) / half, method="higher")}
    cum = np.cumsum(s)
    cut |= {int(s[min(s.size - 1, int(np.searchsorted(cum, cum[-1] * q / half)))]) for q in range(1, half)}
    upper = np.array(sorted(cut), dtype=np.int64)
    which = np.searchsorted(upper, s, side="left")  # bucket b holds (upper[b-1], upper[b]]
    scale = 1.0 if batch_tokens is None else batch_tokens / float(cum[-1])
    f = s.astype(np.float64)
    count = np.bincount(which, minlength=upper.size).astype(np.float64)
    tokens = np.bincount(which, weights=f, minlength=upper.size)
    squares = np.bincount(which, weights=f * f, minlength=upper.size)
    longest = np.zeros(upper.size)
    np.maximum.at(longest, which, f)
    keep = count > 0
    return Histogram(count=count[keep] * scale, tokens=tokens[keep] * scale, squares=squares[keep] * scale,
                     longest=longest[keep])


# ------------------------------------------------------------------------------------------ dynamic program

def group_cost(shape: Shape, squares, tokens, longest, replicas):
    """Predicted seconds of ``replicas`` replicas of ``shape`` training a group of sequences with these squared
    and plain token sums and this longest sequence (module docstring, step 3; numpy-broadcast)."""
    a, b, c = _coefficients(shape)
    packs = np.maximum(1.0, np.ceil(tokens / (replicas * shape.capacity)))
    return (a * squares + b * tokens) / replicas + c * packs + (shape.pp - 1) * (a * longest * longest
                                                                                  + b * longest + c)


@dataclass(frozen=True)
class Solution:
    """One of the dynamic program's answers: its predicted time and groups (shape index into the pool,
    replicas, first bucket, stop bucket), the buckets ``[first, stop)``."""

    time_s: float
    groups: tuple[tuple[int, int, int, int], ...]

    def counts(self, pool: Sequence[Shape]) -> dict[int, int]:
        """Replicas per shape (index into ``pool``)."""
        out: dict[int, int] = {}
        for k, d, _, _ in self.groups:
            out[k] = out.get(k, 0) + d
        return out


def solve(pool: Sequence[Shape], hist: Histogram, world_size: int) -> list[Solution | None]:
    """``T[world_size][j]`` of the module docstring for every j = 1..B (list index j - 1), with its groups; None
    where no shape holds bucket j's longest sequence within the GPUs."""
    B, N = len(hist), world_size
    cq = np.concatenate([[0.0], np.cumsum(hist.squares)])
    cs = np.concatenate([[0.0], np.cumsum(hist.tokens)])
    T = np.full((B + 1, N + 1), np.inf)
    T[0, :] = 0.0
    choice = np.full((B + 1, N + 1, 3), -1, dtype=np.int64)  # (shape, replicas, i); -1: as with n - 1 GPUs
    n_all = np.arange(N + 1)
    for j in range(1, B + 1):
        m = float(hist.longest[j - 1])
        q, s = cq[j] - cq[:j], cs[j] - cs[:j]  # group (i, j] for i = 0..j-1
        best = np.full(N + 1, np.inf)
        for k, shape in enumerate(pool):
            g = shape.gpus
            if shape.capacity < m or g > N:
                continue
            d = np.arange(1, N // g + 1)
            cost = group_cost(shape, q[:, None], s[:, None], m, d[None, :].astype(np.float64))  # (j, D)
            rest = n_all[None, :] - g * d[:, None]  # (D, N+1): GPUs left for the groups before
            ok = rest >= 0
            vals = np.maximum(T[:j][:, np.where(ok, rest, 0)], cost[:, :, None])  # (j, D, N+1)
            vals[:, ~ok] = np.inf
            flat = vals.reshape(-1, N + 1)
            arg = flat.argmin(axis=0)
            v = flat[arg, n_all]
            better = v < best
            best[better] = v[better]
            choice[j, better] = np.stack([np.full(better.sum(), k), d[arg[better] % d.size],
                                          arg[better] // d.size], axis=1)
        for n in range(1, N + 1):  # at most n GPUs
            if T[j, n - 1] <= best[n]:
                best[n] = T[j, n - 1]
                choice[j, n] = -1
        T[j] = best
    out: list[Solution | None] = []
    for j in range(1, B + 1):
        if not np.isfinite(T[j, N]):
            out.append(None)
            continue
        groups, jj, n = [], j, N
        while jj > 0:
            k, d, i = (int(x) for x in choice[jj, n])
            if k < 0:
                n -= 1
                continue
            groups.append((k, d, i, jj))
            n -= d * pool[k].gpus
            jj = i
        out.append(Solution(time_s=float(T[j, N]), groups=tuple(reversed(groups))))
    return out


# ---------------------------------------------------------------------------------------------- candidates

def shapes_name(counts: Sequence[tuple[Shape, int]]) -> str:
    """``2xTP8PP1+4xTP2PP1``: replicas per shape, larger TP first."""
    return "+".join(f"{n}xTP{s.tp}PP{s.pp}" for s, n in sorted(counts, key=lambda x: (-x[0].tp, -x[0].pp)) if n)


def shapes_plan(counts: Sequence[tuple[Shape, int]], *, model: ModelSpec, world_size: int,
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
                         sampled_batches: int = 0, seed: int = 0) -> Strategies:
    """Hydraulis's candidate plans for ``lengths`` (a sample of the data's sequence lengths, e.g. a length
    file's; split at ``max_len``) on ``world_size`` GPUs: module docstring, steps 1-4. Each Strategy's
    ``max_len`` is its largest replica's capacity; the home (``Strategies.home``) is the homogeneous plan that
    holds ``max_len`` at the lowest predicted time on the histogram. At most ``limit`` strategies (home
    included). ``batch_tokens``: tokens per global batch (the histogram's scale; default: ``lengths`` is one
    batch). ``slowdowns`` (rank -> factor): every shape is priced at the largest factor (conservative; the
    Selector prices each plan on its own ranks). ``sampled_batches`` (with ``batch_tokens``): also the program's
    plan for each of that many global batches drawn from ``lengths`` (seeded by ``seed``; plans fitted to one
    step's mix rather than the whole file's), after the others, within ``limit``. ValueError (one line) when
    nothing fits."""
    if world_size < 1 or max_len < 1 or limit < 1:
        raise ValueError(f"Hydraulis: world_size, max_len and limit must be >= 1, got {world_size}, {max_len}, "
                         f"{limit}")
    if max_len > model.seq_length:
        raise ValueError(f"Hydraulis: max_len {max_len} exceeds the model's seq_length {model.seq_length}; raise "
                         "--seq-length or lower the max length")
    pool = shape_pool(model, cost, world_size=world_size, max_len=max_len, gpus_per_node=gpus_per_node,
                      slowdowns=slowdowns)
    if not pool:
        raise ValueError(f"Hydraulis: no TP x PP replica of at most {world_size} GPUs holds one token in "
                         f"{cost.device_memory_bytes} bytes per GPU; use more GPUs or GPUs with more memory")
    hist = length_histogram(lengths, max_len=max_len, edges=[s.capacity for s in pool], buckets=buckets,
                            batch_tokens=batch_tokens)
    longest = float(hist.longest[-1])
    homes = [k for k, s in enumerate(pool) if s.capacity >= max_len and world_size % s.gpus == 0]
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
            plan = uniform_plan(world_size=world_size, tp=s.tp, pp=s.pp, num_layers=model.num_layers,
                                num_microbatches=world_size // s.gpus)
            home_name = name
        else:
            try:
                plan = shapes_plan(pairs, model=model, world_size=world_size, gpus_per_node=gpus_per_node)
            except PlanError:
                continue
        items.append(Strategy(name=name, plan=plan, max_len=cap))
    items.sort(key=lambda s: (s.max_len, s.name))
    return Strategies(items=tuple(items), home=[s.name for s in items].index(home_name))


def _neighbours(chosen: list[dict[int, int]], pool: Sequence[Shape], steps: Sequence[int] = (1, -1, 2, 3)
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


# ------------------------------------------------------------------------------------------ per-step selection

def select_candidate(lengths: Sequence[int], strategies: Strategies, *, estimate: Callable[[int, list[int]], float],
                     exact: Callable[[int, list[int]], float], switch_s: Sequence[float],
                     may_win: Callable[[int, list[int], float], bool] | None = None,
                     ratios: Sequence[float] | None = None) -> tuple[int, float]:
    """The candidate with the lowest predicted step time ``exact(k, lengths) + switch_s[k]`` among those that hold
    the step's longest sequence, and that time. ``estimate`` must lower-bound ``exact`` (the packer's certified
    bound): candidates are priced exactly in order of their estimate until the next estimate cannot win, so the
    result equals brute force over every candidate (ties: the lower index). ``may_win(k, lengths, level)``
    (optional) answers False only if ``exact(k, lengths) > level``: once a candidate is priced, another one is
    skipped when it cannot come within the best by more than 1e-9 of it (so never a tie either). ``ratios``
    (optional, per candidate): the expected ``exact / estimate`` (e.g. from earlier steps); candidates are then
    priced in order of ``estimate x ratio + switch``, so the likely winner comes first and the others fall to
    their bound or to ``may_win``. Only the work depends on it, not the result."""
    check_capacity(lengths, strategies)
    s = list(lengths)
    longest = max(s, default=0)
    able = [k for k, st in enumerate(strategies.items) if st.max_len >= longest and len(st.plan.pipelines) <= len(s)]
    if not able:
        raise ValueError(f"Hydraulis: the step's {len(s)} sequences are fewer than every candidate's pipelines "
                         f"that holds {longest} tokens; raise the global batch")
    bounds = sorted((estimate(k, s) + switch_s[k], k) for k in able)
    if ratios is not None:  # the same candidates and tests, another order
        bounds.sort(key=lambda e: ((e[0] - switch_s[e[1]]) * ratios[e[1]] + switch_s[e[1]], e[1]))
    best_k, best_s = -1, float("inf")
    for bound, k in bounds:
        if bound > best_s:
            if ratios is None:
                break  # in order of the bound: the rest cannot win either
            continue
        if may_win is not None and best_k >= 0 and not may_win(k, s, best_s - switch_s[k] + 1e-9 * best_s):
            continue  # its compute exceeds that level: it cannot reach the best (Hydraulis, issue 15)
        t = exact(k, s) + switch_s[k]
        if t < best_s or (t == best_s and k < best_k):
            best_k, best_s = k, t
    return best_k, best_s


class Selector:
    """Per-step choice among ``strategies`` with prices built once: each candidate's replicas
    (hetu_ext.plan.core.replicas.replica_specs, straggler ``slowdowns`` included), the packer's certified lower bound
    (hetu_ext.data.packing_bound.lower_bound_s) as the estimate, the two-stage packer (``assign``, ``hetu``) as the
    exact price, and each candidate's switch from the home and back (hetu_ext.plan.hotspa.switch_seconds:
    weights in at ``weight_bytes``, fp32 gradients out, ``bandwidth`` bytes/s per GPU; 0 for the home)."""

    def __init__(self, strategies: Strategies, model: ModelSpec, cost: CostTable, *, bandwidth: float,
                 weight_bytes: int = 2, slowdowns: Mapping[int, float] | None = None) -> None:
        from hetu_ext.plan.hotspa import switch_seconds

        self.strategies = strategies
        self.replicas = [replica_specs(s.plan, model, cost, max_pack_tokens=s.max_len, slowdowns=slowdowns)
                         for s in strategies.items]
        home = strategies.items[strategies.home].plan
        self.switch_s = [0.0 if k == strategies.home else
                         switch_seconds(home, s.plan, model, weight_bytes=weight_bytes, bandwidth=bandwidth)
                         for k, s in enumerate(strategies.items)]
        self._packed: dict[int, Assignment] = {}
        self._bounds: tuple[tuple[int, ...], dict[int, float]] = ((), {})  # the last lengths' bounds per candidate
        self._ratios = [1.0] * len(strategies.items)  # packed / bound when last priced: select_candidate's order

    def _bound(self, k: int, lengths: Sequence[int]) -> float:
        key = tuple(lengths)
        if key != self._bounds[0]:
            self._bounds = (key, {})
        cache = self._bounds[1]
        if k not in cache:
            cache[k] = lower_bound_s(np.asarray(lengths, dtype=np.int64), self.replicas[k])
        return cache[k]

    def estimate(self, k: int, lengths: Sequence[int]) -> float:
        """A lower bound on candidate k's compute seconds for these lengths (certified: no packing beats it)."""
        return self._bound(k, lengths) if len(lengths) else 0.0

    def may_win(self, k: int, lengths: Sequence[int], level: float) -> bool:
        """False only if no packing of these lengths on candidate k finishes within ``level`` seconds
        (hetu_ext.data.packing_bound.may_fit_within: where long documents may go on pipelines of each shape)."""
        return may_fit_within(np.asarray(lengths, dtype=np.int64), self.replicas[k], level)

    def exact(self, k: int, lengths: Sequence[int]) -> float:
        """Candidate k's compute seconds under the two-stage packer (its slowest pipeline); the packer's bound is
        the one :meth:`estimate` computed for these lengths (the same function, not run twice)."""
        if not len(lengths):
            return 0.0
        self._packed[k] = assign(list(lengths), self.replicas[k], method="hetu", bound_s=self._bound(k, lengths))
        return max(self._packed[k].predicted_s)

    def choose(self, lengths: Sequence[int], *, exact: bool = True) -> tuple[int, float, Assignment | None]:
        """(candidate index, its predicted compute + switch seconds, its packing) for one step's lengths: the
        packing is the step's (the chosen candidate was priced by packing it). ``exact``: the lowest packed time
        (:func:`select_candidate`, equal to brute force over the candidates); else the lowest certified bound
        plus switch (no packer run but the chosen one's: faster, may miss the best by the bound's gap)."""
        self._packed = {}
        self._bounds = ((), {})  # every choice computes its bounds afresh
        if exact:
            k, t = select_candidate(lengths, self.strategies, estimate=self.estimate, exact=self.exact,
                                    switch_s=self.switch_s, may_win=self.may_win, ratios=self._ratios)
            for j, packed in self._packed.items():  # what its bound missed by, for the next step's order
                bound = self._bounds[1].get(j, 0.0)
                if bound > 0:  # a running mean: one step's miss does not reorder the next
                    self._ratios[j] = (self._ratios[j] + max(packed.predicted_s) / bound) / 2
        else:
            k, _ = select_candidate(lengths, self.strategies, estimate=self.estimate, exact=self.estimate,
                                    switch_s=self.switch_s)
            t = self.exact(k, lengths) + self.switch_s[k]
        return k, t, self._packed.get(k)


def one_plan_bound_s(lengths: Sequence[int], pool: Sequence[Shape], world_size: int, *,
                     upper_s: float | None = None, switch_s: Sequence[float] | None = None,
                     whole_replicas: bool = False) -> float:
    """A lower bound on the compute seconds of every plan over ``world_size`` GPUs whose replicas are shapes of
    ``pool`` (pass the unpruned pool, ``shape_pool(..., prune=False)``) training ``lengths`` in one step: what
    one-plan-per-step selection can reach at best, gradient all-reduce left out (and switches, unless
    ``switch_s`` is given).

    Proof (the packer's cost model): a replica of shape s runs each microbatch in at least any of its stages'
    ``a Q + b S`` (Q, S: the microbatch's squared and plain tokens; the overhead c and the fill and drain are >= 0), so
    its time is at least ``sum over its sequences of (a L^2 + b L)`` with a and b the least over its stages. The
    step time T is at least every replica's time, so ``G T >= sum over replicas of gpus_s x time_s >= sum over
    sequences of gpus_s (a_s L^2 + b_s L)`` for the shape s that trains it, which is at least the least such term
    over the shapes whose capacity holds L. A plan must have a replica holding the longest sequence; when every
    shape that holds it takes all G GPUs, that replica is the whole plan, and only those shapes count for every
    sequence. Tighter still: a replica's time is at least each of its sequences alone (its microbatch passes
    every stage: ``sum over stages of (a L^2 + b L + c)``), so in a step of T seconds a sequence can only be on a
    shape that trains it alone within T, and G T must cover the least GPU-seconds over those
    (hetu_ext.plan.lobra.least_step_s).

    ``upper_s``: the compute time of a plan already known (e.g. the best candidate's, packed): plans slower than it
    need no bound, and on a pipelined shape (pp > 1) each sequence's work then carries its share of every
    replica's fill and drain, the larger of ``1 + (pp - 1) tau / U`` (tau: its microbatch's slowest stage; the
    largest microbatch is at least the work-weighted mean of its sequences' tau, and a replica's work is at most
    its GPUs x U) and ``f(U) / U`` (hetu_ext.plan.hotspa.relaxation.f_over_u: the per-microbatch overhead
    against the fill); the result is ``min(upper_s, that bound)``. Every shape's microbatches also pay its least
    per-microbatch constant c, at least ``S / capacity`` of them for S tokens (a replica's time is at least the sum
    of its microbatches' times, each at least ``a Q + b S + c`` on any stage), so each sequence adds
    ``gpus x c x L / capacity``.

    ``switch_s`` (per shape of ``pool``, :func:`switch_floors_s`): a lower bound on the switch of any plan holding
    a replica of that shape; a plan's switch is at least the largest over its shapes, so its compute plus switch
    is at least the least, over every level sigma of them, of sigma plus the bound over the shapes at most sigma
    (with ``upper_s``: ``sigma + min(upper_s, ...)``, as a plan of more compute takes more than that anyway); the
    result then bounds compute plus switch (plans of the home's shape alone: sigma 0).

    ``whole_replicas`` (with ``upper_s``): also :func:`_whole_replica_bound_s`, which counts whole replicas per
    shape (HiGHS; seconds per bound at 2,000 sequences, so for benchmarks, not per step).

    ValueError when no shape holds the longest sequence."""
    if not len(lengths):
        return 0.0
    if switch_s is not None:
        if len(switch_s) != len(pool):
            raise ValueError(f"one_plan_bound_s: {len(switch_s)} switch floors for a pool of {len(pool)} shapes")
        longest = max(lengths)
        levels = []  # (the level's bound without whole replicas, sigma, its shapes)
        for sigma in sorted(set(switch_s)):
            some = [s for s, w in zip(pool, switch_s) if w <= sigma]
            if any(s.capacity >= longest for s in some):
                plain = one_plan_bound_s(lengths, some, world_size, upper_s=upper_s)
                if upper_s is not None:  # the cap at upper_s is only needed where upper_s priced the fill
                    plain = max(plain, one_plan_bound_s(lengths, some, world_size))
                levels.append((sigma + plain, sigma, some))
        if not levels:
            raise ValueError(f"Hydraulis: no shape of the pool holds {longest} tokens")
        best = float("inf")
        for plain, sigma, some in sorted(levels, key=lambda e: e[0]):
            if plain >= best:
                break  # the rest cannot come lower, whole replicas or not
            if whole_replicas:
                plain = max(plain, sigma + one_plan_bound_s(lengths, some, world_size, upper_s=upper_s,
                                                            whole_replicas=True))
            best = min(best, plain)
        return best
    work, solo = _one_plan_prices(lengths, pool, world_size, upper_s)
    bound = least_step_s(work, solo, world_size)
    if whole_replicas:
        bound = max(bound, _whole_replica_bound_s(work, solo, pool, world_size, low=bound, high=upper_s))
    return bound if upper_s is None else min(bound, upper_s)


def _one_plan_prices(lengths: Sequence[int], pool: Sequence[Shape], world_size: int, upper_s: float | None
                     ) -> tuple[np.ndarray, np.ndarray]:
    """(work, solo), sequences x shapes, of :func:`one_plan_bound_s`'s proof: the GPU-seconds each sequence costs on
    a replica of each shape and its time alone there, inf where the shape cannot take it."""
    L = np.asarray(lengths, dtype=np.float64)[:, None]
    caps = np.array([s.capacity for s in pool], dtype=np.float64)
    gpus = np.array([s.gpus for s in pool], dtype=np.float64)
    coef = np.array([(min(c.a for c in s.replica.stage_costs), min(c.b for c in s.replica.stage_costs))
                     for s in pool], dtype=np.float64).reshape(-1, 2)
    holders = caps >= L.max()
    if not holders.any():
        raise ValueError(f"Hydraulis: no shape of the pool holds {int(L.max())} tokens (the largest capacity is "
                         f"{int(caps.max(initial=0))})")
    allowed = holders if (gpus[holders] >= world_size).all() else np.ones_like(holders)
    work = gpus[None, :] * (coef[None, :, 0] * L * L + coef[None, :, 1] * L)
    per_pack = gpus[None, :] * np.array([min(c.c for c in s.replica.stage_costs) for s in pool])[None, :] \
        * L / caps[None, :]
    if upper_s is not None:
        for k, shape in enumerate(pool):
            stages = shape.replica.stage_costs
            if len(stages) > 1:
                tau = np.max([c.a * L[:, 0] ** 2 + c.b * L[:, 0] + c.c for c in stages], axis=0)
                rho = min(f_over_u(c.c, len(stages), upper_s) for c in stages)
                work[:, k] = np.maximum(work[:, k] * (1 + (len(stages) - 1) * tau / upper_s) + per_pack[:, k],
                                        work[:, k] * rho)
                per_pack[:, k] = 0.0
    work = work + per_pack
    ok = (caps[None, :] >= L) & allowed[None, :]
    work = np.where(ok, work, np.inf)
    solo = np.stack([sum(c.a * L[:, 0] ** 2 + c.b * L[:, 0] + c.c for c in s.replica.stage_costs) for s in pool],
                    axis=1)
    return work, np.where(ok, solo, np.inf)


def _whole_replica_bound_s(work: np.ndarray, solo: np.ndarray, pool: Sequence[Shape], world_size: int, *,
                           low: float, high: float | None, steps: int = 8, time_limit_s: float = 10.0) -> float:
    """The largest T in ``[low, high]`` (found by bisection, ``steps`` halvings) that no plan of whole replicas
    reaches: at a step time T, ``n_s`` replicas of shape s (integers, ``sum_s gpus_s n_s <= G``) have
    ``gpus_s n_s T`` GPU-seconds, which must cover the work of the sequences they train (a replica's time covers
    its sequences' work, each such sequence alone within T); sequences split fractionally among shapes. No such
    (n, x) exists below the result (HiGHS proves each infeasibility; an unproven one counts as feasible), so every
    plan's compute is at least it. ``high`` None: ``low`` (nothing to search)."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    if high is None or not high > low:
        return low
    n, S = work.shape
    gpus = np.array([s.gpus for s in pool], dtype=np.float64)

    def feasible(t: float) -> bool:
        i, k = np.nonzero(np.isfinite(work) & (solo <= t))
        if np.unique(i).size < n:
            return False  # a sequence no shape trains alone within t
        m = i.size
        # rows: each sequence once (n), each shape's work within gpus n_s t (S), the GPUs (1)
        rows = np.r_[i, n + k, n + np.arange(S), np.full(S, n + S)]
        cols = np.r_[np.arange(m), np.arange(m), m + np.arange(S), m + np.arange(S)]
        vals = np.r_[np.ones(m), work[i, k], -gpus * t, gpus]
        A = coo_matrix((vals, (rows, cols)), shape=(n + S + 1, m + S))
        lo = np.r_[np.ones(n), np.full(S, -np.inf), 0.0]
        hi = np.r_[np.ones(n), np.zeros(S), float(world_size)]
        res = milp(np.r_[np.zeros(m), gpus], constraints=[LinearConstraint(A.tocsr(), lo, hi)],
                   integrality=np.r_[np.zeros(m), np.ones(S)],
                   bounds=Bounds(np.zeros(m + S), np.r_[np.ones(m), np.full(S, float(world_size))]),
                   options={"time_limit": time_limit_s})
        return res.status != 2  # 2: infeasible (proven); anything else counts as feasible

    if feasible(low):
        return low
    for _ in range(steps):
        mid = (low + high) / 2
        if feasible(mid):
            high = mid
        else:
            low = mid
    return low


def switch_floors_s(home_tp: int, home_pp: int, pool: Sequence[Shape], model: ModelSpec, *, bandwidth: float,
                    weight_bytes: int = 2, grad_bytes: int = 4) -> list[float]:
    """Per shape of ``pool``: a lower bound on the switch (hetu_ext.plan.hotspa.switch_seconds: weights in,
    gradients back, the slowest rank's) from a uniform home of TP ``home_tp`` x PP ``home_pp`` to any plan with a
    replica of that shape (0 for the home's own shape). A rank of that replica holds ``L / pp`` layers at ``1 /
    tp`` of each layer's split elements, and held ``L / home_pp`` at ``1 / home_tp`` under the home; the two share
    at most ``min(L / pp, L / home_pp)`` layers at ``min(1 / tp, 1 / home_tp)``, so at least the rest of each comes
    in: the target's (weights) and, on the way back, the home's (gradients). Layernorms and embeddings left out
    (>= 0)."""
    split, _ = inventory.layer_params_by_split(model)
    L = model.num_layers
    floors = []
    for shape in pool:
        if (shape.tp, shape.pp) == (home_tp, home_pp):
            floors.append(0.0)
            continue
        shared = min(L / shape.pp, L / home_pp) * min(1 / shape.tp, 1 / home_tp)
        into = max(0.0, L / shape.pp / shape.tp - shared)
        back = max(0.0, L / home_pp / home_tp - shared)
        floors.append((into * weight_bytes + back * grad_bytes) * split / bandwidth)
    return floors


# ------------------------------------------------------------------------------------------- planning CLI

def replicas_of(strategy: Strategy) -> list[tuple[int, int, int]]:
    """(TP, PP, count) of a strategy's pipelines, larger TP first (the first stage's TP stands for the pipeline)."""
    counts: dict[tuple[int, int], int] = {}
    for p in strategy.plan.pipelines:
        key = (p.stages[0].tp, p.pp)
        counts[key] = counts.get(key, 0) + 1
    return [(tp, pp, n) for (tp, pp), n in sorted(counts.items(), key=lambda x: (-x[0][0], -x[0][1]))]


def strategies_yaml(strategies: Strategies, plan_file: Callable[[int], str]) -> tuple[str, dict[str, Plan]]:
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


def add_arguments(parser) -> None:
    """``python -m hetu_ext.plan hydraulis``'s flags."""
    parser.add_argument("--lengths", required=True, help="length file: one token count per line (.gz allowed)")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0, help="memory per GPU usable by a stage")
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads"):
        parser.add_argument(flag, type=int, required=True)
    parser.add_argument("--seq-length", type=int, required=True,
                        help="the longest sequence (documents longer are split into pieces of this length)")
    parser.add_argument("--ffn-hidden-size", type=int, default=None)
    parser.add_argument("--vocab-size", type=int, default=50257)
    parser.add_argument("--batch-tokens", type=int, default=None,
                        help="tokens per global batch (default: 32768 per GPU)")
    parser.add_argument("--batches", type=int, default=4, help="sampled global batches to choose candidates for")
    parser.add_argument("--limit", type=int, default=24, help="most candidates (the home included)")
    parser.add_argument("--sampled-batches", type=int, default=16,
                        help="candidates also from the dynamic program on this many global batches drawn from the "
                        "lengths (plans fitted to one step's mix)")
    parser.add_argument("--recompute-granularity", choices=("none", "selective", "full", "auto"), default="none",
                        help="activation recomputation priced by the FLOP model (Megatron-LM's flag); auto: the "
                        "better of none and full on the sampled batches")
    parser.add_argument("--sequence-parallel", action="store_true", help="price sequence parallelism (TP > 1)")
    parser.add_argument("--use-distributed-optimizer", action="store_true",
                        help="price the distributed optimizer (Adam state once over the world's ranks)")
    parser.add_argument("--bandwidth", type=float, default=100.0,
                        help="GB/s per GPU for switching weights and gradients and for the gradient all-reduce")
    parser.add_argument("--cost-model", default=None, metavar="YAML",
                        help="measured per-layer costs (python -m hetu_ext.cli.calibrate) instead of the FLOP "
                             "model; its device_memory_bytes, when set, replaces --gpu-memory-gib")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--output", "-o", default=None,
                        help="write the candidates here as a strategies YAML (heterogeneous plans beside it)")


def sample_batches(lengths: np.ndarray, *, tokens: int, count: int, seed: int) -> list[list[int]]:
    """``count`` global batches: lengths drawn in a seeded random order until ``tokens`` tokens (at least one)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        order = rng.permutation(lengths.size)
        cum = np.cumsum(lengths[order])
        out.append(lengths[order[:int(np.searchsorted(cum, tokens)) + 1]].tolist())
    return out


def run(args) -> tuple[Strategies, str, ModelSpec]:
    """Candidates for ``args`` (add_arguments' flags) and a report (tables) to print; ValueError (one line) on
    bad input."""
    from hetu_ext.data.cost import load_cost_table
    from hetu_ext.data.lengths import read_lengths

    for flag in ("world_size", "gpus_per_node", "num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "batches", "limit"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not args.gpu_memory_gib > 0 or not args.bandwidth > 0:
        raise ValueError(f"--gpu-memory-gib and --bandwidth must be > 0, got {args.gpu_memory_gib}, "
                         f"{args.bandwidth}")
    model = ModelSpec(num_layers=args.num_layers, hidden_size=args.hidden_size,
                      num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
                      vocab_size=args.vocab_size, seq_length=args.seq_length)
    measured = load_cost_table(args.cost_model) if args.cost_model else None
    pieces = split_long(read_lengths(args.lengths), args.seq_length).length
    tokens = args.batch_tokens or 32768 * args.world_size
    if tokens < 1:
        raise ValueError(f"--batch-tokens must be >= 1, got {tokens}")
    if args.sampled_batches < 0:
        raise ValueError(f"--sampled-batches must be >= 0, got {args.sampled_batches}")
    rc = args.recompute_granularity
    sets = [Options(recompute=r, sequence_parallel=args.sequence_parallel,
                    distributed_optimizer=args.use_distributed_optimizer)
            for r in (("none", "full") if rc == "auto" else (rc,))]
    if measured is not None:
        sets = [PLAIN]  # a measured table is one set of options already
    best, errors = None, []
    for opts in sets:
        try:
            got = _plan_once(args, model, measured, opts, pieces, tokens)
        except ValueError as exc:  # nothing fits under these options; another set may
            errors.append(str(exc))
            continue
        if best is None or got[2] < best[2]:
            best = got
    if best is None:
        raise ValueError(errors[-1])
    strategies, lines = best[0], best[1]
    if measured is None:
        lines.insert(0, f"options: {best[3].name} (Megatron-LM flags: {' '.join(best[3].flags()) or 'none'}; "
                        f"searched: {', '.join(o.name for o in sets)}, by the mean predicted step of the sampled "
                        "batches)")
    return strategies, "\n".join(lines), model


def _plan_once(args, model: ModelSpec, measured: CostTable | None, opts: Options, pieces: np.ndarray,
               tokens: int) -> tuple[Strategies, list[str], float, Options]:
    """run()'s candidates and report under one set of options; the mean predicted step of the sampled batches
    (inf when no homogeneous strategy to compare with; the dynamic choice's own mean otherwise)."""
    import time

    from hetu_ext.plan.hotspa import auto_strategies, group_seconds

    cost = measured
    if cost is None or cost.device_memory_bytes is None:
        memory = args.gpu_memory_gib * 2**30
        cost = flops_cost_table(model, memory_bytes=memory, options=opts, world_size=args.world_size) \
            if cost is None else CostTable(per_tp=cost.per_tp, device=cost.device, device_memory_bytes=memory,
                                           note=cost.note)
    start = time.perf_counter()
    strategies = candidate_strategies(model, args.world_size, cost, pieces, max_len=args.seq_length,
                                      gpus_per_node=args.gpus_per_node, limit=args.limit, batch_tokens=tokens,
                                      sampled_batches=args.sampled_batches, seed=args.seed + 1)
    plan_s = time.perf_counter() - start
    bandwidth = args.bandwidth * 1e9
    selector = Selector(strategies, model, cost, bandwidth=bandwidth)
    home_sync = sync_seconds(strategies.items[strategies.home].plan, model, bandwidth=bandwidth)
    lines = [f"cost: {cost.device}, {cost.device_memory_bytes / 2**30:.3g} GiB per GPU; {args.world_size} GPUs; "
             f"{len(strategies.items)} candidates in {plan_s:.2f} s",
             "", f"{'candidate':<36} {'GPUs':>4} {'max_len':>7} {'switch_s':>8}  replicas TPxPP (count): capacity",
             f"{'-' * 36} {'-' * 4} {'-' * 7} {'-' * 8}  {'-' * 40}"]
    for k, s in enumerate(strategies.items):
        caps = {}
        for p, spec in zip(s.plan.pipelines, replica_specs(s.plan, model, cost, max_pack_tokens=s.max_len)):
            caps[(p.stages[0].tp, p.pp)] = spec.token_capacity
        reps = ", ".join(f"{tp}x{pp} ({n}): {caps[(tp, pp)]}" for tp, pp, n in replicas_of(s))
        name = s.name + (" (home)" if k == strategies.home else "")
        lines.append(f"{name:<36} {len(s.plan.used_ranks):>4} {s.max_len:>7} {selector.switch_s[k]:>8.3f}  {reps}")
    batches = sample_batches(pieces, tokens=tokens, count=args.batches, seed=args.seed)
    homogeneous = [h for h in auto_strategies(model, args.world_size, cost, max_pp=MAX_PP).items
                   if h.max_len >= max(max(b) for b in batches)]
    homo_s = {h.name: [group_seconds(h.plan, model, cost, b, h.max_len)
                       + sync_seconds(h.plan, model, bandwidth=bandwidth) for b in batches] for h in homogeneous}
    best_homo = min(homo_s, key=lambda n: sum(homo_s[n])) if homo_s else None
    lines += ["", f"sampled batches ({tokens} tokens each; time = compute + switch + gradient all-reduce; "
              f"homogeneous: {best_homo or 'none holds the longest sequence'}, the same packer)",
              f"{'batch':>5} {'seqs':>5} {'longest':>7} {'chosen':<36} {'select_ms':>9} {'dynamic_s':>9} "
              f"{'homog_s':>8} {'gain':>6}"]
    dyn_all = []
    for g, b in enumerate(batches):
        start = time.perf_counter()
        k, t, _ = selector.choose(b)
        ms = (time.perf_counter() - start) * 1e3
        dyn = t + home_sync
        dyn_all.append(dyn)
        homo = homo_s[best_homo][g] if best_homo else float("nan")
        lines.append(f"{g:>5} {len(b):>5} {max(b):>7} {strategies.items[k].name:<36} {ms:>9.1f} {dyn:>9.3f} "
                     f"{homo:>8.3f} {homo / dyn:>5.2f}x")
    if best_homo:
        lines.append(f"mean: dynamic {np.mean(dyn_all):.3f} s, homogeneous {best_homo} {np.mean(homo_s[best_homo]):.3f}"
                     f" s, predicted gain {np.mean(homo_s[best_homo]) / np.mean(dyn_all):.2f}x")
    return strategies, lines, float(np.mean(dyn_all)), opts
