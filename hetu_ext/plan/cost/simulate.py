"""Predicted step time of a plan: a 1F1B timeline per pipeline (pure).

Each stage runs Megatron's non-interleaved 1F1B order: ``w = min(pp - 1 - stage, m)`` warm-up forwards, then
alternating forward/backward, then ``w`` cool-down backwards. A forward waits for the previous stage's forward
of the same microbatch, a backward for the next stage's backward (plus ``p2p_s`` for the transfer). The step
time of a plan is its slowest pipeline's makespan.

:func:`pipeline_time_closed_form` is the planner's fast estimate, ``(m - 1) x max_j(F_j + B_j) + sum_j(F_j +
B_j)``: exact for equal stages, and a bound the timeline is checked against in the tests.
"""

from __future__ import annotations


def one_f_one_b(forward: list[float], backward: list[float], num_microbatches: int, p2p_s: float = 0.0) -> float:
    """Makespan (seconds) of one pipeline: per-stage forward/backward seconds of one microbatch."""
    p, m = len(forward), num_microbatches
    if p == 0 or m == 0:
        return 0.0
    orders = []
    for j in range(p):
        w = min(p - 1 - j, m)
        order = [("F", i) for i in range(w)]
        for i in range(m - w):
            order += [("F", w + i), ("B", i)]
        order += [("B", i) for i in range(m - w, m)]
        orders.append(order)
    done = {}
    free = [0.0] * p
    pos = [0] * p
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for j in range(p):
            while pos[j] < len(orders[j]):
                kind, i = orders[j][pos[j]]
                if kind == "F":
                    dep = done.get(("F", j - 1, i), None) if j > 0 else 0.0
                    cost = forward[j]
                else:
                    dep_b = done.get(("B", j + 1, i), None) if j < p - 1 else 0.0
                    dep_f = done.get(("F", j, i))
                    dep = None if dep_b is None or dep_f is None else max(dep_b, dep_f)
                    cost = backward[j]
                if dep is None:
                    break
                transfer = p2p_s if (kind == "F" and j > 0) or (kind == "B" and j < p - 1) else 0.0
                start = max(free[j], dep + transfer)
                free[j] = done[(kind, j, i)] = start + cost
                pos[j] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise AssertionError("1F1B timeline deadlocked; the schedule construction is wrong")
    return max(free)


def pipeline_time_closed_form(forward: list[float], backward: list[float], num_microbatches: int) -> float:
    if num_microbatches == 0:
        return 0.0
    per_stage = [f + b for f, b in zip(forward, backward)]
    return (num_microbatches - 1) * max(per_stage) + sum(per_stage)
