"""Malleus planner (pure): water-filling splits are optimal (brute force), memory is respected, stragglers are
planned around, infeasible inputs say what would fit; the 1F1B simulator against its closed form."""

from __future__ import annotations

import itertools
import random

import pytest

from hetu_ext.plan.core.cluster import Cluster
from hetu_ext.plan.cost.stage import CostModel, stage_cost
from hetu_ext.plan.malleus import balance_microbatches, plan_malleus, plan_step_s, predict_uniform, split_layers
from hetu_ext.model.spec import ModelSpec
from hetu_ext.plan.cost.simulate import one_f_one_b, pipeline_time_closed_form

SPEC = ModelSpec(num_layers=24, hidden_size=2048, num_attention_heads=16, vocab_size=50257, seq_length=2048)


def brute_layers(n, per_layer, fixed, caps):
    best = None
    for split in itertools.product(*(range(1, min(c, n) + 1) for c in caps)):
        if sum(split) == n:
            value = max(k * t + c for k, t, c in zip(split, per_layer, fixed))
            best = value if best is None else min(best, value)
    return best


def brute_microbatches(total, bottleneck, fill):
    best = None
    for split in itertools.product(range(total + 1), repeat=len(bottleneck)):
        if sum(split) == total:
            value = max((m - 1) * b + s for m, b, s in zip(split, bottleneck, fill) if m > 0)
            best = value if best is None else min(best, value)
    return best


@pytest.mark.parametrize("seed", range(60))
def test_layer_split_is_optimal_against_brute_force(seed):
    rng = random.Random(seed)
    p = rng.randint(1, 4)
    n = rng.randint(p, 9)
    per_layer = [rng.choice([1.0, 1.5, 2.0, 3.0, 5.0]) * rng.uniform(0.9, 1.1) for _ in range(p)]
    fixed = [rng.choice([0.0, 0.7, 2.5]) for _ in range(p)]
    caps = [rng.randint(1, 6) for _ in range(p)]
    split = split_layers(n, per_layer, fixed, caps)
    want = brute_layers(n, per_layer, fixed, caps)
    if want is None:
        assert split is None
        return
    assert sum(split) == n and all(1 <= k <= c for k, c in zip(split, caps))
    got = max(k * t + c for k, t, c in zip(split, per_layer, fixed))
    assert got == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("seed", range(60))
def test_microbatch_split_is_optimal_against_brute_force(seed):
    rng = random.Random(100 + seed)
    d = rng.randint(1, 4)
    total = rng.randint(1, 10)
    bottleneck = [rng.uniform(0.5, 6.0) for _ in range(d)]
    fill = [b * rng.randint(1, 4) + rng.uniform(0, 1) for b in bottleneck]
    split = balance_microbatches(total, bottleneck, fill)
    assert sum(split) == total and min(split) >= 0
    got = max((m - 1) * b + s for m, b, s in zip(split, bottleneck, fill) if m > 0)
    assert got == pytest.approx(brute_microbatches(total, bottleneck, fill), rel=1e-12)


def _peak_memory(plan, cluster, spec, micro_batch, cost):
    peak = 0.0
    for pipeline in plan.pipelines:
        for j, stage in enumerate(pipeline.stages):
            c = stage_cost(spec, cost, num_layers=stage.num_layers, tp=stage.tp, slowdown=1.0,
                           micro_batch=micro_batch, first=stage.has_embedding, last=stage.has_output,
                           in_flight=min(pipeline.pp - j, pipeline.num_microbatches))
            peak = max(peak, c.memory_bytes)
    return peak


@pytest.mark.parametrize("seed", range(12))
def test_plans_never_exceed_gpu_memory(seed):
    rng = random.Random(seed)
    world = rng.choice([8, 16, 32])
    memory = rng.choice([24, 40, 80]) * 2**30
    slow = {rng.randrange(world): rng.choice([1.5, 3.0, 5.0, 12.0]) for _ in range(rng.randint(0, 3))}
    cluster = Cluster(world_size=world, gpus_per_node=8, gpu_memory_bytes=memory, slowdowns=slow)
    result = plan_malleus(cluster, SPEC, micro_batch=1, num_microbatches=64)
    result.plan.validate(SPEC, world)
    assert _peak_memory(result.plan, cluster, SPEC, 1, CostModel()) <= memory
    assert result.plan.num_microbatches == 64
    for pipeline in result.plan.pipelines:
        for stage in pipeline.stages:
            assert len({cluster.node_of(r) for r in stage.ranks}) == 1  # TP stays inside a node


def test_a_5x_straggler_is_planned_around():
    cluster = Cluster(world_size=16, gpus_per_node=8, gpu_memory_bytes=80 * 2**30, slowdowns={3: 5.0})
    result = plan_malleus(cluster, SPEC, micro_batch=1, num_microbatches=64)
    uniform = predict_uniform(cluster, SPEC, tp=4, pp=2, micro_batch=1, num_microbatches=64)
    healthy = predict_uniform(Cluster(world_size=16, gpus_per_node=8, gpu_memory_bytes=80 * 2**30), SPEC, tp=4,
                              pp=2, micro_batch=1, num_microbatches=64)
    assert uniform > 3 * healthy  # the straggler sets the pace of Megatron's whole step
    assert result.predicted_step_s < uniform / 2
    assert result.predicted_step_s == pytest.approx(plan_step_s(result.plan, cluster, SPEC, micro_batch=1))
    # the straggler's group gets fewer layers than any healthy group of its pipeline, or is left unused
    where = result.plan.stage_of(3)
    if where is not None:
        stages = result.plan.pipelines[where[0]].stages
        assert stages[where[1]].num_layers < max(s.num_layers for s in stages)


def test_infeasible_memory_says_what_would_fit():
    cluster = Cluster(world_size=2, gpus_per_node=2, gpu_memory_bytes=4 * 2**30)
    with pytest.raises(ValueError) as err:
        plan_malleus(cluster, SPEC, micro_batch=4, num_microbatches=8)
    message = str(err.value)
    assert "no plan fits in 4.0 GiB per GPU" in message
    assert "use more GPUs, fewer layers per GPU, or a smaller micro batch than 4" in message


def test_cluster_rejects_bad_slowdowns():
    with pytest.raises(ValueError, match="slowdown of rank 1 is 0.5; slowdowns are >= 1.0"):
        Cluster(world_size=2, gpus_per_node=2, gpu_memory_bytes=1, slowdowns={1: 0.5})


@pytest.mark.parametrize("m", [1, 2, 5, 9])
def test_timeline_matches_closed_form_for_equal_stages_and_bounds_it_otherwise(m):
    assert one_f_one_b([1.0] * 4, [2.0] * 4, m) == pipeline_time_closed_form([1.0] * 4, [2.0] * 4, m)
    fwd, bwd = [1.0, 2.5, 0.5], [2.0, 5.0, 1.0]
    exact = one_f_one_b(fwd, bwd, m)
    assert m * max(f + b for f, b in zip(fwd, bwd)) <= exact <= pipeline_time_closed_form(fwd, bwd, m)


def test_replanning_prefers_plans_that_keep_layers_in_place():
    """Among plans within the tolerance of the fastest, the one moving the fewest layers wins (a cheaper
    migration): with a wide tolerance the running plan itself is kept although another template is faster."""
    from hetu_ext.plan.malleus import kept_in_place

    cluster = Cluster(world_size=16, gpus_per_node=8, gpu_memory_bytes=80 * 2**30, slowdowns={3: 5.0})
    running = plan_malleus(cluster, SPEC, micro_batch=1, num_microbatches=64, tp_degrees=(4,)).plan
    fastest = plan_malleus(cluster, SPEC, micro_batch=1, num_microbatches=64)
    assert fastest.plan != running and kept_in_place(fastest.plan, running) < kept_in_place(running, running)
    wide = plan_malleus(cluster, SPEC, micro_batch=1, num_microbatches=64, current=running, keep_tolerance=10.0)
    assert wide.plan == running
    tight = plan_malleus(cluster, SPEC, micro_batch=1, num_microbatches=64, current=running, keep_tolerance=0.0)
    assert tight.predicted_step_s == fastest.predicted_step_s
    # every used rank keeps all its layers when nothing changes
    assert kept_in_place(running, running) == sum(s.num_layers * s.tp for p in running.pipelines for s in p.stages)
