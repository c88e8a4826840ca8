"""The checkpoint format without a process group: shard files, manifest, who writes and reads what, commit and
retention, and corruption detection.

Corruption tests flip every single byte of small checkpoint files (not a sample): CRC-32 catches every burst of
up to 32 bits, so no flip may go undetected; a test that let one through would name the offset."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from safetensors.torch import load_file

from hetu_ext.checkpoint import manifest as mf
from hetu_ext.checkpoint.manifest import CheckpointError
from hetu_ext.checkpoint.reader import ShardReader, candidates, latest_iteration, read_manifest
from hetu_ext.checkpoint.selection import assign_reads, assign_writes, numel
from hetu_ext.checkpoint.shardfile import encode
from hetu_ext.checkpoint.storage import LocalStorage
from hetu_ext.checkpoint.writer import SaveConfig, complete_iterations, save_offline
from hetu_ext.runtime.reshard import Piece


def test_shard_file_is_plain_safetensors(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(4, dtype=torch.float64).to(torch.bfloat16),
               "c": torch.arange(7, dtype=torch.int64), "scalar": torch.tensor(2.5)}
    chunks, entries, size, _ = encode(tensors, {"k": "v"})
    path = tmp_path / "x.safetensors"
    assert LocalStorage(tmp_path).write("x.safetensors", chunks) == size == path.stat().st_size
    back = load_file(str(path))
    assert back.keys() == tensors.keys() and [e.entry for e in entries] == list(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v)


def _check_tiling(holdings, writes):
    """Every element of every tensor is written exactly once, by a rank that holds it."""
    for tensor in {t for h in holdings.values() for t, _, _ in h}:
        boxes = [b for h in holdings.values() for t, b, _ in h if t == tensor]
        shape = tuple(max(b[d][1] for b in boxes) for d in range(len(boxes[0])))
        count = torch.zeros(shape, dtype=torch.int32)
        for rank, cells in writes.items():
            for t, cell in cells:
                if t == tensor:
                    assert any(all(a <= c0 and c1 <= b for (a, b), (c0, c1) in zip(hb, cell))
                               for tt, hb, _ in holdings[rank] if tt == t)
                    count[tuple(slice(a, b) for a, b in cell)] += 1
        assert bool((count == 1).all()), tensor


def test_replicas_write_each_element_once_and_share_the_writing():
    # TP2 x DP2 for a column-split weight and a replicated norm; plus a TP3 copy (heterogeneous TP)
    w, n = ("param/w", (0,)), ("param/n", (0,))
    holdings = {0: [(w, ((0, 6), (0, 4)), 4), (n, ((0, 4),), 4)], 1: [(w, ((6, 12), (0, 4)), 4), (n, ((0, 4),), 4)],
                2: [(w, ((0, 6), (0, 4)), 4), (n, ((0, 4),), 4)], 3: [(w, ((6, 12), (0, 4)), 4), (n, ((0, 4),), 4)],
                4: [(w, ((0, 4), (0, 4)), 4)], 5: [(w, ((4, 8), (0, 4)), 4)], 6: [(w, ((8, 12), (0, 4)), 4)]}
    writes = assign_writes(holdings)
    _check_tiling(holdings, writes)
    written = {r: sum(numel(c) for _, c in cells) for r, cells in writes.items()}
    assert sum(written.values()) == 12 * 4 + 4
    assert max(written.values()) <= 16  # no rank gets more than the largest indivisible cell (4 x 4)
    assert sum(1 for v in written.values() if v) >= 5
    # pure replication (4 data-parallel copies of 4 equal tensors): each rank writes one whole tensor
    uniform = {r: [((f"param/t{i}", ()), ((0, 12), (0, 4)), 4) for i in range(4)] for r in range(4)}
    assert sorted(len(c) for c in assign_writes(uniform).values()) == [1, 1, 1, 1]


def test_random_layouts_tile_exactly():
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, 20), rng.randint(0, 4)))
        holdings = {}
        for rank in range(rng.randint(1, 6)):
            tp = rng.randint(1, 4)
            points = [0, *sorted(rng.sample(range(1, 20), tp - 1)), 20]
            t = rng.randrange(tp)
            holdings[rank] = [(("x", ()), ((points[t], points[t + 1]), (0, 3)), 2)]
        if {i for r in holdings.values() for _, b, _ in r for i in range(*b[0])} != set(range(20)):
            continue  # holdings must cover the tensor
        _check_tiling(holdings, assign_writes(holdings))
        del cuts


def test_each_shard_is_read_once_by_a_rank_that_needs_it():
    shards = [(i, ("w", ()), ((4 * i, 4 * i + 4),), 4) for i in range(3)]  # stored by 3 writers
    wants = {0: [(("w", ()), ((0, 6),))], 1: [(("w", ()), ((6, 12),))], 2: [(("w", ()), ((0, 12),))]}
    readers = assign_reads(shards, wants)
    # shard 1 ([4, 8)): rank 2 needs all of it, ranks 0 and 1 half; shards 0 and 2: a tie, broken by load
    assert readers == {0: 0, 1: 2, 2: 1}
    assert assign_reads(shards, {0: [(("w", ()), ((0, 4),))]}) == {0: 0}  # shards nobody needs are not read


def _pieces(world: int, tp: int, full: dict) -> list[list[Piece]]:
    """Rank r holds TP slice r % tp of every tensor (replicas across r // tp)."""
    out = []
    for r in range(world):
        mine = []
        for (name, index), t in full.items():
            rows = t.shape[0] // tp
            box = ((rows * (r % tp), rows * (r % tp + 1)),) + tuple((0, d) for d in t.shape[1:])
            mine.append(Piece(name, index, box, t[box[0][0]:box[0][1]].clone()))
        out.append(mine)
    return out


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {("param/w", (layer,)): torch.randn(8, 4, generator=g) for layer in range(2)} | {
        ("exp_avg/w", (0,)): torch.randn(8, 4, generator=g), ("param/b", ()): torch.randn(8, generator=g)}


def test_save_offline_round_trip_commit_and_retention(tmp_path):
    storage = LocalStorage(tmp_path)
    for it in (2, 4, 6):
        save_offline(storage, iteration=it, pieces_by_rank=_pieces(4, 2, _state(it)),
                     info={"consumed_samples": 8 * it, "state": {"step": it}}, config=SaveConfig(keep=2))
    assert latest_iteration(storage) == 6 and complete_iterations(storage) == [4, 6]
    assert not [n for n in storage.list("") if n.startswith(".")]
    manifest = read_manifest(storage, 6)
    assert manifest.consumed_samples == 48 and manifest.state == {"step": 6} and manifest.world_size == 4
    reader = ShardReader(storage, manifest)
    back = reader.read_full()
    assert back.keys() == _state(6).keys() and all(torch.equal(back[k], v) for k, v in _state(6).items())
    assert reader.bytes_read == sum(v.numel() * 4 for v in _state(6).values())  # replicas were written once
    assert candidates(storage, fallback=True) == [6, 4] and candidates(storage, fallback=False) == [6]


def test_every_flipped_byte_and_every_truncation_is_detected(tmp_path):
    storage = LocalStorage(tmp_path)
    save_offline(storage, iteration=1, pieces_by_rank=_pieces(2, 2, _state()), info={})
    directory = tmp_path / "iter_0000001"
    ShardReader(storage, read_manifest(storage, 1)).verify()
    for path in sorted(directory.iterdir()):
        original = path.read_bytes()
        for offset in itertools.chain(range(len(original)), [-1]):
            corrupt = original[:offset] if offset < 0 else \
                original[:offset] + bytes([original[offset] ^ 0x5A]) + original[offset + 1:]
            path.write_bytes(corrupt)
            with pytest.raises(CheckpointError) as err:
                ShardReader(storage, read_manifest(storage, 1)).verify()
            assert path.name in str(err.value), (offset, str(err.value))
        for cut in range(0, len(original), max(1, len(original) // 17)):
            path.write_bytes(original[:cut])
            with pytest.raises(CheckpointError, match=path.name):
                ShardReader(storage, read_manifest(storage, 1)).verify()
        path.write_bytes(original)
    ShardReader(storage, read_manifest(storage, 1)).verify()


def test_manifest_errors_name_the_rule():
    with pytest.raises(CheckpointError, match="not a hetu_ext manifest"):
        mf.from_bytes(b"{}", "m.json")
    with pytest.raises(CheckpointError, match="version v9 is not supported"):
        mf.from_bytes(b"hetu_ext-manifest v9 crc32=00000000\n{}", "m.json")
    with pytest.raises(CheckpointError, match="shards hold 4 elements but the tensor has 8"):
        mf.TensorRecord(name="x", index=(), shape=(8,), dtype="F32",
                        shards=(mf.ShardRecord(file="f", entry="e", box=((0, 4),), crc32=0),))
    with pytest.raises(ValueError, match="keep=0 must be >= 1"):
        SaveConfig(keep=0)
