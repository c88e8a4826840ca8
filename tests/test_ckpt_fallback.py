"""Integrity on the training path: a corrupt latest checkpoint stops the load with the file's name on every rank;
with --hetu-ckpt-fallback the job resumes from the previous complete checkpoint instead. That previous one was
an asynchronous save (--save-interval 2: snapshot at step 2, written while steps 3-4 ran), so resuming from it and
training 2 steps must reproduce the uninterrupted run bit for bit (same plan): a snapshot that caught a later
step's weights or moments, or a lost data position, breaks exactness."""

from __future__ import annotations

import pytest
import torch
from test_ckpt_resume import SCHEDULE, _run
from helpers import gpt_argv

from hetu_ext.checkpoint.reader import ShardReader, latest_iteration, read_manifest
from hetu_ext.checkpoint.storage import LocalStorage
from hetu_ext.testing.multiproc import RankError


def test_corrupt_latest_is_reported_and_fallback_resumes_exactly(sample_prefix, tmp_path):
    ckpt = tmp_path / "ckpt"
    common = SCHEDULE + ("--train-iters", "4")
    full = _run(2, gpt_argv(2, 1, sample_prefix, common + ("--save", str(ckpt), "--save-interval", "2")))["final"]
    assert latest_iteration(LocalStorage(ckpt)) == 4
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000002", "iter_0000004"]
    # the second save reused the first one's host buffers: it must still hold step 4's state exactly
    stored = ShardReader(LocalStorage(ckpt), read_manifest(LocalStorage(ckpt), 4)).read_full()
    assert stored.keys() == full["tensors"].keys()
    assert all(torch.equal(stored[k], v) for k, v in full["tensors"].items())
    shard = ckpt / "iter_0000004" / "shard_00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) - 100] ^= 0x01  # one bit of tensor data
    shard.write_bytes(bytes(data))

    load = common + ("--load", str(ckpt))
    with pytest.raises(RankError, match=r"shard_00001\.safetensors: entry .* checksum mismatch"):
        _run(2, gpt_argv(2, 1, sample_prefix, load))
    with pytest.raises(RankError, match=r"other data settings \(saved, now\): \{'global_batch_size': \(8, 4\)\}"):
        _run(2, gpt_argv(2, 1, sample_prefix, load + ("--hetu-ckpt-fallback", "--global-batch-size", "4")))
    resumed = _run(2, gpt_argv(2, 1, sample_prefix, load + ("--hetu-ckpt-fallback",)))
    assert resumed["loaded"]["iteration"] == 2 and resumed["loaded"]["losses"] == full["losses"][:2]
    final = resumed["final"]
    assert final["losses"] == full["losses"]
    assert final["tensors"].keys() == full["tensors"].keys()
    assert all(torch.equal(v, full["tensors"][k]) for k, v in final["tensors"].items())
