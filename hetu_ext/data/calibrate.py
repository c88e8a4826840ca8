"""Fit the length cost ``t(s) = a s^2 + b s + c`` (seconds per layer) to measured times (pure numpy).

The times come from ``python -m hetu_ext.megatron.calibrate --out FILE``, which measures one Megatron-core
transformer layer on the device (hetu_ext/megatron/calibrate.py) and writes the cost table this fit gives.
The fit is linear least squares on ``(s^2, s, 1)`` weighted by ``1 / t`` (relative error), with a, b, c >= 0;
:func:`length_cost` adds the memory terms to make one TP degree's :class:`~hetu_ext.data.cost.LengthCost`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .cost import LengthCost


@dataclass(frozen=True)
class Fit:
    """Least-squares fit of ``a s^2 + b s + c`` to measured seconds."""

    a: float
    b: float
    c: float
    fitted_s: tuple[float, ...]
    """The fit at each measured length, seconds."""
    max_rel_error: float
    """max |fitted - measured| / measured over the measured lengths."""


def fit_length_cost(lengths: Sequence[int], seconds: Sequence[float]) -> Fit:
    """Fit ``a s^2 + b s + c`` (a, b, c >= 0) minimising the relative squared error; needs >= 3 distinct lengths.

    A coefficient the unconstrained fit makes negative is fixed at 0 and the others refitted (non-negative
    least squares by enumeration of the active set: 3 unknowns)."""
    s = np.asarray(lengths, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    if s.size != t.size or np.unique(s).size < 3 or np.any(t <= 0):
        raise ValueError(f"fit_length_cost: need >= 3 distinct lengths with positive times, got lengths "
                         f"{list(lengths)} and seconds {list(seconds)}")
    basis = np.stack([s * s, s, np.ones_like(s)], axis=1) / t[:, None]
    target = np.ones_like(t)
    best = None
    for mask in ((1, 1, 1), (1, 1, 0), (0, 1, 1), (1, 0, 1), (0, 1, 0), (1, 0, 0), (0, 0, 1)):
        cols = [k for k in range(3) if mask[k]]
        coef, *_ = np.linalg.lstsq(basis[:, cols], target, rcond=None)
        if np.any(coef < 0):
            continue
        full = np.zeros(3)
        full[cols] = coef
        err = float(np.sum((basis @ full - target) ** 2))
        if best is None or err < best[0] - 1e-15:
            best = (err, full)
    full = best[1]
    fitted = full[0] * s * s + full[1] * s + full[2]
    return Fit(a=float(full[0]), b=float(full[1]), c=float(full[2]), fitted_s=tuple(fitted.tolist()),
               max_rel_error=float(np.max(np.abs(fitted - t) / t)))


def length_cost(lengths: Sequence[int], seconds: Sequence[float], saved_bytes: Sequence[int], params: int,
                dtype_bytes: int = 4) -> tuple[LengthCost, Fit]:
    """One TP degree's cost from one layer's measurements at ``lengths`` (tokens, ascending): the fitted time
    (``seconds``: forward + backward, seconds), memory per token = the bytes the layer saves for backward at the
    longest length (``saved_bytes``) over that length (so it includes the s x s attention scores the local spec
    keeps there), fixed memory = ``params`` x ``dtype_bytes`` x 4 (weight, gradient, two Adam moments)."""
    fit = fit_length_cost(lengths, seconds)
    cost = LengthCost(a=fit.a, b=fit.b, c=fit.c, memory_per_token_bytes=saved_bytes[-1] / lengths[-1],
                      memory_fixed_bytes=params * dtype_bytes * 4)
    return cost, fit
