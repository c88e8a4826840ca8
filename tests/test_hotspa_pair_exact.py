"""benchmarks/hotspa_pair_exact.py, the exact two-strategy program behind the note on HotSPa's open row: its dual
bound is below every grouping over the two strategies, its grouping is a real one, and its packs are the fewest.
Checked against every grouping of small steps, enumerated (pure: no process group, a few seconds)."""

from __future__ import annotations

import itertools
import random

import pytest

from hetu_ext.data.cost import LengthCost
from hetu_ext.data.packing import ReplicaSpec


@pytest.fixture(scope="module")
def study():
    """The script as a module (imported lazily: it imports scipy's MILP solver)."""
    from benchmarks import hotspa_pair_exact

    return hotspa_pair_exact


def fewest_by_enumeration(lengths: list[int], cap: int) -> int:
    best = len(lengths)
    for labels in itertools.product(range(len(lengths)), repeat=len(lengths)):
        loads: dict[int, int] = {}
        for x, label in zip(lengths, labels):
            loads[label] = loads.get(label, 0) + x
        if max(loads.values()) <= cap:
            best = min(best, len(loads))
    return best


def test_fewest_packs_is_the_fewest_and_holds_every_sequence_once(study):
    rng = random.Random(0)
    for _ in range(40):
        cap = rng.choice([10, 16, 23])
        lengths = [rng.randint(1, cap) for _ in range(rng.randint(1, 6))]
        packs = study.fewest_packs(lengths, cap)
        assert sorted(i for p in packs for i in p) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in p) <= cap for p in packs)
        assert len(packs) == fewest_by_enumeration(lengths, cap), (lengths, cap)


def best_grouping_s(lengths: list[int], reps: list[ReplicaSpec], counts: list[int], study) -> float:
    """Every assignment of the sequences to the pipelines of both strategies (both groups at least one sequence per
    pipeline), each pipeline packed in the fewest packs and priced by the packer's model: the least T_1 + T_2."""
    pipes = [(t, r) for t in range(2) for r in range(counts[t])]
    best = float("inf")
    for labels in itertools.product(range(len(pipes)), repeat=len(lengths)):
        on = [[i for i, p in enumerate(labels) if p == q] for q in range(len(pipes))]
        if any(lengths[i] > reps[pipes[q][0]].token_capacity for q in range(len(pipes)) for i in on[q]):
            continue
        if any(sum(len(on[q]) for q in range(len(pipes)) if pipes[q][0] == t) < counts[t] for t in range(2)):
            continue
        times = [0.0, 0.0]
        for q, (t, _) in enumerate(pipes):
            packs = [[on[q][j] for j in p] for p in study.fewest_packs([lengths[i] for i in on[q]],
                                                                        reps[t].token_capacity)]
            times[t] = max(times[t], reps[t].time_s(packs, lengths))
        best = min(best, sum(times))
    return best


@pytest.mark.parametrize("seed", range(4))
def test_pair_program_bounds_every_grouping_and_its_grouping_is_real(study, seed):
    """TP 1-like (two pipelines, small packs, dearer per token) beside TP 2-like (one pipeline, packs twice as
    large): the program's dual bound is at most the best of every grouping, enumerated, and its own grouping is
    a real one (every sequence once, within its strategy's capacity, a sequence per pipeline at least), packed in
    the fewest packs at no less than that best."""
    rng = random.Random(seed)
    small = ReplicaSpec(stage_costs=(LengthCost(a=2e-4, b=0.02, c=0.05),), token_capacity=12)
    large = ReplicaSpec(stage_costs=(LengthCost(a=1e-4, b=0.011, c=0.05),), token_capacity=24)
    lengths = [rng.randint(1, 20) for _ in range(7)]
    lengths[0] = 20  # one sequence only the large strategy holds
    reps, counts = [small, large], [2, 1]
    best = best_grouping_s(lengths, reps, counts, study)
    bound, grouping = study.pair_program(lengths, reps, counts, time_limit_s=60)
    assert grouping is not None
    assert bound <= best * (1 + 1e-6), (bound, best)
    assert sorted(i for group in grouping for pipe in group for i in pipe) == list(range(len(lengths)))
    price = 0.0
    for t, group in enumerate(grouping):
        assert len([i for pipe in group for i in pipe]) >= counts[t]
        times = []
        for pipe in group:
            assert all(lengths[i] <= reps[t].token_capacity for i in pipe)
            packs = [[pipe[j] for j in p] for p in study.fewest_packs([lengths[i] for i in pipe],
                                                                      reps[t].token_capacity)]
            times.append(reps[t].time_s(packs, lengths))
        price += max(times)
    assert price >= best * (1 - 1e-9), (best, price)


def test_pair_program_is_exact_without_a_per_pack_cost(study):
    """With ``c = 0`` packs cost nothing, so nothing in the program is relaxed: its bound equals the best grouping,
    enumerated (a symmetry row that cut off a grouping would put it above)."""
    small = ReplicaSpec(stage_costs=(LengthCost(a=2e-4, b=0.02),), token_capacity=12)
    large = ReplicaSpec(stage_costs=(LengthCost(a=1e-4, b=0.011),), token_capacity=24)
    for lengths in ([20, 18, 11, 10, 9, 8, 7], [24, 12, 12, 5, 5, 4, 3]):
        best = best_grouping_s(lengths, [small, large], [2, 1], study)
        bound, _ = study.pair_program(lengths, [small, large], [2, 1], time_limit_s=60)
        assert bound == pytest.approx(best, rel=1e-6), lengths
