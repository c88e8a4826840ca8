"""The pure half of calibration (hetu_ext/data/calibrate.py): measurements in, one TP degree's LengthCost out.

The measuring half runs Megatron-core (hetu_ext/cli/calibrate.py; test_quiet.py runs its CLI end to end);
this checks, with no torch and no process group, that the memory terms it writes are what the docstrings say:
saved bytes at the longest length per token, and parameters x 4 fp32 copies. A table built from the shortest
length's bytes (too small by the s x s scores) or counting only weights and gradients would fail here.
"""

from __future__ import annotations

import pytest

from hetu_ext.data.calibrate import length_cost


def test_length_cost_time_fit_and_memory_terms():
    lengths = [128, 256, 512, 1024]
    seconds = [2e-9 * s * s + 3e-6 * s + 4e-3 for s in lengths]
    cost, fit = length_cost(lengths, seconds, saved_bytes=[1000, 2500, 7000, 20480], params=1000)
    assert (cost.a, cost.b, cost.c) == pytest.approx((2e-9, 3e-6, 4e-3), rel=1e-6)
    assert (cost.a, cost.b, cost.c) == (fit.a, fit.b, fit.c) and fit.max_rel_error < 1e-9
    assert cost.memory_per_token_bytes == 20480 / 1024
    assert cost.memory_fixed_bytes == 1000 * 4 * 4
    assert length_cost(lengths, seconds, [1, 1, 1, 1024], params=10, dtype_bytes=2)[0].memory_fixed_bytes == 80
    with pytest.raises(ValueError, match="need >= 3 distinct lengths"):
        length_cost([1, 1, 2], [1.0, 1.0, 2.0], [1, 1, 1], params=1)
