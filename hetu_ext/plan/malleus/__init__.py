"""Malleus: straggler-aware non-uniform planning (pure; no torch, no clocks).

Given the cluster (ranks, nodes, GPU memory, slowdowns), the model shape and the global batch, choose TP groups
(inside a node; stragglers grouped together, or left unused), pipelines of possibly different stage counts, a
layer split per pipeline and a microbatch count per pipeline that minimise the predicted step time, fill and
drain included, under each GPU's memory.

Two inner problems are solved exactly without an ILP solver, by water-filling (the optimum of a min-max
allocation with monotone per-item costs is the smallest level T at which the items' capacities at T cover the
demand; the level is searched by bisection and then snapped to the allocation it yields):

* layer split: ``min max_j (n_j t_j + c_j)`` over contiguous stages, ``sum n_j = L``, ``1 <= n_j <= cap_j``
  (t_j: a layer's forward+backward seconds on stage j, c_j: its embedding/output work, cap_j: layers that fit
  in its memory with the microbatches 1F1B keeps in flight there);
* microbatch split: ``min max_i ((m_i - 1) t_i + S_i)`` over pipelines, ``sum m_i = M``, ``m_i >= 0`` (a
  pipeline too slow to take even one microbatch is dropped and its ranks left unused).

The outer search enumerates a few templates (TP degree, a straggler cut-off, stages per pipeline): O(N) work
each, so thousands of GPUs plan in well under a second, where Malleus's released planner solves two ILPs per
template (~20 s at 64 GPUs).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from hetu_ext.plan.core.cluster import Cluster
from hetu_ext.plan.cost.stage import CostModel, stage_cost
from hetu_ext.plan.core.options import PLAIN, Options
from hetu_ext.model import inventory
from hetu_ext.model.spec import ModelSpec
from hetu_ext.plan.core.plan import Pipeline, Plan, Stage, uniform_plan
from hetu_ext.plan.cost.simulate import one_f_one_b, pipeline_time_closed_form

_BISECT_STEPS = 64  # halvings: enough to reach float resolution of any level below 1e19 x the lowest


def _bisect_level(count_at, lo: float, hi: float, demand: int) -> tuple[float, float]:
    """``(lo, hi)`` narrowed around where ``count_at`` (monotone, step-wise) reaches ``demand``: ``hi`` the smallest
    level found that reaches it, ``lo`` the largest found that does not."""
    for _ in range(_BISECT_STEPS):
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            break
        if count_at(mid) >= demand:
            hi = mid
        else:
            lo = mid
    return lo, hi


def _snap_min_level(count_at, lo: float, hi: float, demand: int) -> float:
    """Smallest level in (lo, hi] whose count reaches ``demand`` (count_at monotone, step-wise)."""
    return _bisect_level(count_at, lo, hi, demand)[1]


def split_layers(num_layers: int, per_layer: list[float], fixed: list[float], caps: list[int]) -> list[int] | None:
    """Layers per stage minimising the slowest stage; None if the caps cannot hold ``num_layers``."""
    out = _split_layers(num_layers, per_layer, fixed, caps)
    return None if out is None else out[0]


def _split_layers(num_layers: int, per_layer: list[float], fixed: list[float], caps: list[int]
                  ) -> tuple[list[int], bool] | None:
    """:func:`split_layers` and whether a cap bound it (some stage held its cap at the optimal level; if none
    did, the split is also optimal without caps: larger caps cannot lower its time)."""
    p = len(per_layer)
    if p > num_layers or sum(min(c, num_layers) for c in caps) < num_layers or min(caps) < 1:
        return None

    def counts(level: float) -> list[int]:
        return [min(cap, max(0, math.floor((level - c) / t + 1e-12))) for t, c, cap in zip(per_layer, fixed, caps)]

    def count_at(level: float) -> int:
        n = counts(level)
        return sum(n) if min(n) >= 1 else -1

    hi = max(c + t * num_layers for t, c in zip(per_layer, fixed))
    level = _snap_min_level(count_at, 0.0, hi, num_layers)
    alloc = counts(level)
    capped = any(n >= cap for n, cap in zip(alloc, caps))
    excess = sum(alloc) - num_layers
    while excess > 0:  # any trim keeps the level; trim the currently slowest stages first
        j = max((k for k in range(p) if alloc[k] > 1), key=lambda k: alloc[k] * per_layer[k] + fixed[k])
        alloc[j] -= 1
        excess -= 1
    return alloc, capped


def balance_microbatches(total: int, bottleneck: list[float], fill: list[float]) -> list[int]:
    """Microbatches per pipeline minimising the slowest pipeline's ``(m - 1) t + S`` (0 drops a pipeline).

    Pipelines with equal ``(t, S)`` (most of them in a large cluster) are counted once per level with their
    multiplicity, and the excess over ``total`` is trimmed from a heap: the same allocation as trimming the
    currently slowest pipeline (lowest index on ties) one microbatch at a time, in O(P log P)."""

    def one(level: float, t: float, s: float) -> int:
        return max(0, math.floor((level - s) / t + 1e-12) + 1) if level >= s else 0

    kinds: dict[tuple[float, float], int] = {}
    for key in zip(bottleneck, fill):
        kinds[key] = kinds.get(key, 0) + 1
    hi = max(s + t * (total - 1) for t, s in kinds)
    level = _snap_min_level(lambda x: sum(n * one(x, t, s) for (t, s), n in kinds.items()), 0.0, hi, total)
    alloc = [one(level, t, s) for t, s in zip(bottleneck, fill)]
    excess = sum(alloc) - total
    heap = [(-((m - 1) * t + s), k) for k, (m, t, s) in enumerate(zip(alloc, bottleneck, fill)) if m > 0]
    heapq.heapify(heap)
    while excess > 0:
        _, i = heapq.heappop(heap)
        alloc[i] -= 1
        excess -= 1
        if alloc[i] > 0:
            heapq.heappush(heap, (-((alloc[i] - 1) * bottleneck[i] + fill[i]), i))
    return alloc


@dataclass(frozen=True)
class PlannedStep:
    """A plan and the step time the cost model predicts for it."""

    plan: Plan
    predicted_step_s: float
    template: str
    """Which template won (TP degree, straggler cut-off, stages per pipeline; the options when searched)."""
    options: Options = PLAIN
    """The training options the plan was priced with (Megatron-LM flags: ``options.flags()``)."""


def _groups(cluster: Cluster, tp: int, cutoff: float) -> tuple[list[tuple[tuple[int, ...], float]], list[int]]:
    """TP groups per node, stragglers grouped together (ranks sorted by slowdown); groups slower than cutoff
    and leftover ranks are unused."""
    groups, unused = [], []
    for node in cluster.nodes:
        ranked = sorted(node, key=lambda r: (cluster.slowdown(r), r))
        for k in range(0, len(ranked) - len(ranked) % tp, tp):
            members = tuple(sorted(ranked[k:k + tp]))
            x = max(cluster.slowdown(r) for r in members)
            (groups.append((members, x)) if x <= cutoff else unused.extend(members))
        unused.extend(ranked[len(ranked) - len(ranked) % tp:])
    return groups, unused


def _evaluate(spec: ModelSpec, cost: CostModel, cluster: Cluster, pipelines_groups, tp: int, micro_batch: int,
              num_microbatches: int, options: Options = PLAIN, cp: int = 1):
    """Split layers and microbatches for pipelines given as lists of (ranks, slowdown) (each group ``cp`` TP
    groups of ``tp``: stage_cost's context parallelism) under ``options``
    (``cost.optimizer_sharded`` or ``options.distributed_optimizer`` shards the optimizer state); None if
    infeasible, else (step, splits, microbatches, capped): ``capped`` when a stage's memory bound its layer split."""
    stages_all, bottleneck, fill = [], [], []
    memo: dict = {}
    holders = len(pipelines_groups) * cp  # each element is held once per pipeline and CP rank: the sharded divisor
    sharded = cost.optimizer_sharded or options.distributed_optimizer
    if sharded != cost.optimizer_sharded:
        cost = dataclasses.replace(cost, optimizer_sharded=sharded)
    knobs = {"recompute": options.recompute, "sequence_parallel": options.sequence_parallel and tp > 1,
             "optimizer_holders": holders, "cp": cp}

    def terms(x: float, j: int, p: int) -> tuple[float, float, int]:
        """(seconds per layer, fixed seconds, layer capacity) of stage j of p at slowdown x (memoised)."""
        key = (x, j == 0, j == p - 1, p - j)
        if key not in memo:
            args = dict(tp=tp, slowdown=x, micro_batch=micro_batch, in_flight=p - j, **knobs)
            unit = stage_cost(spec, cost, num_layers=1, first=False, last=False, **args)
            two = stage_cost(spec, cost, num_layers=2, first=False, last=False, **args).memory_bytes \
                if options.recompute == "full" else 0.0
            ends = stage_cost(spec, cost, num_layers=0, first=j == 0, last=j == p - 1, **args)
            per_layer, once = unit.memory_bytes, 0.0
            if options.recompute == "full":  # one layer's whole activations are held once, in its backward
                per_layer = two - unit.memory_bytes
                once = unit.memory_bytes - per_layer
            memo[key] = (unit.forward_s + unit.backward_s, ends.forward_s + ends.backward_s,
                         int((cluster.gpu_memory_bytes - ends.memory_bytes - once) // per_layer))
        return memo[key]

    splits: dict = {}  # pipelines with the same stage speeds (most of them, in a large cluster) split alike
    capped = False
    for groups in pipelines_groups:
        speeds = tuple(x for _, x in groups)
        if speeds not in splits:
            p = len(groups)
            per_layer, fixed, caps = zip(*(terms(x, j, p) for j, x in enumerate(speeds)))
            out = _split_layers(spec.num_layers, list(per_layer), list(fixed), list(caps))
            times = None if out is None else [n * t + c for n, t, c in zip(out[0], per_layer, fixed)]
            splits[speeds] = (None if out is None else out[0], times)
            capped = capped or (out is not None and out[1])
        split, times = splits[speeds]
        if split is None:
            return None
        stages_all.append(split)
        bottleneck.append(max(times))
        fill.append(sum(times))
    mbs = balance_microbatches(num_microbatches, bottleneck, fill)
    if sharded and 0 in mbs:
        return None  # a pipeline left idle would leave its share of the sharded optimizer state to the others
    step = max((m - 1) * b + s for m, b, s in zip(mbs, bottleneck, fill) if m > 0)
    return step, stages_all, mbs, capped


def _widths(cluster: Cluster, spec: ModelSpec, tp_degrees: tuple[int, ...], cp_degrees: tuple[int, ...]):
    """(tp, cp) pairs whose stage (``tp cp`` GPUs) fits a node, TP splitting the model, CP the sequence."""
    for tp in tp_degrees:
        for cp in cp_degrees:
            if tp * cp > cluster.gpus_per_node or inventory.tp_problems(spec, tp) or (
                    cp > 1 and spec.seq_length % (2 * cp)):
                continue
            yield tp, cp


def _templates(cluster: Cluster, spec: ModelSpec, cost: CostModel, micro_batch: int, num_microbatches: int,
               tp_degrees: tuple[int, ...], cp_degrees: tuple[int, ...], stages_per_pipeline: tuple[int, ...]):
    """Every template (TP x CP width, straggler cut-off, stages per pipeline) as ``(floor, index, tp, cp, cutoff,
    pp, pipelines of (ranks, slowdown) groups, idle ranks)``. ``floor``: no plan of the template beats its groups'
    summed pace (each group runs one stage's microbatch at a time, at 1 / slowdown, and the microbatches' stages
    add up to one microbatch through the model; options only add time), nor its busiest pipeline's 1F1B."""
    cutoffs = sorted({cluster.slowdown(r) for r in range(cluster.world_size)}, reverse=True)[:4]
    k = 0
    for tp, cp in _widths(cluster, spec, tp_degrees, cp_degrees):
        whole = stage_cost(spec, cost, num_layers=spec.num_layers, tp=tp, slowdown=1.0, micro_batch=micro_batch,
                           first=True, last=True, in_flight=1, cp=cp)
        model_s = whole.forward_s + whole.backward_s  # one microbatch through every stage, no recomputation
        for cutoff in cutoffs:
            groups, unused = _groups(cluster, tp * cp, cutoff)
            for pp in stages_per_pipeline:
                if not groups or pp > min(len(groups), spec.num_layers):
                    continue
                d = len(groups) // pp
                spare = groups[d * pp:]
                order = sorted(groups[:d * pp], key=lambda g: g[1])
                pipes = [[] for _ in range(d)]  # groups dealt in snake order: each pipeline a similar mix of speeds
                for n, g in enumerate(order):
                    lap, i = divmod(n, d)
                    pipes[i if lap % 2 == 0 else d - 1 - i].append(g)
                # and whole microbatches: some pipeline runs q = ceil(M / d) of them, (q - 1) bottlenecks of at
                # least model_s / pp (slowdowns >= 1) after a fill of at least model_s
                floor = max(num_microbatches * model_s / sum(1 / x for pipe in pipes for _, x in pipe),
                            model_s * (1 + (math.ceil(num_microbatches / d) - 1) / pp))
                yield floor, k, tp, cp, cutoff, pp, pipes, unused + [r for g, _ in spare for r in g]
                k += 1


def kept_in_place(plan: Plan, current: Plan) -> int:
    """(rank, layer) pairs that stay where they are, held with the same TP group: what a migration need not move."""
    kept = 0
    for rank in plan.used_ranks:
        a, b = plan.stage_of(rank), current.stage_of(rank)
        if a is None or b is None:
            continue
        new, old = plan.pipelines[a[0]].stages[a[1]], current.pipelines[b[0]].stages[b[1]]
        if new.ranks == old.ranks:
            kept += len(set(new.layers) & set(old.layers))
    return kept


def plan_malleus(cluster: Cluster, spec: ModelSpec, *, micro_batch: int, num_microbatches: int,
                 cost: CostModel = CostModel(), tp_degrees: tuple[int, ...] = (1, 2, 4, 8),
                 stages_per_pipeline: tuple[int, ...] = (1, 2, 4, 8, 16), current: Plan | None = None,
                 keep_tolerance: float = 0.02, options: Sequence[Options] | None = None,
                 cp_degrees: tuple[int, ...] = (1,)) -> PlannedStep:
    """The best plan over the templates; ValueError naming what would fit if no template fits in memory.

    ``cp_degrees``: context-parallel degrees searched beside each TP degree (a stage is then ``cp`` TP groups of
    one node, ``tp cp`` GPUs: stage_cost's CP; the sequence must split in 2 cp chunks). Default: no CP.

    ``options``: the option sets searched with each template (hetu_ext.plan.core.options.search_space: recomputation,
    sequence parallelism, distributed optimizer), lightest first; a heavier set is priced only when the lighter
    ones did not fit or a stage's memory bound their layer split (otherwise it cannot be faster: recomputation
    only adds time, the others only add memory). Default: the running job's (no recomputation, no sequence
    parallelism, the optimizer sharded as ``cost.optimizer_sharded``).

    With ``current`` (the running plan), among the plans predicted within ``keep_tolerance`` of the fastest, the
    one that keeps the most layers in place (:func:`kept_in_place`) wins: it migrates fewer bytes."""
    searched = tuple(options) if options is not None else (PLAIN,)
    slack = 1 + keep_tolerance if current is not None else 1.0
    best_step = float("inf")
    candidates = []  # (step, ..., template index): ties go to the earlier template, as enumerated
    # best first: every template with its floor, cheapest floors evaluated first, so that the fastest plan is
    # found early and the templates whose floor exceeds it (most of them, at thousands of GPUs) are never priced
    for floor, k, tp, cp, cutoff, pp, pipes, idle in sorted(
            _templates(cluster, spec, cost, micro_batch, num_microbatches, tp_degrees, cp_degrees,
                       stages_per_pipeline), key=lambda t: (t[0], t[1])):
        if floor > best_step * slack:
            break
        for opts in searched:
            result = _evaluate(spec, cost, cluster, pipes, tp, micro_batch, num_microbatches, opts, cp)
            if result is None:
                continue
            step, splits, mbs, capped = result
            best_step = min(best_step, step)
            candidates.append((step, tp, cutoff, pp, pipes, splits, mbs, idle, opts, cp, k))
            if not capped:
                break
    candidates.sort(key=lambda c: c[-1])
    if not candidates:
        raise ValueError(_no_fit_message(cluster, spec, cost, micro_batch))
    fastest = min(c[0] for c in candidates)
    if current is None:
        return _build(cluster, spec, min(candidates, key=lambda c: c[0]), show_options=options is not None)
    near = [_build(cluster, spec, c, show_options=options is not None) for c in candidates
            if c[0] <= fastest * (1 + keep_tolerance)]
    return max(near, key=lambda p: (kept_in_place(p.plan, current), -p.predicted_step_s))


def _build(cluster: Cluster, spec: ModelSpec, candidate, *, show_options: bool = False) -> PlannedStep:
    step, tp, cutoff, pp, pipes, splits, mbs, unused, opts, cp, _ = candidate
    unused = list(unused)
    pipelines = []
    for groups, split, m in zip(pipes, splits, mbs):
        if m == 0:
            unused += [r for g, _ in groups for r in g]
            continue
        stages, start = [], 0
        for j, ((ranks, _), n) in enumerate(zip(groups, split)):
            stages.append(Stage(ranks=ranks, layer_start=start, layer_stop=start + n, has_embedding=j == 0,
                                has_output=j == len(groups) - 1, cp=cp))
            start += n
        pipelines.append(Pipeline(stages=tuple(stages), num_microbatches=m))
    plan = Plan(pipelines=tuple(pipelines), unused_ranks=tuple(sorted(unused)))
    plan.validate(spec, cluster.world_size)
    return PlannedStep(plan=plan, predicted_step_s=step, options=opts,
                       template=f"tp={tp}" + (f" cp={cp}" if cp > 1 else "") + f" cutoff={cutoff:g} "
                       f"stages/pipeline={pp}"
                       + (f" {opts.name}" if show_options else ""))


def _no_fit_message(cluster: Cluster, spec: ModelSpec, cost: CostModel, micro_batch: int) -> str:
    one_layer = stage_cost(spec, cost, num_layers=1, tp=min(8, cluster.gpus_per_node), slowdown=1.0,
                           micro_batch=micro_batch, first=False, last=False, in_flight=1).memory_bytes
    per_gpu = max(1, int(cluster.gpu_memory_bytes // one_layer))
    need = math.ceil(spec.num_layers / per_gpu)
    return (f"planner: no plan fits in {cluster.gpu_memory_bytes / 2**30:.1f} GiB per GPU: one layer needs "
            f"{one_layer / 2**30:.2f} GiB at the largest TP degree, so at most {per_gpu} layers fit per GPU and "
            f"{spec.num_layers} layers need at least {need} pipeline stages of TP {min(8, cluster.gpus_per_node)}; "
            f"use more GPUs, fewer layers per GPU, or a smaller micro batch than {micro_batch}")


def predict_uniform(cluster: Cluster, spec: ModelSpec, *, tp: int, pp: int, micro_batch: int,
                    num_microbatches: int, cost: CostModel = CostModel(), options: Options = PLAIN) -> float:
    """Predicted step time of Megatron's uniform plan on the same (straggling) cluster."""
    plan = uniform_plan(world_size=cluster.world_size, tp=tp, pp=pp, num_layers=spec.num_layers,
                        num_microbatches=max(1, num_microbatches // (cluster.world_size // (tp * pp))))
    return plan_step_s(plan, cluster, spec, micro_batch=micro_batch, cost=cost, options=options)


def plan_step_s(plan: Plan, cluster: Cluster, spec: ModelSpec, *, micro_batch: int,
                cost: CostModel = CostModel(), exact: bool = False, options: Options = PLAIN) -> float:
    """Step time of any plan under the cost model (closed form, or the exact 1F1B timeline), trained with
    ``options`` (recomputation and sequence parallelism change the time; the optimizer's sharding does not)."""
    worst = 0.0
    for pipeline in plan.pipelines:
        fwd, bwd = [], []
        for j, stage in enumerate(pipeline.stages):
            c = stage_cost(spec, cost, num_layers=stage.num_layers, tp=stage.tp,
                           slowdown=max(cluster.slowdown(r) for r in stage.ranks), micro_batch=micro_batch,
                           first=stage.has_embedding, last=stage.has_output, in_flight=pipeline.pp - j,
                           recompute=options.recompute, sequence_parallel=options.sequence_parallel and stage.tp > 1,
                           cp=stage.cp)
            fwd.append(c.forward_s)
            bwd.append(c.backward_s)
        run = one_f_one_b if exact else pipeline_time_closed_form
        worst = max(worst, run(fwd, bwd, pipeline.num_microbatches))
    return worst


def work_bound_s(cluster: Cluster, spec: ModelSpec, *, micro_batch: int, num_microbatches: int,
                 cost: CostModel = CostModel()) -> float:
    """A lower bound on the predicted step time of every plan of every template and option set on ``cluster``:
    the whole batch's forward and backward FLOPs (every layer, the output layer; no recomputation, no TP
    all-reduce, no pipeline fill or drain, no memory limit) spread over every GPU at its own pace (``1 /
    slowdown``) and the best TP efficiency. Proof: under stage_cost a stage of TP t at slowdown x does its FLOPs
    at no more than ``t e_t F / x`` and recomputation and all-reduces only add time, so the GPUs' summed rates
    bound the work per second; the step time is at least the work over that rate."""
    whole = stage_cost(spec, cost, num_layers=spec.num_layers, tp=1, slowdown=1.0, micro_batch=micro_batch,
                       first=True, last=True, in_flight=1)
    flops = (whole.forward_s + whole.backward_s) * cost.flops_per_s * cost.tp_efficiency.get(1, 0.8)
    best = max([cost.tp_efficiency.get(1, 0.8), *cost.tp_efficiency.values()])
    rate = sum(cost.flops_per_s * best / cluster.slowdown(r) for r in range(cluster.world_size))
    return num_microbatches * flops / rate


def microbatch_bound_s(cluster: Cluster, spec: ModelSpec, *, micro_batch: int, num_microbatches: int,
                       cost: CostModel = CostModel(), tp_degrees: tuple[int, ...] = (1, 2, 4, 8),
                       cp_degrees: tuple[int, ...] = (1,)) -> float:
    """A lower bound on the predicted step time of every plan with one TP degree (every Malleus template, any
    option set), counting whole microbatches: tighter than :func:`work_bound_s` where the batch does not divide
    evenly over the GPUs.

    Proof, for TP t (``F`` = one microbatch's forward and backward through every layer at TP t, no slowdown, no
    recomputation: stage_cost's). A pipeline whose stages' TP groups run at slowdowns x_j has a fill (the sum of
    its stage times) of at least F and a bottleneck b with ``F <= b sum_j 1 / x_j`` (each stage's time is at least
    x_j times its share of F, x_j counting the slowdown on compute only: a slowdown does not slow the all-reduces);
    1F1B's ``(m - 1) b + fill <= T`` then gives ``m <= floor((T / F - 1) s) + 1``, s = sum_j 1 / x_j (m = 0 when
    T < F). A pipeline of p healthy groups takes at most ``floor((y - 1) p) + 1 <= p floor(y)`` (y = T / F;
    with y = n + f, ``floor((n - 1 + f) p) + 1 = (n - 1) p + floor(f p) + 1 <= n p``): at most floor(y) per
    group, so the healthy groups (at most the sum over nodes of floor(healthy GPUs / t)) take at most
    ``N floor(y)``; each GPU slower than 1 adds at most ``(y - 1) / x + 1`` (its share of a pipeline's s, and
    that pipeline's one extra microbatch). The least T
    where that reaches ``num_microbatches`` bounds every plan of TP t; the bound is the least over t. A CP degree
    c (``cp_degrees``) is the same argument for groups of ``t c`` GPUs with F at CP c."""
    best = float("inf")
    slow = [cluster.slowdown(r) for r in range(cluster.world_size) if cluster.slowdown(r) > 1.0]
    for t, c in _widths(cluster, spec, tp_degrees, cp_degrees):
        whole = stage_cost(spec, cost, num_layers=spec.num_layers, tp=t, slowdown=1.0, micro_batch=micro_batch,
                           first=True, last=True, in_flight=1, cp=c)
        f = whole.forward_s + whole.backward_s
        groups = sum(sum(1 for r in node if cluster.slowdown(r) <= 1.0) // (t * c) for node in cluster.nodes)
        # a slowdown x scales a layer's compute, not its all-reduce: a stage is at least x' = (x C + K) / (C + K)
        # times its share of F (C, K: a layer's compute and all-reduce seconds at TP t; the embedding and output
        # have no all-reduce, so their x' is x, larger)
        one, two = (stage_cost(spec, cost, num_layers=1, tp=t, slowdown=x, micro_batch=micro_batch, first=False,
                               last=False, in_flight=1, cp=c) for x in (1.0, 2.0))
        compute = (two.forward_s + two.backward_s) - (one.forward_s + one.backward_s)
        comm = (one.forward_s + one.backward_s) - compute
        effective = [(x * compute + comm) / (compute + comm) for x in slow]

        def taken(y: float) -> float:
            if y < 1.0:
                return 0.0
            return groups * math.floor(y + 1e-12) + sum((y - 1) / x + 1 for x in effective)

        hi = 1.0 + num_microbatches  # one group alone takes num_microbatches by y = 1 + num_microbatches
        if taken(hi) < num_microbatches:
            continue
        lo, _ = _bisect_level(taken, 0.0, hi, num_microbatches)  # a level that failed: the bound stays valid
        best = min(best, lo * f)
    return best
