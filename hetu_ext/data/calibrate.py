"""Fit the length cost ``t(s) = a s^2 + b s + c`` (seconds per layer) to measured times (pure numpy); derive the
measured TP efficiencies the Malleus planner reads.

    python -m hetu_ext.data.calibrate --cost-table configs/calibration/cpu.yaml \
        --out configs/calibration/tp_efficiency_cpu.yaml [--tokens 4096]

The times come from ``python -m hetu_ext.cli.calibrate --out FILE``, which measures one Megatron-core
transformer layer on the device (hetu_ext/cli/calibrate.py) and writes the cost table this fit gives.
The fit is linear least squares on ``(s^2, s, 1)`` weighted by ``1 / t`` (relative error), with a, b, c >= 0;
:func:`length_cost` adds the memory terms to make one TP degree's :class:`~hetu_ext.data.cost.LengthCost`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from .cost import CostTable, LengthCost, load_cost_table


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


def tp_efficiency(table: CostTable, tokens: int) -> dict[int, float]:
    """Per measured TP degree t, ``T_1(s) / (t T_t(s))`` at ``tokens`` from the table's fitted layer times: the
    fraction of the t-fold speed-up one layer reached on the device, its all-reduces included (each degree of a
    table from ``hetu_ext.cli.calibrate`` is measured on t ranks, not derived). ValueError without TP 1."""
    one = table.for_tp(1).document_s(tokens)
    return {tp: round(one / (tp * cost.document_s(tokens)), 4) for tp, cost in sorted(table.per_tp.items())}


def save_tp_efficiency(table: CostTable, tokens: int, path: str | Path, source: str = "") -> dict[int, float]:
    """Write :func:`tp_efficiency` as the file :func:`hetu_ext.plan.cost.stage.load_tp_efficiency` reads."""
    eff = tp_efficiency(table, tokens)
    note = (f"T_1 / (t T_t) of one layer at {tokens} tokens, from the fitted cost table {source or '(given)'}; "
            f"all-reduces included; {table.note}")
    Path(path).write_text(yaml.safe_dump({"device": table.device, "tp_efficiency": eff, "note": note},
                                         sort_keys=False))
    return eff


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hetu_ext.data.calibrate",
                                     description="TP efficiencies of a device from its measured cost table")
    parser.add_argument("--cost-table", required=True, help="the table python -m hetu_ext.cli.calibrate "
                        "wrote (with --tp 1,2,...)")
    parser.add_argument("--out", required=True, help="YAML file for the efficiencies (read by --tp-efficiency)")
    parser.add_argument("--tokens", type=int, default=4096, help="sequence length the efficiency is taken at")
    args = parser.parse_args(argv)
    try:
        table = load_cost_table(args.cost_table)
        eff = save_tp_efficiency(table, args.tokens, args.out, source=args.cost_table)
    except ValueError as exc:
        parser.exit(2, f"error: {exc}\n")
    if len(eff) < 2:
        print(f"warning: {args.cost_table} holds TP {sorted(eff)} only; measure more degrees with "
              "python -m hetu_ext.cli.calibrate --tp 1,2")
    print(f"device: {table.device}")
    for tp, e in eff.items():
        print(f"TP {tp}: efficiency {e:.3f} at {args.tokens} tokens")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
