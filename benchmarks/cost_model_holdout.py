"""How well the step model's two fitted knobs transfer: refit them on half of Narayanan et al.'s Table 1, predict the
other half.

    python -m benchmarks.cost_model_holdout [--table benchmarks/published/narayanan2021.csv]

The knobs: the level of the A100 GEMM efficiency curve (a factor k on the shipped curve) and
``hetu_ext.plan.cost.step_model.ELEMENTWISE_TRAFFIC`` (e). For each split (odd / even rows, small / large models), the
grid k in 0.80 .. 1.20, e in 0.5 .. 5.0 is searched for the smallest largest |error| on the fitting half, and the
largest |error| on the other half is printed. Pure and fast (a few seconds). Prints a table, ends with one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from benchmarks.common import Table, print_result
from hetu_ext.plan.cost import predict as cli
from hetu_ext.plan.cost import step_model
from hetu_ext.plan.cost.devices import load_device

SPLITS = {"odd rows -> even rows": ([0, 2, 4, 6, 8], [1, 3, 5, 7, 9]),
          "even rows -> odd rows": ([1, 3, 5, 7, 9], [0, 2, 4, 6, 8]),
          "5 smallest -> 5 largest": ([0, 1, 2, 3, 4], [5, 6, 7, 8, 9]),
          "5 largest -> 5 smallest": ([5, 6, 7, 8, 9], [0, 1, 2, 3, 4])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--table", default=str(Path(__file__).parent / "published" / "narayanan2021.csv"))
    args = parser.parse_args()
    rows = [cli.row_run(r, f"line {i}") for i, r in enumerate(cli.read_table(args.table), start=2)]
    if len(rows) != 10:
        print(f"error: the splits expect Table 1's 10 rows, {args.table} has {len(rows)}", file=sys.stderr)
        return 2
    base = load_device(rows[0][2])
    shipped = step_model.ELEMENTWISE_TRAFFIC

    def errors(k: float, e: float, idx: list[int]) -> list[float]:
        step_model.ELEMENTWISE_TRAFFIC = e
        device = dataclasses.replace(base, gemm_efficiency=tuple((x, y * k) for x, y in base.gemm_efficiency))
        return [step_model.predict(rows[i][0], rows[i][1], device).tflops_per_gpu / rows[i][3] - 1 for i in idx]

    grid = [(k / 100, e / 4) for k in range(80, 121, 2) for e in range(2, 21)]
    out = []
    splits = Table.of(("split", "<26"), ("k", ">5.2f"), ("e", ">5.2f"), ("fit max|err|", ">12.1%"),
                      ("held-out max|err|", ">17.1%"))
    splits.print_header()
    for name, (fit, test) in SPLITS.items():
        k, e = min(grid, key=lambda g: max(abs(x) for x in errors(*g, fit)))
        fit_err = max(abs(x) for x in errors(k, e, fit))
        held = max(abs(x) for x in errors(k, e, test))
        splits.print_row([name, k, e, fit_err, held])
        out.append({"split": name, "k": k, "e": e, "fit_max_error": round(fit_err, 4),
                    "held_out_max_error": round(held, 4)})
    step_model.ELEMENTWISE_TRAFFIC = shipped
    print_result({"splits": out})
    return 0


if __name__ == "__main__":
    sys.exit(main())
