"""Pure tests of the plan's reduction layout (cells, lanes, owners, bytes) and pipeline neighbours."""

from __future__ import annotations

from hetu_ext.plan import load_plan
from hetu_ext.plan.core.layout import ShardInfo, in_place_lanes, reduction_layout
from hetu_ext.plan.core.plan import neighbours


def shard(rank, stage, tp_index, box, key="w", offset=0):
    return ShardInfo(rank=rank, stage=stage, tp_index=tp_index, key=key, index=(), box=box, offset=offset)


def test_tp2_replica_beside_tp1_replica():
    """Rows 0-3 at TP 2 on ranks 0, 1 (pipeline 0) and whole on rank 2 (pipeline 1); a layernorm-like tensor
    replicated on both TP ranks. Each half reduces over {its TP rank, 2}; the replicated tensor runs in two
    lanes so rank 2 sends it twice and each TP rank once: what the lanes cost, stated by send_bytes."""
    shards = [shard(0, (0, 0), 0, ((0, 2), (0, 3))), shard(1, (0, 0), 1, ((2, 4), (0, 3))),
              shard(2, (1, 0), 0, ((0, 4), (0, 3))),
              shard(0, (0, 0), 0, ((0, 5),), "ln"), shard(1, (0, 0), 1, ((0, 5),), "ln"),
              shard(2, (1, 0), 0, ((0, 5),), "ln")]
    layout = reduction_layout(shards)
    assert set(layout.lanes) == {(0, 2), (1, 2)}
    assert [c.box for c in layout.lanes[(0, 2)]] == [((0, 5),), ((0, 2), (0, 3))]
    assert [c.box for c in layout.lanes[(1, 2)]] == [((0, 5),), ((2, 4), (0, 3))]
    assert layout.send_bytes(0) == (5 + 6) * 4 and layout.send_bytes(2) == 2 * (5 + 6) * 4
    assert set(layout.owners.values()) == {0, 1} and sum(c.numel for c in layout.owners) == 12 + 5
    assert in_place_lanes(layout, shards) == set()  # rank 2 is in two lanes: it must pack


def test_one_stage_holding_an_element_needs_no_reduction():
    shards = [shard(0, (0, 0), 0, ((0, 4),)), shard(1, (0, 0), 1, ((0, 4),))]  # TP copies in one stage
    layout = reduction_layout(shards)
    assert layout.lanes == {} and layout.send_bytes(0) == 0


def test_uniform_data_parallel_lanes_reduce_in_place():
    shards = [shard(r, (r, 0), 0, ((0, 4),)) for r in range(3)]
    layout = reduction_layout(shards)
    assert list(layout.lanes) == [(0, 1, 2)]
    assert in_place_lanes(layout, shards) == {(0, 1, 2)}
    moved = [shard(0, (0, 0), 0, ((0, 4),), offset=8)] + shards[1:]
    assert in_place_lanes(layout, moved) == set()  # different buffer layouts must pack


def test_neighbours_across_tp_degrees(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("pipelines: [{stages: [{ranks: [0, 1], layers: [0, 1]}, {ranks: [2], layers: [1, 3]},"
                    " {ranks: [3, 4], layers: [3, 4]}]}]")
    plan = load_plan(path)
    n0, n1, n2, n3, n4 = (neighbours(plan, r) for r in range(5))
    assert n0.send_forward_to == (2,) and n1.send_forward_to == () and n2.recv_forward_from == 0
    assert n2.send_forward_to == (3, 4) and n3.recv_forward_from == 2 and n4.recv_forward_from == 2
    assert n3.send_backward_to == (2,) and n4.send_backward_to == () and n2.recv_backward_from == 3
    assert n2.send_backward_to == (0, 1) and n0.recv_backward_from == 2 and n1.recv_backward_from == 2
