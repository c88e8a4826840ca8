"""LobRA's deployment planner (pure): which replicas, of which shapes, to run many tenants' LoRA fine-tuning on.

Tenants' sequence lengths differ and are skewed per step; one replica shape is either too small for the longest
sequences or wasteful for the short ones. Given the cluster (GPUs, GPUs per node, memory per GPU), the model and
the tenants' length distributions and per-step shares, the planner chooses a *deployment*, a count of replicas
for each strategy (TP x PP), minimising the expected step time, as LobRA does:

1. **Strategy pool.** Every (tp, pp) with tp <= GPUs per node and pp dividing the layers; each strategy's
   per-layer time comes from the FLOP / all-reduce model of hetu_ext.plan.cost.stage (as a ``a s^2 + b s + c``
   LengthCost) and its token capacity from memory: frozen bf16 base weights (no gradients, no optimizer state:
   adapters are negligible) plus FlashAttention-style activations (34 h bytes per token and layer, divided by
   tp) for the microbatches 1F1B keeps in flight. Per TP degree only the fewest pipeline stages that fit, and the
   fewest that hold MIN_CAPACITY tokens, are kept (more stages add GPUs and bubbles, little capacity), and a
   strategy is pruned when another one of no more GPUs holds as many tokens at no higher GPU-seconds per token.
2. **Enumeration.** Every combination of pool strategies filling the GPUs (fewer idle GPUs than the smallest
   strategy) whose largest replica holds the longest sequence; each is scored by a capacity-aware lower bound
   (:func:`capacity_bound_s`), and the best few (and every homogeneous one) are evaluated exactly.
3. **Evaluation.** The existing two-stage assignment (hetu_ext.data.packing.assign, ``hetu``) of every sampled
   step's sequences over the deployment's replicas; the step time is the slowest replica's predicted time.

The same functions price the baselines: homogeneous replicas of the smallest strategy able to hold the longest
sequence with Megatron-style packs (``concat``: sequences laid end to end and cut every ``max_len`` tokens, each
piece attending to itself; ``concat-causal``: Megatron-LM's default, attention over the whole pack), and the
tenants trained one after another (each on all GPUs, on its own smallest strategy, Megatron-style packs).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hetu_ext.data.cost import CostTable, LengthCost, load_cost_table
from hetu_ext.data.lengths import concat_split
from hetu_ext.data.packing import ReplicaSpec, assign

from hetu_ext.plan.cost.stage import CostModel
from hetu_ext.plan.core.options import PLAIN, Options
from hetu_ext.model import inventory
from hetu_ext.model.spec import ModelSpec
from hetu_ext.plan.core.plan import Pipeline, Plan, Stage

DEGREES = (1, 2, 4, 8, 16)
MIN_CAPACITY = 1024
"""Fewest tokens a pool strategy must hold per microbatch (else more pipeline stages are tried)."""


@dataclass(frozen=True)
class Strategy:
    """One replica shape: ``tp`` x ``pp`` GPUs, what one microbatch may hold, its per-stage cost."""

    tp: int
    pp: int
    capacity: int
    """Most tokens of one microbatch (memory bound)."""
    replica: ReplicaSpec

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    @property
    def name(self) -> str:
        return f"TP{self.tp}PP{self.pp}"


@dataclass(frozen=True)
class TenantLengths:
    """A tenant as the planner sees it: a pool of its sequence lengths and its sequences per step."""

    name: str
    lengths: np.ndarray
    samples: int


@dataclass(frozen=True)
class Deployment:
    """Replicas per strategy, and the predicted mean step time of the tenants' batches on them."""

    counts: tuple[tuple[Strategy, int], ...]
    step_s: float

    @property
    def gpus(self) -> int:
        return sum(s.gpus * n for s, n in self.counts)

    def describe(self) -> str:
        return " + ".join(f"{n} x {s.name}" for s, n in self.counts if n)

    def replicas(self) -> list[ReplicaSpec]:
        return [s.replica for s, n in self.counts for _ in range(n)]


def layer_cost(spec: ModelSpec, cost: CostModel, tp: int, options: Options = PLAIN) -> LengthCost:
    """Forward + backward seconds and memory of one transformer layer at TP ``tp`` with a frozen base (LoRA).
    ``options``: recomputation adds the inventory's recomputed FLOPs (``full``: the forward's all-reduces too) and
    keeps its activations; sequence parallelism (TP > 1) splits the activations TP left whole (same all-reduce
    bytes); the distributed optimizer changes nothing (the frozen base has no optimizer state)."""
    h = spec.hidden_size
    eff = cost.tp_efficiency.get(tp, 0.8)
    rc = options.recompute
    b = (3 * inventory.layer_matmul_flops_per_token(spec)
         + inventory.layer_recompute_flops(spec, tokens=1.0, sum_sq=0.0, recompute=rc)) / (cost.flops_per_s * tp * eff)
    if tp > 1 and tp not in cost.tp_measured:  # 2 all-reduces of s x h forward, 2 backward, ring 2 (t-1)/t
        b += 2 * 2 * h * cost.dtype_bytes * 2 * (tp - 1) / tp / cost.intra_node_bytes_per_s * (1.5 if rc == "full"
                                                                                                 else 1.0)
    a = (3 * inventory.attention_flops_per_square_token(spec)
         + inventory.layer_recompute_flops(spec, tokens=0.0, sum_sq=1.0, recompute=rc)) / (cost.flops_per_s * tp * eff)
    per_token = inventory.activation_bytes_per_token(spec, tp=tp, attention_scores=False, recompute=rc,
                                                     sequence_parallel=options.sequence_parallel and tp > 1)
    return LengthCost(a=a, b=b, c=1e-4, memory_per_token_bytes=per_token * cost.dtype_bytes / 2,
                      memory_fixed_bytes=inventory.layer_params(spec, tp=tp) * cost.dtype_bytes)


def strategy_pool(spec: ModelSpec, cost: CostModel, *, gpu_memory_bytes: float, gpus_per_node: int,
                  max_gpus: int, prune: bool = True, table: CostTable | None = None,
                  min_capacity: int = MIN_CAPACITY, options: Options = PLAIN) -> list[Strategy]:
    """Every feasible (tp, pp) (holds >= 1 token per microbatch), dominated ones pruned (module docstring).
    ``options`` (FLOP model only): priced by :func:`layer_cost`; under full recomputation the one layer
    recomputing at a time holds its whole activations for a microbatch of up to ``spec.seq_length`` tokens, taken
    off the memory.
    ``table``: measured per-layer costs (python -m hetu_ext.cli.calibrate) used instead of the FLOP model for
    the TP degrees it has (others are skipped), with its own device memory when it gives one."""
    out = []
    if table is not None and table.device_memory_bytes is not None:
        gpu_memory_bytes = table.device_memory_bytes
    for tp, pp in itertools.product(DEGREES, DEGREES):
        if tp > gpus_per_node or tp * pp > max_gpus or spec.num_layers % pp or inventory.tp_problems(spec, tp):
            continue
        if table is not None and tp not in table.per_tp:
            continue
        layer = table.for_tp(tp) if table is not None else layer_cost(spec, cost, tp, options)
        stage = layer.times_layers(spec.num_layers // pp)
        memory = gpu_memory_bytes
        if table is None and options.recompute == "full":
            memory -= spec.seq_length * inventory.activation_bytes_per_token(
                spec, tp=tp, attention_scores=False, sequence_parallel=options.sequence_parallel and tp > 1
            ) * cost.dtype_bytes / 2
        capacity = int((memory - stage.memory_fixed_bytes) // (stage.memory_per_token_bytes * pp))
        if capacity < 1:
            continue
        out.append(Strategy(tp, pp, capacity, ReplicaSpec(stage_costs=(stage,) * pp, token_capacity=capacity)))
    if not prune:
        return out
    # pipeline stages add GPUs and bubbles but barely any capacity (1F1B keeps pp microbatches in flight on the
    # first stage): per TP degree keep the fewest stages holding MIN_CAPACITY tokens; then drop a strategy when
    # another of no more GPUs holds as many tokens at no higher GPU-seconds per token
    kept = []
    for tp in sorted({s.tp for s in out}):
        mine = sorted((s for s in out if s.tp == tp), key=lambda s: s.pp)
        kept.append(mine[0])  # the fewest stages that fit at all
        enough = [s for s in mine if s.capacity >= min_capacity]
        if enough and enough[0] is not mine[0]:
            kept.append(enough[0])  # and the fewest that hold min_capacity tokens

    def per_token_gpu_s(s: Strategy) -> float:
        return s.replica.stage_costs[0].b * s.gpus

    return [s for s in kept if not any(o is not s and o.gpus <= s.gpus and o.capacity >= s.capacity
                                       and per_token_gpu_s(o) <= per_token_gpu_s(s) for o in kept)]


def sample_steps(tenants: Sequence[TenantLengths], *, steps: int, seed: int, max_len: int
                 ) -> list[list[np.ndarray]]:
    """Per step, each tenant's sequence lengths (drawn from its pool, truncated to ``max_len``)."""
    rng = np.random.default_rng(seed)
    return [[np.minimum(rng.choice(t.lengths, size=t.samples), max_len).astype(np.int64) for t in tenants]
            for _ in range(steps)]


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


def smallest_holding(pool: list[Strategy], length: int) -> Strategy:
    """The strategy of fewest GPUs holding ``length`` tokens (ties: the fastest per token)."""
    fits = [s for s in pool if s.capacity >= length]
    if not fits:
        raise ValueError(f"no strategy holds a {length}-token sequence (largest capacity "
                         f"{max(s.capacity for s in pool)} tokens); lower the max length or use GPUs with more memory")
    return min(fits, key=lambda s: (s.gpus, s.replica.stage_costs[0].b * s.gpus))


def homogeneous_s(pool, batches, *, world_size: int, max_len: int, packing: str = "concat"
                  ) -> tuple[Strategy, float]:
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


def least_step_s(work: np.ndarray, solo: np.ndarray, world_size: int) -> float:
    """The least T with ``world_size x T >= sum over sequences of the least work[i, s] over the shapes s with
    solo[i, s] <= T`` (``work``, ``solo``: sequences x shapes, GPU-seconds and seconds alone, inf where a shape
    cannot hold the sequence): a step time bound when every sequence runs on a replica of some shape whose time is
    at least that sequence's alone and the GPUs' summed time covers every sequence's GPU-seconds.
    The allowed work only falls as T grows and the left side rises, so T is where they cross: over the sorted
    solo times ``ts``, ``W_k`` the work allowed at ``ts[k]``, the first k with ``ts[k] >= W_k / G`` gives
    ``min(ts[k], W_{k-1} / G)``."""
    ts = np.unique(solo[np.isfinite(solo)])

    def allowed(t: float) -> float:
        return float(np.where(solo <= t, work, np.inf).min(axis=1).sum())

    lo, hi = 0, ts.size - 1
    if ts[hi] < allowed(ts[hi]) / world_size:
        return allowed(ts[hi]) / world_size
    while lo < hi:  # the first k with ts[k] * G >= W_k
        mid = (lo + hi) // 2
        if ts[mid] * world_size >= allowed(ts[mid]):
            hi = mid
        else:
            lo = mid + 1
    return float(ts[lo]) if lo == 0 else min(float(ts[lo]), allowed(ts[lo - 1]) / world_size)


def work_bound_gpu_s(pool: list[Strategy], batches: list[list[np.ndarray]], *, world_size: int | None = None
                     ) -> float:
    """A certified lower bound on the mean GPU-seconds per step of ANY deployment and dispatch under this cost
    model: every whole sequence priced at the cheapest GPU-seconds any pool strategy gives it (``tp x pp x
    (a s^2 + b s)`` over its stages), with no per-microbatch constant, no pipeline bubble, no idle replica and no
    imbalance. Pass the unpruned pool (``strategy_pool(..., prune=False)``). ``1 - bound / homogeneous`` is the
    largest saving over homogeneous replicas that this cost model allows, whatever the planner does (a bound for
    dispatches of whole sequences, as LobRA's; Megatron-style packs cut sequences and are not covered).

    With ``world_size`` (the deployment's GPUs) it is tighter: a replica runs each of its sequences through every
    stage, so its time is at least that sequence alone (``pp (a s^2 + b s + c)``); a step of T seconds can only
    put a sequence on strategies holding it within T, and G x T must cover their least GPU-seconds
    (:func:`least_step_s`); the bound is G x that T per step."""
    totals = []
    for step in batches:
        x = np.concatenate(step).astype(np.float64)
        if world_size is None:
            per_gpu = [(s.gpus * s.replica.stage_costs[0].a, s.gpus * s.replica.stage_costs[0].b) for s in pool]
            totals.append(float(np.min([a * x * x + b * x for a, b in per_gpu], axis=0).sum()))
            continue
        work = np.full((x.size, len(pool)), np.inf)
        solo = np.full((x.size, len(pool)), np.inf)
        for k, s in enumerate(pool):
            held = x <= s.capacity
            stage = s.replica.stage_costs[0]
            work[:, k] = np.where(held, s.gpus * (stage.a * x * x + stage.b * x), np.inf)
            solo[:, k] = np.where(held, sum(c.a * x * x + c.b * x + c.c for c in s.replica.stage_costs), np.inf)
        totals.append(world_size * least_step_s(work, solo, world_size))
    return float(np.mean(totals))


def _fillings(pool: list[Strategy], world_size: int):
    """Counts per pool strategy using the GPUs with fewer idle than the smallest strategy needs."""
    smallest = min(s.gpus for s in pool)

    def rec(i: int, left: int):
        if i == len(pool):
            if left < smallest:
                yield ()
            return
        for n in range(left // pool[i].gpus, -1, -1):
            for rest in rec(i + 1, left - n * pool[i].gpus):
                yield (n, *rest)

    yield from rec(0, world_size)


def capacity_bound_s(lengths: np.ndarray, chosen: Sequence[tuple[Strategy, int]]) -> float:
    """A fast capacity-aware lower bound on a deployment's step time for ``lengths``: for every capacity level
    theta of the deployment, the sequences longer than theta can only run on replicas holding more than theta,
    and even perfectly divided over those replicas' speeds their work takes at least this long; also the longest
    sequence alone on the best replica that holds it. (hetu_ext.data.packing_bound prices all work on every
    replica, which is loose when only a few replicas hold the long sequences.)"""
    s = np.sort(lengths.astype(np.float64))
    sq, tokens = np.cumsum((s * s)[::-1])[::-1], np.cumsum(s[::-1])[::-1]  # suffix sums from each position
    stages = {id(st): st.replica.stage_costs[0] for st, _ in chosen}
    bound = min(stages[id(st)].a * s[-1] ** 2 + stages[id(st)].b * s[-1] + stages[id(st)].c
                for st, _ in chosen if st.capacity >= s[-1]) if s.size else 0.0
    for theta in [0] + sorted({st.capacity for st, _ in chosen}):
        first = int(np.searchsorted(s, theta, side="right"))
        if first >= s.size:
            break
        holders = [(st, n) for st, n in chosen if st.capacity > theta]
        if not holders:
            return float("inf")
        # price the work on a reference cost; replica r needs at least m_r = min(a_r / a_ref, b_r / b_ref) seconds
        # per reference second of any part of it, so T >= W_ref / sum_r (1 / m_r) however the work is divided
        ref = stages[id(holders[0][0])]
        work = ref.a * sq[first] + ref.b * tokens[first]
        speed = sum(n / min(stages[id(st)].a / ref.a, stages[id(st)].b / ref.b) for st, n in holders)
        bound = max(bound, work / speed)
    return bound


def plan_deployment(pool: list[Strategy], batches: list[list[np.ndarray]], *, world_size: int, max_len: int,
                    keep: int = 8, exchange_rounds: int = 16) -> Deployment:
    """The deployment minimising the mean step time of ``batches`` (module docstring, steps 2-3): every filling
    scored by :func:`capacity_bound_s` summed over the steps, the ``keep`` best (and every one-strategy filling)
    evaluated with the two-stage assignment, and the best mix of every two strategies
    (:func:`_two_strategy_mixes`); then the best is improved by trading one strategy's replicas for
    another's while that lowers the exact mean step time (:func:`_exchange`, at most ``exchange_rounds``
    trades)."""
    steps = [np.concatenate(step) for step in batches]
    longest = max(int(step.max()) for step in steps)
    scored = []
    for counts in _fillings(pool, world_size):
        chosen = tuple((s, n) for s, n in zip(pool, counts) if n)
        if not chosen or max(s.capacity for s, _ in chosen) < longest:
            continue
        scored.append((sum(capacity_bound_s(step, chosen) for step in steps), chosen))
    if not scored:
        raise ValueError(f"no deployment of {world_size} GPUs holds the longest sequence ({longest} tokens); "
                         "use more GPUs, GPUs with more memory, or a shorter max length")
    scored.sort(key=lambda item: item[0])
    candidates = [chosen for _, chosen in scored[:keep]] + [c for _, c in scored[keep:] if len(c) == 1]
    best = None
    for chosen in candidates:
        replicas = [s.replica for s, n in chosen for _ in range(n)]
        step = float(np.mean([joint_time_s(b, replicas) for b in steps]))
        if best is None or step < best.step_s:
            best = Deployment(counts=chosen, step_s=step)
    best = min([best, *_two_strategy_mixes(pool, steps, world_size=world_size, longest=longest)],
               key=lambda d: d.step_s)
    return _exchange(best, pool, steps, world_size=world_size, longest=longest, rounds=exchange_rounds)


def _two_strategy_mixes(pool: list[Strategy], steps: list[np.ndarray], *, world_size: int, longest: int
                        ) -> list[Deployment]:
    """Per pair of strategies (a, b), the best of the deployments of n replicas of b and the rest of the GPUs in
    a's, priced exactly on a coarse grid of n (about 9 points) and then every n within one grid step of its best
    (the mean step time is not monotone in n: a few larger replicas only help once they hold every long
    sequence)."""
    out = []
    smallest = min(s.gpus for s in pool)  # as _fillings: fewer idle GPUs than the smallest strategy needs

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


def _exchange(best: Deployment, pool: list[Strategy], steps: list[np.ndarray], *, world_size: int, longest: int,
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
    for strategy, n in sorted(deployment.counts, key=lambda item: -item[0].tp):
        per = num_layers // strategy.pp
        for _ in range(n):
            stages = []
            for p in range(strategy.pp):
                if rank % gpus_per_node + strategy.tp > gpus_per_node:
                    rank += gpus_per_node - rank % gpus_per_node  # not across a node boundary (never with powers of 2)
                stages.append(Stage(ranks=tuple(range(rank, rank + strategy.tp)), layer_start=p * per,
                                    layer_stop=(p + 1) * per, has_embedding=p == 0, has_output=p == strategy.pp - 1))
                rank += strategy.tp
            pipelines.append(Pipeline(stages=tuple(stages), num_microbatches=1))
    return Plan(pipelines=tuple(pipelines))


def lobra_cost_model(**overrides) -> CostModel:
    """hetu_ext.plan.cost.stage's A100-class defaults (bf16 weights), fields overridable."""
    return dataclasses.replace(CostModel(), **overrides)



def tenant_lengths(tenants, *, seed: int) -> list[TenantLengths]:
    """The planner's view of a tenants file (hetu_ext.config.tenants): each tenant's length pool from its
    ``lengths`` spec and its sequences per step (the mean of a ``samples`` schedule, at least 1)."""
    from hetu_ext.data.lengths import parse_length_spec

    out = []
    for t in tenants:
        if t.lengths is None:
            raise ValueError(f"tenant {t.name!r}: the planner reads sequence lengths from a 'lengths' spec; give one "
                             "that describes its data_path's documents (e.g. {mode: file, path: lengths.txt})")
        if t.samples is None:
            raise ValueError(f"tenant {t.name!r}: the planner needs 'samples' (sequences per step), not 'tokens'")
        lengths = np.asarray(parse_length_spec(dict(t.lengths)).sample(t.documents, seed + t.seed_offset))
        out.append(TenantLengths(t.name, np.maximum(lengths, 1).astype(np.int64),
                                 max(1, round(sum(t.samples) / len(t.samples)))))
    return out


def add_arguments(parser) -> None:
    """``python -m hetu_ext.plan lobra``'s flags."""
    parser.add_argument("--tenants", required=True, help="tenants file (YAML, as --hetu-lora-tenants)")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0, help="memory per GPU usable by a stage")
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length"):
        parser.add_argument(flag, type=int, required=True)
    parser.add_argument("--ffn-hidden-size", type=int, default=None)
    parser.add_argument("--vocab-size", type=int, default=50257)
    parser.add_argument("--steps", type=int, default=8, help="sampled steps the deployment is evaluated on")
    parser.add_argument("--cost-model", default=None, metavar="YAML",
                        help="measured per-layer costs (python -m hetu_ext.cli.calibrate) instead of the FLOP "
                             "model; its device_memory_bytes, when set, replaces --gpu-memory-gib")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--output", "-o", default=None, help="write the plan here (YAML, for --hetu-plan)")


def run(args) -> tuple[Plan, str]:
    """Plan a deployment for ``args`` (add_arguments' flags); the Plan and a report (table) to print."""
    from hetu_ext.config.tenants import load_tenants

    for flag in ("world_size", "gpus_per_node", "num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "steps"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    spec = ModelSpec(num_layers=args.num_layers, hidden_size=args.hidden_size,
                     num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
                     vocab_size=args.vocab_size, seq_length=args.seq_length)
    tenants = tenant_lengths(load_tenants(args.tenants), seed=args.seed)
    table = load_cost_table(args.cost_model) if args.cost_model else None
    pool = strategy_pool(spec, lobra_cost_model(), gpu_memory_bytes=args.gpu_memory_gib * 2**30,
                         gpus_per_node=args.gpus_per_node, max_gpus=args.world_size, table=table,
                         min_capacity=min(MIN_CAPACITY, args.seq_length))
    if not pool:
        raise ValueError(f"no (tp, pp) of at most {args.world_size} GPUs holds one token of this model in "
                         f"{args.gpu_memory_gib} GiB per GPU; use more GPUs or GPUs with more memory")
    batches = sample_steps(tenants, steps=args.steps, seed=args.seed, max_len=args.seq_length)
    best = plan_deployment(pool, batches, world_size=args.world_size, max_len=args.seq_length)
    strategy, homo = homogeneous_s(pool, batches, world_size=args.world_size, max_len=args.seq_length)
    seq = sequential_s(pool, batches, world_size=args.world_size, max_len=args.seq_length)
    plan = deployment_plan(best, num_layers=args.num_layers, gpus_per_node=args.gpus_per_node)
    n = args.world_size
    lines = ["strategy  GPUs  capacity (tokens)  replicas",
             "--------  ----  -----------------  --------"]
    chosen = dict((s.name, k) for s, k in best.counts)
    lines += [f"{s.name:<8}  {s.gpus:>4}  {s.capacity:>17}  {chosen.get(s.name, 0):>8}" for s in pool]
    lines += ["", f"deployment: {best.describe()} ({best.gpus} of {n} GPUs)",
              f"predicted step: LobRA {best.step_s:.3f} s ({best.step_s * n:.1f} GPU-s); homogeneous "
              f"{n // strategy.gpus} x {strategy.name}, Megatron-style packs {homo:.3f} s ({homo * n:.1f} GPU-s); "
              f"tenants one after another {seq:.3f} s ({seq * n:.1f} GPU-s)"]
    return plan, "\n".join(lines)
