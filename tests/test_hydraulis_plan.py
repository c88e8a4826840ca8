"""Hydraulis's planning side (pure, hetu_ext/plan/hydraulis/): the dynamic program over (GPUs, longest
sequence) equals exhaustive search on small clusters, per-step selection equals brute force over the candidates,
the candidates are valid plans over the same ranks with the homogeneous home, and the planning CLI writes a
strategies file HotSPa's loader reads back (bad input: one line, exit 2)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hetu_ext.data.cost import CostTable, LengthCost
from hetu_ext.plan.hotspa import load_strategies
from hetu_ext.plan import ModelSpec
from hetu_ext.plan.__main__ import main as plan_main
from hetu_ext.plan.hydraulis import (
    Selector,
    candidate_strategies,
    group_cost,
    length_histogram,
    one_plan_bound_s,
    select_candidate,
    shape_pool,
    solve,
    switch_floors_s,
)
from hetu_ext.plan.core.plan import uniform_shape

MODEL = ModelSpec(num_layers=8, hidden_size=64, num_attention_heads=8, ffn_hidden_size=128, vocab_size=256,
                  seq_length=512)
SHORT = 192
"""Longest sequence of the candidate, selection and CLI tests (4 GPUs of the test cost table hold 224 tokens)."""


def _cost(seed: int, memory: float = 2.0e6) -> CostTable:
    """Per-TP costs with random speeds and a memory that gives the shapes different capacities (TP 1 on one
    stage holds about 60 tokens, deeper and wider shapes more)."""
    rng = np.random.default_rng(seed)
    per_tp = {}
    for tp in (1, 2, 4, 8):
        eff = rng.uniform(0.6, 1.0)
        per_tp[tp] = LengthCost(a=1e-7 / (tp * eff), b=rng.uniform(1e-5, 3e-5) / (tp * eff),
                                c=rng.uniform(1e-4, 1e-3), memory_per_token_bytes=4000.0 / tp,
                                memory_fixed_bytes=(1.0e5 + rng.uniform(0, 1e4)) / tp)
    return CostTable(per_tp=per_tp, device="test", device_memory_bytes=memory)


def _lengths(seed: int, n: int = 400, max_len: int = 512) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(4.0, 1.1, n).astype(np.int64), 1, max_len)


def _exhaustive(pool, hist, j: int, gpus: int) -> float:
    """min over every cut of buckets 1..j into contiguous groups and every (shape, replicas) per group using at
    most ``gpus`` GPUs, of the slowest group: plain enumeration, no table."""
    cq = np.concatenate([[0.0], np.cumsum(hist.squares)])
    cs = np.concatenate([[0.0], np.cumsum(hist.tokens)])
    best = math.inf

    def rec(start: int, left: int, worst: float) -> None:
        nonlocal best
        if start == j:
            best = min(best, worst)
            return
        for stop in range(start + 1, j + 1):
            m = float(hist.longest[stop - 1])
            q, s = cq[stop] - cq[start], cs[stop] - cs[start]
            for shape in pool:
                if shape.capacity < m:
                    continue
                for d in range(1, left // shape.gpus + 1):
                    rec(stop, left - d * shape.gpus, max(worst, float(group_cost(shape, q, s, m, float(d)))))

    rec(0, gpus, 0.0)
    return best


@pytest.mark.parametrize("gpus,seed", [(1, 0), (2, 1), (3, 2), (4, 3), (6, 4), (8, 5)])
def test_dynamic_program_equals_exhaustive_search(gpus, seed):
    cost = _cost(seed)
    pool = shape_pool(MODEL, cost, world_size=gpus, max_len=512, gpus_per_node=4 if seed % 2 else 8,
                      prune=seed % 2 == 0, cp_degrees=(1, 2) if seed == 2 else (1,))  # exhaustive: a small pool
    assert gpus == 1 or len({s.capacity for s in pool}) > 1, "the test needs shapes of different capacities"
    hist = length_histogram(_lengths(seed), max_len=512, edges=[s.capacity for s in pool], buckets=4)
    assert 3 <= len(hist) <= 12
    solutions = solve(pool, hist, gpus)
    for j, sol in enumerate(solutions, start=1):
        expected = _exhaustive(pool, hist, j, gpus)
        if sol is None:
            assert expected == math.inf
            continue
        assert sol.time_s == pytest.approx(expected, rel=1e-12)
        # the traced groups are a cut of buckets 1..j within the GPUs, each held by its shape, with that time
        assert [g[2] for g in sol.groups] == [0] + [g[3] for g in sol.groups[:-1]] and sol.groups[-1][3] == j
        assert sum(d * pool[k].gpus for k, d, _, _ in sol.groups) <= gpus
        times = []
        for k, d, i, stop in sol.groups:
            assert pool[k].capacity >= hist.longest[stop - 1]
            times.append(float(group_cost(pool[k], hist.squares[i:stop].sum(), hist.tokens[i:stop].sum(),
                                          hist.longest[stop - 1], float(d))))
        assert max(times) == pytest.approx(sol.time_s, rel=1e-9)


def test_pruning_keeps_the_optimum():
    base = _cost(7)  # TP 2 no faster and no roomier than TP 1: every TP 2 shape is dominated by its TP 1 twin
    cost = CostTable(per_tp={**base.per_tp, 2: base.per_tp[1]}, device="test", device_memory_bytes=2.0e6)
    full = shape_pool(MODEL, cost, world_size=8, max_len=512, prune=False)
    pruned = shape_pool(MODEL, cost, world_size=8, max_len=512)
    assert {s.tp for s in full} >= {1, 2} and 2 not in {s.tp for s in pruned}
    assert all(s in full for s in pruned)
    for lengths_seed in (0, 1):
        hist = length_histogram(_lengths(lengths_seed), max_len=512, edges=[s.capacity for s in full], buckets=8)
        a, b = solve(full, hist, 8), solve(pruned, hist, 8)
        assert [x and round(x.time_s, 12) for x in a] == [x and round(x.time_s, 12) for x in b]


@pytest.mark.parametrize("gpus,seed", [(4, 0), (8, 2), (16, 0)])
def test_candidates_are_plans_over_the_ranks_with_a_homogeneous_home(gpus, seed):
    cost = _cost(seed)
    lengths = np.minimum(_lengths(seed, n=2000), SHORT)
    st = candidate_strategies(MODEL, gpus, cost, lengths, max_len=SHORT, gpus_per_node=8, limit=6,
                              batch_tokens=64 * 512)
    assert 2 <= len(st.items) <= 6 and len({s.name for s in st.items}) == len(st.items)
    assert [s.max_len for s in st.items] == sorted(s.max_len for s in st.items)
    home = st.items[st.home]
    assert uniform_shape(home.plan) is not None and home.max_len == max(s.max_len for s in st.items)
    assert home.max_len >= int(lengths.max())
    for s in st.items:
        s.plan.validate(MODEL, gpus)
        assert s.plan.world_size == gpus
        assert s.max_len == max(r.token_capacity for r in Selector(st, MODEL, cost, bandwidth=1e9)
                                .replicas[st.items.index(s)])
    assert any(not s.plan.is_uniform for s in st.items), "expected a heterogeneous candidate"


def test_selection_equals_brute_force_over_the_candidates():
    rng = np.random.default_rng(0)
    sets = [candidate_strategies(MODEL, gpus, _cost(seed), _lengths(seed, n=2000), max_len=SHORT, limit=limit,
                                 batch_tokens=tokens)
            for gpus, seed, limit, tokens in ((4, 0, 4, 16 * 512), (8, 2, 6, 32 * 512), (16, 0, 8, 64 * 512))]
    chosen = set()
    for st, seed in zip(sets, (0, 2, 0)):
        sel = Selector(st, MODEL, _cost(seed), bandwidth=rng.uniform(1e8, 1e10))
        for _ in range(6):
            n = int(rng.integers(8, 60))
            top = int(rng.choice([48, 96, 128, SHORT]))
            batch = np.clip(rng.lognormal(3.5, 1.2, n).astype(np.int64), 1, top).tolist()
            k, t, packed = sel.choose(batch)
            able = [j for j, s in enumerate(st.items) if s.max_len >= max(batch) and len(s.plan.pipelines) <= n]
            exact = {j: sel.exact(j, batch) for j in able}
            prices = {j: exact[j] + sel.switch_s[j] for j in able}
            assert all(sel.estimate(j, batch) <= exact[j] * (1 + 1e-9) for j in able)
            best = min(prices.values())
            assert t == pytest.approx(best, rel=1e-12) and k == min(j for j in able if prices[j] == best)
            assert packed is not None and max(packed.predicted_s) + sel.switch_s[k] == pytest.approx(t)
            kb, tb, packed_b = sel.choose(batch, exact=False)  # the cheaper choice: the lowest bound + switch
            bounds = {j: sel.estimate(j, batch) + sel.switch_s[j] for j in able}
            assert kb == min(j for j in able if bounds[j] == min(bounds.values()))
            assert tb == pytest.approx(prices[kb]) and tb >= t and max(packed_b.predicted_s) == exact[kb]
            chosen.add((id(st), k))
    assert len(chosen) > len(sets), "the batches should pick more than one candidate per set"


def test_one_plan_bound_is_below_every_candidate_and_binds_when_only_the_whole_cluster_holds_the_longest():
    """one_plan_bound_s (the certified limit of one-plan-per-step selection that benchmarks/hydraulis.py prints)
    is at most the packer's time of every candidate holding the step's longest sequence (with the switch floors
    and whole replicas: at most its time plus its switch), and when only shapes of all the GPUs hold it, it
    counts those shapes alone."""
    rng = np.random.default_rng(3)
    forced_seen = tightened = 0
    for gpus, seed in ((4, 0), (8, 2), (16, 1)):
        cost = _cost(seed)
        st = candidate_strategies(MODEL, gpus, cost, _lengths(seed, n=2000), max_len=SHORT, limit=8,
                                  batch_tokens=gpus * 8 * 512)
        pool = shape_pool(MODEL, cost, world_size=gpus, max_len=SHORT, prune=False)
        sel = Selector(st, MODEL, cost, bandwidth=1e9)
        home = st.items[st.home].plan.pipelines[0]
        floors = switch_floors_s(home.stages[0].tp, home.pp, pool, MODEL, bandwidth=1e9)
        assert all(f >= 0 for f in floors) and 0.0 in floors
        for _ in range(8):
            n = int(rng.integers(8, 60))
            batch = np.clip(rng.lognormal(3.5, 1.2, n).astype(np.int64), 1, SHORT).tolist()
            bound = one_plan_bound_s(batch, pool, gpus)
            able = [j for j, s in enumerate(st.items) if s.max_len >= max(batch) and len(s.plan.pipelines) <= n]
            exact = [sel.exact(j, batch) for j in able]
            assert exact and all(bound <= t * (1 + 1e-9) for t in exact)
            assert bound >= 0.5 * min(exact), "the bound should not be trivially loose"
            # with the candidates' best as the known price U (every pipelined replica's fill counted), and with
            # U above it: still below every candidate, and never looser than without U
            for upper in (min(exact), max(exact)):
                tighter = one_plan_bound_s(batch, pool, gpus, upper_s=upper)
                assert tighter <= min(exact) * (1 + 1e-9) and tighter >= min(bound, upper) * (1 - 1e-9)
            # with each shape's switch floor from the home, and with whole replicas: compute plus switch stays
            # below every candidate's, and each step only tightens it
            with_switch = [t + sel.switch_s[j] for t, j in zip(exact, able)]
            upper = min(exact)
            switched = one_plan_bound_s(batch, pool, gpus, upper_s=upper, switch_s=floors)
            whole = one_plan_bound_s(batch, pool, gpus, upper_s=upper, switch_s=floors, whole_replicas=True)
            assert min(bound, upper) * (1 - 1e-9) <= switched <= whole * (1 + 1e-9)
            assert whole <= min(with_switch) * (1 + 1e-9)
            tightened += whole > switched * (1 + 1e-6)
            holders = [s for s in pool if s.capacity >= max(batch)]
            if all(s.gpus == gpus for s in holders):  # the plan is one replica of all the GPUs
                forced_seen += 1
                assert bound == one_plan_bound_s(batch, holders, gpus)
    assert forced_seen, "some batch should need the whole cluster for its longest sequence"
    assert tightened, "whole replicas should tighten some batch's bound"


def test_pricer_hands_on_the_packing_it_priced():
    """The switching layer's select mode trains the chosen candidate with the packing the selection made
    (GroupPricer.packed): the same as packing again, and None for other lengths or other replicas."""
    from hetu_ext.plan.hotspa import GroupPricer
    from hetu_ext.data.packing import assign
    from hetu_ext.plan.core.replicas import replica_specs

    st = candidate_strategies(MODEL, 8, _cost(2), _lengths(2, n=2000), max_len=SHORT, batch_tokens=32 * 512)
    pricer = GroupPricer(st, MODEL, _cost(2))
    batch = np.clip(np.random.default_rng(1).lognormal(3.5, 1.2, 40).astype(np.int64), 1, 96).tolist()
    k = len(st.items) - 1
    replicas = replica_specs(st.items[k].plan, MODEL, _cost(2), max_pack_tokens=st.items[k].max_len)
    assert pricer.packed(k, batch, replicas) is None
    t = pricer.exact(k, batch)
    packed = pricer.packed(k, batch, replicas)
    assert packed == assign(batch, replicas, method="hetu") and max(packed.predicted_s) == t
    assert pricer.packed(k, batch[::-1], replicas) is None
    assert pricer.packed(k, batch, replicas[:-1]) is None


def test_select_candidate_refuses_too_long_and_too_few():
    st = candidate_strategies(MODEL, 4, _cost(0), _lengths(0, n=2000), max_len=SHORT, batch_tokens=16 * 512)
    zero = [0.0] * len(st.items)
    with pytest.raises(ValueError, match="longer than every strategy"):
        select_candidate([st.capacity + 1], st, estimate=lambda k, s: 0.0, exact=lambda k, s: 0.0, switch_s=zero)
    if min(len(s.plan.pipelines) for s in st.items) > 1:
        with pytest.raises(ValueError, match="raise the global batch"):
            select_candidate([1], st, estimate=lambda k, s: 0.0, exact=lambda k, s: 0.0, switch_s=zero)


CLI = ["hydraulis", "--world-size", "8", "--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "8",
       "--ffn-hidden-size", "128", "--vocab-size", "256", "--seq-length", str(SHORT), "--batch-tokens", "16384",
       "--batches", "2"]


def test_cli_prints_candidates_and_writes_a_strategies_file(tmp_path, capsys):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(x) for x in _lengths(0, n=3000)) + "\n")
    table = tmp_path / "cost.yaml"
    from hetu_ext.data.cost import save_cost_table

    save_cost_table(_cost(0), table)
    out = tmp_path / "cands.yaml"
    assert plan_main([*CLI, "--lengths", str(lengths), "--cost-model", str(table), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "(home)" in text and "predicted gain" in text and "select_ms" in text
    st = load_strategies(out, model=MODEL, world_size=8)
    assert len(st.items) >= 2 and st.items[st.home].plan.is_uniform
    assert any(not s.plan.is_uniform for s in st.items)
    for s in st.items:
        assert s.name in text


@pytest.mark.parametrize("extra,message", [
    (["--lengths", "/nonexistent/lengths.txt"], "does not exist"),
    (["--lengths", "LEN", "--world-size", "0"], "--world-size must be >= 1"),
    (["--lengths", "LEN", "--gpu-memory-gib", "0.0001"], "holds one token"),
])
def test_cli_bad_input_is_one_line_and_exit_2(extra, message, tmp_path, capsys):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("100\n200\n")
    argv = [*CLI, *[str(lengths) if x == "LEN" else x for x in extra]]
    assert plan_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: ") and message in err
