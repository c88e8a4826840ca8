"""The reshard engine: any layout to any layout, bit-exact, local copies preferred, load spread, and an
incomplete source refused before anything moves."""

from __future__ import annotations

import pytest
import torch

from hetu_ext.testing.multiproc import RankError, run_ranks

FULL = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6) * 0.37


def _piece(box, with_data=True, like=None):
    from hetu_ext.runtime.reshard import Piece

    (r0, r1), (c0, c1) = box
    data = FULL[r0:r1, c0:c1].clone() if with_data else torch.full((r1 - r0, c1 - c0), float("nan"))
    return Piece("w", (), box, data)


def _body(rank, world, src_boxes, dst_boxes):
    from hetu_ext.runtime.reshard import reshard

    sources = [_piece(b) for b in src_boxes[rank]]
    dests = [_piece(b, with_data=False) for b in dst_boxes[rank]]
    report = reshard(sources, dests)
    for p in dests:
        (r0, r1), (c0, c1) = p.box
        assert torch.equal(p.tensor, FULL[r0:r1, c0:c1]), (rank, p.box)
    return report


def test_rows_to_columns_and_replicas():
    """TP 2 by rows on ranks 0, 1 plus a full replica on rank 2 -> rank 0 full, ranks 1, 2 by columns."""
    src = {0: [((0, 4), (0, 6))], 1: [((4, 8), (0, 6))], 2: [((0, 8), (0, 6))]}
    dst = {0: [((0, 8), (0, 6))], 1: [((0, 8), (0, 3))], 2: [((0, 8), (3, 6))]}
    reports = run_ranks(_body, 3, src, dst, timeout=60, preload=("torch",))
    assert reports[2].bytes_sent == 0  # rank 2 keeps its columns locally and others are served by 0 and 1
    assert reports[2].bytes_copied_locally == 8 * 3 * 4
    # rank 0 receives rows 4-8 (24 values, from rank 1); rank 1 holds rows 4-8 of its columns and receives rows
    # 0-4 of them (12 values) from rank 0, the least loaded holder at that point
    assert sum(r.bytes_sent for r in reports) == (4 * 6 + 4 * 3) * 4


def test_missing_elements_are_refused():
    src = {0: [((0, 4), (0, 6))], 1: []}
    dst = {0: [((0, 8), (0, 6))], 1: []}
    with pytest.raises(RankError, match=r"elements \(\(4, 8\), \(0, 6\)\) wanted by rank 0 are held by no rank"):
        run_ranks(_body, 2, src, dst, timeout=60, preload=("torch",))
