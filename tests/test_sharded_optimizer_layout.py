"""plan/core/optimizer_shards.py, pure (no process group): every element owned exactly once, by one of its holders, in
equal parts; ranges cut back into boxes exactly; the bytes figure is (n-1) x part per collective."""

from __future__ import annotations

import itertools
import math

import torch

from hetu_ext.plan.core.layout import ShardInfo
from hetu_ext.plan.core.optimizer_shards import flat_boxes, optimizer_shards


def test_flat_boxes_cover_a_flat_range_exactly():
    box = ((3, 7), (10, 15), (0, 6))  # (4, 5, 6) elements at offsets 3, 10, 0
    full = torch.arange(4 * 5 * 6).reshape(4, 5, 6)
    for start, stop in itertools.combinations(range(0, 121, 7), 2):
        got = torch.cat([full[tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(b_, box))].reshape(-1)
                         for b_ in flat_boxes(box, start, stop)])
        assert torch.equal(got, torch.arange(start, stop)), (start, stop)
        assert len(flat_boxes(box, start, stop)) <= 5


def _shard(rank, stage, tp_index, key, box, index=()):
    return ShardInfo(rank=rank, stage=stage, tp_index=tp_index, key=key, index=index, box=box)


def test_every_element_owned_once_by_a_holder_in_equal_parts():
    """Stage (0,0) = ranks 0,1 at TP 2; stage (1,0) = rank 2 at TP 1: a column-split weight, a replicated norm."""
    shards = [_shard(0, (0, 0), 0, "w", ((0, 8), (0, 5))), _shard(1, (0, 0), 1, "w", ((8, 16), (0, 5))),
              _shard(2, (1, 0), 0, "w", ((0, 16), (0, 5)))]
    shards += [_shard(r, s, t, "norm", ((0, 7),)) for r, s, t in ((0, (0, 0), 0), (1, (0, 0), 1), (2, (1, 0), 0))]
    layout = optimizer_shards(shards)
    owners: dict = {}
    for rank in range(3):
        for cell, box in layout.owned(rank):
            held = [s for s in shards if s.key == cell.key and s.rank == rank]
            assert any(all(a <= lo and hi <= b for (a, b), (lo, hi) in zip(s.box, box)) for s in held)
            for point in itertools.product(*(range(lo, hi) for lo, hi in box)):
                assert (cell.key, point) not in owners
                owners[(cell.key, point)] = rank
    assert len(owners) == 16 * 5 + 7
    sets = {s.ranks: s for s in layout.sets}
    assert set(sets) == {(0, 2), (1, 2), (0, 1, 2)}
    norm = sets[(0, 1, 2)]
    assert norm.reduce and norm.contributors == (frozenset({0, 2}),)  # rank 1 is stage (0,0)'s second copy
    for rank in range(3):
        assert layout.owned_numel(rank) <= layout.fair_numel(rank) + len(layout.sets_of(rank))
    # ring reduce-scatter + all-gather: (n-1) x ceil(B/n) elements each, per holder set
    assert layout.exchange_bytes(2, 4, 2) == (1 * 20 * 6) * 2 + 2 * math.ceil(7 / 3) * 6


def test_malleus_finds_plans_that_fit_only_with_a_sharded_optimizer():
    """A 32-layer 4096-wide model on 16 GPUs of 24 GiB: with Adam's 12 bytes per parameter replicated, one TP-4
    stage cannot hold all 32 layers, so Malleus needs 2 stages per pipeline; sharded over the 4 pipelines that
    hold each layer, the optimizer state is a quarter, the whole model fits a TP-4 group and the plan without
    pipeline bubbles is chosen (predicted faster)."""
    from hetu_ext.plan.core.cluster import Cluster
    from hetu_ext.plan.cost.stage import CostModel, stage_cost
    from hetu_ext.plan.malleus import plan_malleus
    from hetu_ext.model.spec import ModelSpec

    spec = ModelSpec(num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=16384,
                     vocab_size=50257, seq_length=2048)
    cluster = Cluster(world_size=16, gpus_per_node=8, gpu_memory_bytes=24 * 2**30, slowdowns={})
    plain = plan_malleus(cluster, spec, micro_batch=1, num_microbatches=32)
    sharded = plan_malleus(cluster, spec, micro_batch=1, num_microbatches=32, cost=CostModel(optimizer_sharded=True))
    assert {len(p.stages) for p in plain.plan.pipelines} == {2}
    assert {len(p.stages) for p in sharded.plan.pipelines} == {1} and len(sharded.plan.pipelines) == 4
    assert sharded.predicted_step_s < plain.predicted_step_s
    whole = {"num_layers": 32, "tp": 4, "slowdown": 1.0, "micro_batch": 1, "first": True, "last": True, "in_flight": 1}
    assert stage_cost(spec, CostModel(), **whole).memory_bytes > cluster.gpu_memory_bytes
    fits = stage_cost(spec, CostModel(optimizer_sharded=True), optimizer_holders=4, **whole).memory_bytes
    assert fits <= cluster.gpu_memory_bytes
    assert stage_cost(spec, CostModel(optimizer_sharded=True), **whole).memory_bytes > cluster.gpu_memory_bytes
