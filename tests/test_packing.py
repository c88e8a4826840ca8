"""Packing and two-stage assignment: invariants of every method, the certified bound, optimality against an exact
MILP (HiGHS) on small instances, a heterogeneous plan (Acceptance 4 of issue 5), the cost table and its fit.

Pure tests: numpy and scipy, no process group, no clocks.
"""

from __future__ import annotations

import numpy as np
import pytest
from packing_milp import optimal_max_time

from hetu_ext.data.calibrate import fit_length_cost
from hetu_ext.data.cost import (
    CostTable,
    LengthCost,
    cost_table_from_dict,
    load_cost_table,
    save_cost_table,
)
from hetu_ext.data.lengths import (
    LognormalLengths,
    batch_bounds,
    concat_split,
    split_long,
)
from hetu_ext.data.packing import METHODS, ReplicaSpec, assign
from hetu_ext.plan.core.replicas import replica_specs
from hetu_ext.data.packing_bound import lower_bound_s, may_fit_within
from hetu_ext.model.spec import ModelSpec
from hetu_ext.plan.core.plan import Pipeline, Plan, Stage, uniform_plan

LAYER = LengthCost(a=1.6e-10, b=8e-6, c=1e-4)
WIKI_LIKE = LognormalLengths(min_seq_len=8, max_seq_len=200_000, mean_seq_len=1014, lognormal_sigma=1.26)


def _uniform(r: int, pp: int, cap: int, layers: int = 32) -> list[ReplicaSpec]:
    return [ReplicaSpec(stage_costs=(LAYER.times_layers(layers // pp),) * pp, token_capacity=cap)] * r


def _brute_time(spec: ReplicaSpec, packs, lengths) -> float:
    """Predicted 1F1B time, recomputed here from the definition with plain loops."""
    times = []
    for pack in packs:
        per_stage = [sum(c.a * lengths[i] ** 2 + c.b * lengths[i] for i in pack) + c.c for c in spec.stage_costs]
        times.append(max(per_stage))
    return sum(times) + (len(spec.stage_costs) - 1) * max(times) if times else 0.0


def _check_invariants(a, lengths, replicas) -> None:
    seen = sorted(i for rep in a.microbatches for pack in rep for i in pack)
    assert seen == list(range(len(lengths))), "each document exactly once"
    for rep, spec, t in zip(a.microbatches, replicas, a.predicted_s):
        assert all(pack and sum(lengths[i] for i in pack) <= spec.token_capacity for pack in rep)
        assert t == pytest.approx(_brute_time(spec, rep, lengths), rel=1e-9)
    assert a.lower_bound_s <= max(a.predicted_s) * (1 + 1e-9), "the bound must hold for every method's result"


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("pp, cap", [(1, 4096), (4, 16384)])
def test_every_method_keeps_each_document_once_within_capacity(method, pp, cap):
    lengths = split_long(WIKI_LIKE.sample(3000, seed=3), cap).length[:1500].tolist()
    replicas = _uniform(16, pp, cap)
    a = assign(lengths, replicas, method=method)
    _check_invariants(a, lengths, replicas)
    assert a == assign(lengths, replicas, method=method)  # deterministic


def test_hetu_balances_better_than_the_baselines_on_wikipedia_like_lengths():
    """The point of the method: at 4K packs and 16 replicas, token balancing (greedy) leaves a few percent and
    Megatron's order-preserving packs tens of percent; hetu's result is certified within 1% of the bound."""
    lengths = split_long(WIKI_LIKE.sample(20000, seed=4), 4096).length
    batch = lengths[:int(batch_bounds(lengths, tokens=16 * 8192)[1])].tolist()
    replicas = _uniform(16, 1, 4096)
    results = {m: assign(batch, replicas, method=m) for m in METHODS}
    assert results["hetu"].gap < 0.01
    assert results["hetu"].max_over_mean < 1.01
    for m in ("megatron", "ffd", "greedy"):
        assert max(results["hetu"].predicted_s) <= max(results[m].predicted_s)
    assert results["megatron"].max_over_mean > 1.1


def test_megatron_method_on_concatenated_pieces_fills_packs_exactly():
    docs = WIKI_LIKE.sample(400, seed=5)
    pieces = concat_split(docs, 2048)
    a = assign(pieces.length.tolist(), _uniform(4, 1, 2048), method="megatron")
    packs = [sum(int(pieces.length[i]) for i in p) for rep in a.microbatches for p in rep]
    assert all(t == 2048 for t in packs[:-1]) and 0 < packs[-1] <= 2048
    assert [len(rep) for rep in a.microbatches] == [len(packs) // 4 + (k < len(packs) % 4) for k in range(4)]


def test_too_long_document_and_unknown_method_are_clear_errors():
    replicas = _uniform(2, 1, 1000)
    with pytest.raises(ValueError, match=r"document 1 has 1500 tokens, more than the token capacity 1000.*split"):
        assign([10, 1500], replicas)
    with pytest.raises(ValueError, match=r"unknown method 'lpt'; choose one of \['megatron', 'ffd'"):
        assign([10], replicas, method="lpt")


def _small_instance(seed: int) -> tuple[list[int], list[ReplicaSpec]]:
    rng = np.random.default_rng(seed)
    n, r = int(rng.integers(5, 8)), int(rng.integers(2, 4))
    lengths = np.minimum(np.rint(rng.lognormal(6.5, 1.2, n)).astype(int) + 1, 4096).tolist()
    replicas = []
    for k in range(r):
        pp, slow = int(rng.integers(1, 4)), float(rng.uniform(1, 2))
        base = LengthCost(a=1e-9, b=1e-5, c=float(rng.choice([0.0, 2e-3, 1e-2])))
        costs = tuple(base.scaled(slow * float(rng.uniform(0.8, 1.2))) for _ in range(pp))
        replicas.append(ReplicaSpec(stage_costs=costs, token_capacity=4096 if k == 0 else int(rng.choice([2048,
                                                                                                            4096]))))
    return lengths, replicas


@pytest.mark.parametrize("seed", [0, 7, 11, 24, 27])
def test_hetu_within_4_percent_of_the_milp_optimum_and_bound_below_it(seed):
    """Small instances (5-7 documents, 2-3 replicas differing in speed, depth, capacity and c) solved exactly by
    HiGHS. The heuristic must be within 4% of the optimum (seeds 7, 24 and 27 are the hardest of the first 30:
    0.8-3.5% above it) and the certified bound must never exceed it (a bound above the optimum would be a bug)."""
    lengths, replicas = _small_instance(seed)
    optimum = optimal_max_time(lengths, replicas)
    a = assign(lengths, replicas)
    _check_invariants(a, lengths, replicas)
    assert a.lower_bound_s <= optimum * (1 + 1e-6)
    assert max(a.predicted_s) <= optimum * 1.04
    assert may_fit_within(np.asarray(lengths), replicas, optimum * (1 + 1e-6)), "the optimum must pass the test"


def _identical_instance(seed: int) -> tuple[list[int], list[ReplicaSpec]]:
    rng = np.random.default_rng(100 + seed)
    n, r, pp = int(rng.integers(5, 7)), int(rng.integers(2, 4)), 2 + seed % 3
    lengths = np.minimum(np.rint(rng.lognormal(6.5, 1.3, n)).astype(int) + 1, 4096).tolist()
    cost = LengthCost(a=float(rng.choice([1e-10, 1e-9, 1e-8])), b=1e-5, c=(0.0, 1e-3, 1e-2)[seed % 3])
    return lengths, [ReplicaSpec(stage_costs=(cost,) * pp, token_capacity=4096)] * r


@pytest.mark.parametrize("seed", range(6))
def test_identical_pipelines_within_2_percent_of_the_milp_and_anchored_bound_valid(seed):
    """Identical replicas of 2-4 stages (where the anchored bound applies, c = 0 included: a 0 x inf there once
    made the bound 8-28x the optimum): the bound must stay at or below the HiGHS optimum and the heuristic within
    2% of it (worst of 40 such random instances measured: 1.3%)."""
    lengths, replicas = _identical_instance(seed)
    optimum = optimal_max_time(lengths, replicas)
    a = assign(lengths, replicas)
    _check_invariants(a, lengths, replicas)
    assert a.lower_bound_s <= optimum * (1 + 1e-6)
    assert may_fit_within(np.asarray(lengths), replicas, optimum * (1 + 1e-6)), "the optimum must pass the test"
    assert max(a.predicted_s) <= optimum * 1.02


def test_few_long_documents_per_replica_are_packed_at_the_bound():
    """Identical pp = 1 replicas holding few documents each (13 on 4, a HotSPa group of long sequences): LPT alone
    put 15343, 11141 and 10912 tokens on one replica (5.55 s); with MULTIFIT tried too the slowest replica meets
    the certified bound (5.19 s: two 16384-token documents), so the packing is optimal."""
    cost = LengthCost(a=2.7594e-9, b=1.1295e-4, c=3.2e-3)
    replicas = [ReplicaSpec(stage_costs=(cost,), token_capacity=16384)] * 4
    lengths = [16384] * 5 + [15343, 11252, 11141, 10912, 2619, 1745, 364, 352]
    a = assign(lengths, replicas)
    _check_invariants(a, lengths, replicas)
    assert max(a.predicted_s) == pytest.approx(a.lower_bound_s, rel=1e-9)


def test_few_documents_per_replica_never_pack_worse_than_lpt_alone():
    """Where MULTIFIT is tried beside LPT for few documents per replica, both starts are refined and the better
    kept: on random batches of 1-4 documents per replica (pp 1 and 2, c from 0 to 0.03 s) the result is never
    slower than LPT refined alone (refining only MULTIFIT's start lost up to 2.3% on 6% of such batches)."""
    from hetu_ext.data import two_stage
    from hetu_ext.data.replica_arrays import ReplicaArrays
    from hetu_ext.data.two_stage_microbatches import stage2

    rng = np.random.default_rng(5)
    better = 0
    for _ in range(300):
        r, pp = int(rng.integers(2, 17)), int(rng.choice([1, 1, 2]))
        s = np.minimum(np.rint(rng.lognormal(8.5, 1.0, int(rng.integers(r, 4 * r + 1)))).astype(int) + 1, 16384)
        cost = LengthCost(a=2.76e-9, b=1.13e-4, c=float(rng.choice([0.0, 3.2e-3, 3e-2])))
        replicas = [ReplicaSpec(stage_costs=(cost.scaled(1 / pp),) * pp, token_capacity=16384)] * r
        rep = ReplicaArrays(replicas, s)
        shares = two_stage._stage1(s, rep)
        packed = [stage2(s, share, rep, k) for k, share in enumerate(shares)]
        two_stage._refine(s, rep, shares, packed)
        lpt = max(t for _, t in packed)
        got = max(assign(s.tolist(), replicas).predicted_s)
        assert got <= lpt * (1 + 1e-12)
        better += got < lpt * (1 - 1e-9)
    assert better >= 30, "MULTIFIT should win on a good share of such batches"


def _hetero_plan() -> Plan:
    def stage(ranks, start, stop, j, p):
        return Stage(ranks=tuple(ranks), layer_start=start, layer_stop=stop, has_embedding=j == 0,
                     has_output=j == p - 1)
    return Plan(pipelines=(
        Pipeline(stages=(stage([0], 0, 8, 0, 1),), num_microbatches=1),
        Pipeline(stages=(stage([1], 0, 4, 0, 2), stage([2], 4, 8, 1, 2)), num_microbatches=1),
        Pipeline(stages=(stage([3, 4], 0, 8, 0, 1),), num_microbatches=1),
        Pipeline(stages=tuple(stage([5 + j], 2 * j, 2 * j + 2, j, 4) for j in range(4)), num_microbatches=1),
    ))


def test_heterogeneous_plan_replicas_finish_within_5_percent():
    """Acceptance 4: four pipelines differing in depth (1, 2, 1, 4 stages), speed (rank 2 1.5x slow; TP 2 vs 1)
    and memory (the 1-stage TP-1 pipeline holds 8 layers' weights, so ~9.8K tokens fit; the others take the 16K
    pack length): hetu keeps the replicas' predicted times within 5% of each other (measured: equal to 0.1%),
    where token-balanced greedy leaves them 2.7x apart (the TP-2 replica is ~2x faster than the 1-GPU one)."""
    table = CostTable(device_memory_bytes=40e9)
    specs = replica_specs(_hetero_plan(), ModelSpec(num_layers=8, hidden_size=64, num_attention_heads=4), table,
                          slowdowns={2: 1.5}, max_pack_tokens=16384)
    caps = [s.token_capacity for s in specs]
    # pipeline 0 keeps 8 layers' weights (8 x 18 B x (12 h^2 + 13 h): the default table's 4096-wide GPT layer, its
    # biases and norms included) and one microbatch of 8 x 34 h B per token in 40 GB
    h = 4096
    assert caps[0] == int((40e9 - 8 * 18 * (12 * h * h + 13 * h)) // (8 * 34 * h))
    assert caps[1:] == [16384] * 3 and [s.pp for s in specs] == [1, 2, 1, 4]
    assert specs[1].stage_costs[1].a == pytest.approx(table.for_tp(1).a * 4 * 1.5)
    docs = split_long(WIKI_LIKE.sample(5000, seed=6), caps[0]).length
    batch = docs[:int(batch_bounds(docs, tokens=4 * 65536)[1])].tolist()
    a = assign(batch, specs)
    _check_invariants(a, batch, specs)
    assert max(a.predicted_s) / min(a.predicted_s) <= 1.05
    greedy = assign(batch, specs, method="greedy")
    assert max(greedy.predicted_s) / min(greedy.predicted_s) > 1.2


def test_replica_specs_reject_a_plan_for_another_model():
    with pytest.raises(ValueError, match="the plan holds 8 layers but the model has 6"):
        replica_specs(_hetero_plan(), ModelSpec(num_layers=6, hidden_size=64, num_attention_heads=4), CostTable(),
                      max_pack_tokens=4096)


def test_cost_table_yaml_round_trip_and_strict_keys(tmp_path):
    table = CostTable(per_tp={1: LengthCost(a=1e-9, b=2e-6, c=3e-4, memory_per_token_bytes=100.0)},
                      device="cpu", note="test")
    save_cost_table(table, tmp_path / "t.yaml")
    assert load_cost_table(tmp_path / "t.yaml") == table
    with pytest.raises(ValueError, match=r"unknown key 'd' in cost table per_tp\[1\]; the keys are \['a', 'b'"):
        cost_table_from_dict({"per_tp": {1: {"a": 1.0, "b": 1.0, "d": 1.0}}})
    with pytest.raises(ValueError, match=r"unknown key 'tp' in cost table; did you mean 'per_tp'\?"):
        cost_table_from_dict({"tp": 1, "per_tp": {1: {"a": 1.0, "b": 1.0}}})
    with pytest.raises(ValueError, match="missing.yaml.*cannot be read.*calibrate"):
        load_cost_table(tmp_path / "missing.yaml")
    with pytest.raises(ValueError, match=r"no cost for TP degree 4; it has TP \[1\]"):
        table.for_tp(4)
    with pytest.raises(ValueError, match="b must be a number >= 0"):
        LengthCost(a=1.0, b=-1.0)


def test_stored_cpu_calibration_loads():
    """The measured table the planners read: attention costs something, both TP degrees were measured (not
    derived), and TP 2 runs a long document faster than TP 1."""
    table = load_cost_table("configs/calibration/cpu.yaml")
    one, two = table.for_tp(1), table.for_tp(2)
    assert one.a > 0 and one.document_s(4096) > one.document_s(1024) > 0
    assert two.document_s(4096) < one.document_s(4096)
    assert "every TP degree measured" in table.note and "max relative fit error" in table.note


def test_fit_recovers_known_coefficients():
    """Synthetic times from a = 2e-9, b = 3e-6, c = 4e-3 with +-1% deterministic noise: the fit must recover
    each coefficient within 10% and the times within 2%; without noise, exactly."""
    s = np.array([128, 256, 512, 1024, 2048, 4096, 8192])
    exact = 2e-9 * s ** 2 + 3e-6 * s + 4e-3
    fit = fit_length_cost(s, exact)
    assert (fit.a, fit.b, fit.c) == pytest.approx((2e-9, 3e-6, 4e-3), rel=1e-6)
    noisy = exact * (1 + 0.01 * np.sin(np.arange(s.size) * 2.3))
    fit = fit_length_cost(s, noisy)
    assert (fit.a, fit.b, fit.c) == pytest.approx((2e-9, 3e-6, 4e-3), rel=0.1)
    assert fit.max_rel_error < 0.02
    with pytest.raises(ValueError, match="need >= 3 distinct lengths"):
        fit_length_cost([1, 1, 2], [1.0, 1.0, 2.0])


def _heavy_tailed_instance(seed: int) -> tuple[list[int], list[ReplicaSpec]]:
    """Full-length pieces (what cutting a heavy-tailed batch at the pack length leaves) plus a few short documents,
    on 2-3 replicas: identical for even seeds (pp 1, or 2 for seeds 2 and 6), differing in speed, depth and
    capacity for odd ones."""
    rng = np.random.default_rng(200 + seed)
    r, cap = int(rng.integers(2, 4)), 4096
    full = int(rng.integers(r + 1, 2 * r))  # more full packs than replicas, not a multiple of them
    lengths = [cap] * full + np.rint(rng.lognormal(6.0, 1.0, 7 - full)).clip(8, 1500).astype(int).tolist()
    cost = LengthCost(a=1e-9, b=1e-5, c=1e-3)
    if seed % 2 == 0:
        pp = 1 + seed // 2 % 2
        return lengths, [ReplicaSpec(stage_costs=(cost,) * pp, token_capacity=cap)] * r
    return lengths, [ReplicaSpec(stage_costs=(cost.scaled(1 + 0.5 * k),) * (1 + k % 2), token_capacity=cap
                                 if k < 2 else 3000) for k in range(r)]


@pytest.mark.parametrize("seed", [0, 1, 4, 5])
def test_full_length_pack_bound_is_the_milp_optimum(seed):
    """The exclusive-document term (documents over half the pack length never share a microbatch, so some replica
    runs ceil(F / R) full packs, plus its fill and drain) must equal the HiGHS optimum on these instances (identical
    replicas or not, pp 1 or 2), where the work and anchored bounds alone stopped 10-32% below it."""
    lengths, replicas = _heavy_tailed_instance(seed)
    optimum = optimal_max_time(lengths, replicas)
    a = assign(lengths, replicas)
    _check_invariants(a, lengths, replicas)
    assert a.lower_bound_s == pytest.approx(optimum, rel=1e-6)
    assert max(a.predicted_s) == pytest.approx(optimum, rel=1e-6)


def test_heavy_tailed_batch_gap_closes_where_the_packer_is_optimal():
    """A heavy-tailed batch (lognormal sigma 2, 4K packs, 8 replicas) whose 9 full-length pieces put 2 on one
    replica: the work bound alone left a 7.7% gap; with the full-length term the packer is certified optimal."""
    lengths = LognormalLengths(min_seq_len=8, max_seq_len=500_000, mean_seq_len=3000, lognormal_sigma=2.0)
    pieces = split_long(lengths.sample(50000, seed=1), 4096).length
    batch = pieces[:int(batch_bounds(pieces, tokens=8 * 2 * 4096)[1])]
    assert int((batch == 4096).sum()) == 9
    model = ModelSpec(num_layers=32, hidden_size=64, num_attention_heads=4, seq_length=4096)
    specs = replica_specs(uniform_plan(world_size=8, pp=1, num_layers=32), model, CostTable(), max_pack_tokens=4096)
    a = assign(batch.tolist(), specs)
    _check_invariants(a, batch.tolist(), specs)
    assert a.gap <= 1e-9


def test_measured_tp_efficiency_round_trip_and_cost_model(tmp_path):
    """python -m hetu_ext.data.calibrate's efficiency T_1 / (t T_t) from a measured table, its file read back by the
    planner's cost model, which then drops the all-reduce term for the measured degree (it is in the measurement)."""
    from hetu_ext.data.calibrate import main as calibrate_main
    from hetu_ext.data.calibrate import tp_efficiency
    from hetu_ext.plan.cost.stage import CostModel, load_tp_efficiency, stage_cost, with_measured_tp

    table = CostTable(per_tp={1: LengthCost(a=0.0, b=1e-5, c=0.0), 2: LengthCost(a=0.0, b=0.625e-5, c=0.0)},
                      device="test")
    assert tp_efficiency(table, 4096) == {1: 1.0, 2: 0.8}
    save_cost_table(table, tmp_path / "table.yaml")
    calibrate_main(["--cost-table", str(tmp_path / "table.yaml"), "--out", str(tmp_path / "eff.yaml")])
    measured = load_tp_efficiency(tmp_path / "eff.yaml")
    assert measured == {1: 1.0, 2: 0.8}
    cost = with_measured_tp(CostModel(), measured)
    assert cost.tp_efficiency == {1: 1.0, 2: 0.8, 4: 0.9, 8: 0.85} and cost.tp_measured == (1, 2)
    spec = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=128)
    kw = dict(num_layers=4, tp=2, slowdown=1.0, micro_batch=1, first=False, last=False, in_flight=1)
    assumed, measured_cost = stage_cost(spec, CostModel(), **kw), stage_cost(spec, cost, **kw)
    flops = 4 * (2 * 128 * (4 * 64 * 64 + 2 * 64 * 256) + 4 * 128 * 128 * 64)  # 4 layers, matmuls and attention
    compute = lambda c, eff: flops / (c.flops_per_s * 2 * eff)  # noqa: E731
    assert measured_cost.forward_s == pytest.approx(compute(cost, 0.8))
    assert assumed.forward_s > compute(CostModel(), 0.95)  # the assumed degree adds its all-reduces
    (tmp_path / "bad.yaml").write_text("tp_eficiency: {2: 0.9}\n")
    with pytest.raises(ValueError, match="unknown key 'tp_eficiency'.*did you mean 'tp_efficiency'"):
        load_tp_efficiency(tmp_path / "bad.yaml")


# Hydraulis (issue 15): the packer's faster paths must give exactly the results of the plain loops they replace


def _random_replicas(rng, r: int) -> list[ReplicaSpec]:
    out = []
    for _ in range(r):
        pp = int(rng.choice([1, 2, 4]))
        costs = tuple(LengthCost(a=float(rng.uniform(0, 1e-9) * rng.integers(0, 2)), b=float(rng.uniform(1e-6, 1e-5)),
                                 c=float(rng.choice([0.0, 1e-4, 1e-3]))) for _ in range(pp))
        out.append(ReplicaSpec(stage_costs=costs, token_capacity=int(rng.choice([2048, 8192, 32768]))))
    return out


def test_level_search_equals_the_document_by_document_fill():
    """stage1_levels (replica by replica, bisection, early volume test) returns exactly the shares of the grid
    filled document by document (stage1_levels_grid), found or not, on random batches and replica mixes."""
    from hetu_ext.data.packing_bound import lower_bound_s
    from hetu_ext.data.replica_arrays import ReplicaArrays
    from hetu_ext.data.two_stage_levels import stage1_levels, stage1_levels_grid

    rng = np.random.default_rng(5)
    found = 0
    for _ in range(60):
        replicas = _random_replicas(rng, int(rng.integers(1, 20)))
        cap = max(x.token_capacity for x in replicas)
        n = int(rng.integers(1, 300))
        s = np.clip(rng.lognormal(6, 1.5, n).astype(np.int64), 1, cap) if rng.random() < 0.7 else \
            rng.choice([100, 200, min(4096, cap)], n)
        rep = ReplicaArrays(replicas, s)
        bound = lower_bound_s(s, replicas)
        high = bound * float(rng.uniform(1.0, 1.5))
        fast = stage1_levels(s, rep, high, bound)
        assert fast == stage1_levels_grid(s, rep, high, bound)
        found += fast is not None
    assert found >= 10


def test_stage1_and_smallest_equal_their_plain_forms():
    """Stage 1 with its estimate inlined equals the loop calling _estimate; stage 2's time equals replica_time of
    its packs and is at least stage2_floor (refinement skips on it); _smallest equals a stable argsort."""
    import heapq

    from hetu_ext.data import two_stage
    from hetu_ext.data.replica_arrays import ReplicaArrays
    from hetu_ext.data.two_stage_microbatches import replica_time, stage2, stage2_floor

    def plain_stage1(s, rep):
        keys = list(zip(rep.ra.tolist(), rep.rb.tolist(), rep.rc.tolist(), rep.pp.tolist(), rep.cap.tolist()))
        classes: dict = {}
        for k, key in enumerate(keys):
            classes.setdefault(key, []).append((0.0, k))
        state = [[0.0, 0.0, 0.0, 0] for _ in keys]
        shares: list[list[int]] = [[] for _ in keys]
        order = np.lexsort((np.arange(s.size), -s))
        for i, length in zip(order.tolist(), s[order].tolist()):
            best = None
            for (a, b, c, pp, cap), heap in classes.items():
                if cap < length:
                    continue
                k = heap[0][1]
                w, tokens, d, n = state[k]
                cost = a * length * length + b * length
                est = two_stage._estimate(w + cost, tokens + length, max(d, cost), n + 1, pp, c, cap)
                if best is None or (est, k) < best[:2]:
                    best = (est, k, cost, heap)
            est, k, cost, heap = best
            st = state[k]
            st[0] += cost
            st[1] += length
            st[2] = max(st[2], cost)
            st[3] += 1
            shares[k].append(i)
            heapq.heapreplace(heap, (est, k))
        return shares

    rng = np.random.default_rng(6)
    for _ in range(30):
        replicas = _random_replicas(rng, int(rng.integers(1, 12)))
        cap = max(x.token_capacity for x in replicas)
        s = np.clip(rng.lognormal(6, 1.5, int(rng.integers(1, 300))).astype(np.int64), 1, cap)
        rep = ReplicaArrays(replicas, s)
        assert two_stage._stage1(s, rep) == plain_stage1(s, rep)
        for r, share in enumerate(two_stage._stage1(s, rep)):  # stage 2's running sums price as replica_time does
            packs, t = stage2(s, share, rep, r)
            assert t == replica_time(packs, rep, r)
            assert stage2_floor(share, rep, r) <= t * (1 + 1e-12)
        x = rng.choice([0.0, 1.0, 2.0, np.inf, float(rng.uniform())], int(rng.integers(1, 200)))
        top = int(rng.integers(1, 6))
        assert two_stage._smallest(x, top).tolist() == np.argsort(x, kind="stable")[:top].tolist()


def test_may_fit_within_passes_every_packing_and_rules_out_levels_above_the_bound():
    """Hydraulis's selection skips a candidate when may_fit_within says no packing finishes within a level: it
    must say yes at any achieved packing's time (here the packer's, on random mixes of pipeline shapes), and on
    these mixes it rules out levels the certified bound does not (the reason it is asked)."""
    rng = np.random.default_rng(8)
    stronger = 0
    for _ in range(40):
        replicas = _random_replicas(rng, int(rng.integers(2, 16)))
        cap = max(x.token_capacity for x in replicas)
        s = np.clip(rng.lognormal(6.5, 1.6, int(rng.integers(20, 400))).astype(np.int64), 1, cap)
        got = max(assign(s.tolist(), replicas).predicted_s)
        assert may_fit_within(s, replicas, got)
        bound = lower_bound_s(s, replicas)
        stronger += not may_fit_within(s, replicas, bound * 1.02)
    assert stronger >= 5
