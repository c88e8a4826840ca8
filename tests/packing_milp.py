"""Exact min-max assignment and packing by MILP (scipy's HiGHS), the reference for small packing tests only.

Variables: x[i, r, m] = 1 if document i is in microbatch m of replica r; y[r, m] = 1 if that microbatch is used;
tau[r, m] >= its time on every stage j (``a_j Q + b_j S + c_j y``); z[r] >= every tau[r, m]; T >= every replica's
``sum_m tau[r, m] + (pp_r - 1) z[r]``. Minimise T. Token capacity: ``sum_i s_i x[i, r, m] <= cap_r y[r, m]``;
microbatches used in order (``y[r, m] >= y[r, m + 1]``) to cut symmetry. Exact for the model of
hetu_ext.data.packing (an unused microbatch costs nothing, a used one its stage times).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from hetu_ext.data.packing import ReplicaSpec


def optimal_max_time(lengths: Sequence[int], replicas: Sequence[ReplicaSpec], *, max_microbatches: int | None = None,
                     time_limit_s: float = 20.0) -> float:
    """The least possible slowest-replica time (seconds); AssertionError if HiGHS does not prove optimality."""
    s = np.asarray(lengths, dtype=np.float64)
    n, nr = s.size, len(replicas)
    nm = max_microbatches or n
    nx = n * nr * nm
    def ix(i, r, m):
        return (i * nr + r) * nm + m

    def iy(r, m):
        return nx + r * nm + m

    def it(r, m):
        return nx + nr * nm + r * nm + m

    def iz(r):
        return nx + 2 * nr * nm + r

    nvar = nx + 2 * nr * nm + nr + 1
    rows, lo, hi = [], [], []

    def add(coeffs: dict[int, float], lower: float, upper: float) -> None:
        row = np.zeros(nvar)
        for k, v in coeffs.items():
            row[k] += v
        rows.append(row)
        lo.append(lower)
        hi.append(upper)

    for i in range(n):
        add({ix(i, r, m): 1.0 for r in range(nr) for m in range(nm)}, 1, 1)
    for r, spec in enumerate(replicas):
        for m in range(nm):
            add({**{ix(i, r, m): s[i] for i in range(n)}, iy(r, m): -spec.token_capacity}, -np.inf, 0)
            for i in range(n):
                add({ix(i, r, m): 1.0, iy(r, m): -1.0}, -np.inf, 0)
            for cost in spec.stage_costs:
                add({**{ix(i, r, m): cost.a * s[i] ** 2 + cost.b * s[i] for i in range(n)}, iy(r, m): cost.c,
                     it(r, m): -1.0}, -np.inf, 0)
            add({it(r, m): 1.0, iz(r): -1.0}, -np.inf, 0)
            if m + 1 < nm:
                add({iy(r, m + 1): 1.0, iy(r, m): -1.0}, -np.inf, 0)
        add({**{it(r, m): 1.0 for m in range(nm)}, iz(r): spec.pp - 1.0, nvar - 1: -1.0}, -np.inf, 0)
    integrality = np.zeros(nvar)
    integrality[:nx + nr * nm] = 1
    upper = np.full(nvar, np.inf)
    upper[:nx + nr * nm] = 1
    cost = np.zeros(nvar)
    cost[-1] = 1.0
    result = milp(cost, constraints=LinearConstraint(np.array(rows), lo, hi), integrality=integrality,
                  bounds=Bounds(np.zeros(nvar), upper), options={"time_limit": time_limit_s, "mip_rel_gap": 1e-7})
    assert result.status == 0, f"HiGHS did not prove optimality: {result.message}"
    return float(result.fun)
