"""Hydraulis's certified lower bound (pure): no single plan over the pool's shapes trains a step faster, and the
least switch from the home to any plan holding a shape."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hetu_ext.model import inventory
from hetu_ext.model.spec import ModelSpec
from hetu_ext.plan.core.replicas import ReplicaShape
from hetu_ext.plan.hotspa.relaxation import f_over_u
from hetu_ext.plan.lobra import least_step_s


def one_plan_bound_s(lengths: Sequence[int], pool: Sequence[ReplicaShape], world_size: int, *,
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


def _one_plan_prices(lengths: Sequence[int], pool: Sequence[ReplicaShape], world_size: int, upper_s: float | None
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


def _whole_replica_bound_s(work: np.ndarray, solo: np.ndarray, pool: Sequence[ReplicaShape], world_size: int, *,
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


def switch_floors_s(home_tp: int, home_pp: int, pool: Sequence[ReplicaShape], model: ModelSpec, *, bandwidth: float,
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
        if (shape.tp, shape.pp) == (home_tp, home_pp):  # (a CP shape's rank holds what its TP rank holds)
            floors.append(0.0)
            continue
        shared = min(L / shape.pp, L / home_pp) * min(1 / shape.tp, 1 / home_tp)
        into = max(0.0, L / shape.pp / shape.tp - shared)
        back = max(0.0, L / home_pp / home_tp - shared)
        floors.append((into * weight_bytes + back * grad_bytes) * split / bandwidth)
    return floors
