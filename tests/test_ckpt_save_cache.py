"""Checkpointer.save reuses its write plan only while no rank's layout changes.

Three gloo ranks save one directory several times with one Checkpointer each. A save of an unchanged layout
(new tensors, new values) reuses the plan (one int64 all-gather instead of the metadata gather); a change of
any one rank's pieces, a rank whose Checkpointer is new (no cached plan), or a process that changed rank makes
every rank gather and assign anew. Every checkpoint is read back whole and compared with the state saved."""

from __future__ import annotations

import torch

from hetu_ext.checkpoint.reader import ShardReader, read_manifest
from hetu_ext.checkpoint.storage import LocalStorage
from hetu_ext.checkpoint.writer import Checkpointer, SaveConfig
from hetu_ext.runtime.reshard import Piece
from hetu_ext.testing.multiproc import run_ranks

ROWS = {"a": [(0, 6), (6, 12), (0, 12)],  # rank 0 the top half, rank 1 the bottom, rank 2 all
        "b": [(0, 12), (0, 6), (6, 12)],  # every rank's rows changed
        "c": [(0, 12), (0, 6), (0, 12)]}  # only rank 2's rows changed (from "b")


def _state(iteration: int) -> dict:
    g = torch.Generator().manual_seed(iteration)
    return {("param/w", (0,)): torch.randn(12, 8, generator=g), ("exp_avg/w", (0,)): torch.randn(12, 8, generator=g),
            ("param/norm", ()): torch.randn(8, generator=g)}


def _pieces(rank: int, iteration: int, layout: str) -> list[Piece]:
    rows = ROWS[layout][rank]
    out = []
    for (name, index), t in _state(iteration).items():
        box = (rows, (0, 8)) if t.dim() == 2 else ((0, 8),)
        out.append(Piece(name, index, box, t[tuple(slice(a, b) for a, b in box)].clone()))
    return out


# (iteration, layout, ranks that start a new Checkpointer before this save, whether the plan may be reused)
SAVES = [(1, "a", (), False), (2, "a", (), True), (3, "a", (), True), (4, "b", (), False), (5, "b", (), True),
         (6, "c", (), False), (7, "c", (1,), False), (8, "c", (), True)]


def save_body(rank: int, world: int, root: str) -> list[dict]:
    saver, out = None, []
    for iteration, layout, fresh, _ in SAVES:
        if saver is None or rank in fresh:
            saver = Checkpointer(LocalStorage(root), SaveConfig(keep=len(SAVES)))
        saver.save(iteration=iteration, pieces=_pieces(rank, iteration, layout), rng={"rank": rank},
                   info={"consumed_samples": iteration}, blocking=True)
        out.append(dict(saver.last))
    return out


def test_a_changed_layout_invalidates_the_cached_write_plan(tmp_path):
    lasts = run_ranks(save_body, 3, str(tmp_path), timeout=120)
    for i, (iteration, layout, _, reused) in enumerate(SAVES):
        assert [r[i]["cached"] for r in lasts] == [float(reused)] * 3, (iteration, layout)
        if reused:
            assert all(r[i]["gather_s"] == 0 and r[i]["assign_s"] == 0 for r in lasts)
        storage = LocalStorage(tmp_path)
        manifest = read_manifest(storage, iteration)
        back = ShardReader(storage, manifest).read_full()
        want = _state(iteration)
        assert back.keys() == want.keys() and all(torch.equal(back[k], v) for k, v in want.items()), iteration
        # each element written once: the shards of a tensor tile it exactly
        for t in manifest.tensors:
            count = torch.zeros(t.shape, dtype=torch.int32)
            for s in t.shards:
                count[tuple(slice(a, b) for a, b in s.box)] += 1
            assert bool((count == 1).all()), (iteration, t.name)
        # the assignment is that of the layout (a stale plan would write another rank's cells)
        written = {r: sum(s.box[0][1] - s.box[0][0] for t in manifest.tensors if t.name == "param/w"
                          for s in t.shards if s.file == f"shard_{r:05d}.safetensors") for r in range(3)}
        assert sum(written.values()) == 12, (iteration, written)
        for r, rows in written.items():
            lo, hi = ROWS[layout][r]
            assert rows <= hi - lo, (iteration, r, written)


def swap_body(rank: int, world: int, root: str) -> list[float]:
    """Two ranks holding the same pieces; before the second save they swap their cached plans, as processes that
    changed rank (same layout, same world size) would hold them."""
    import torch.distributed as dist

    saver = Checkpointer(LocalStorage(root), SaveConfig(keep=3))
    pieces = _pieces(2, 1, "a")  # both hold everything: the assignment depends on the rank alone
    saver.save(iteration=1, pieces=pieces, rng={}, info={}, blocking=True)
    first = saver.last["cached"]
    plans: list = [None] * world
    dist.all_gather_object(plans, saver._plan)
    saver._plan = plans[1 - rank]
    saver.save(iteration=2, pieces=pieces, rng={}, info={}, blocking=True)
    second = saver.last["cached"]
    saver.save(iteration=3, pieces=pieces, rng={}, info={}, blocking=True)
    return [first, second, saver.last["cached"]]


def test_a_process_that_changed_rank_does_not_reuse_its_plan(tmp_path):
    out = run_ranks(swap_body, 2, str(tmp_path), timeout=60)
    assert out == [[0.0, 0.0, 1.0]] * 2
    storage = LocalStorage(tmp_path)
    for iteration in (2, 3):
        manifest = read_manifest(storage, iteration)
        assert {s.file for t in manifest.tensors for s in t.shards} == {"shard_00000.safetensors",
                                                                        "shard_00001.safetensors"}
        back = ShardReader(storage, manifest).read_full()
        assert all(torch.equal(back[k], v) for k, v in _state(1).items())
