"""Context parallelism in plans and in the planners' strategy spaces (issue 48, part 2; pure: no process group).

A stage's ``cp`` says its ranks are ``cp`` TP groups that split every sequence; plan files take ``cp:``; the plan
runtime runs it (tests/test_context_parallel_training.py), the switching layer of strategies does not yet. The
planners price CP with the same terms as the step model (``cp_cost``: 1/cp of the work, the K/V all-gather and
gradient reduce-scatter exposed), and put it in their spaces when asked (``cp_degrees``): HotSPa's ``auto``,
Hydraulis's pool, LobRA's pool, Malleus's templates."""

from __future__ import annotations

import pytest
import yaml

from hetu_ext.data.cost import CostTable, LengthCost
from hetu_ext.model.spec import ModelSpec
from hetu_ext.plan.core.cluster import Cluster
from hetu_ext.plan.core.io import dump_plan, plan_from_dict
from hetu_ext.plan.core.plan import PlanError, uniform_plan, uniform_shape, validate_plan
from hetu_ext.plan.core.replicas import CP_DEGREES, cp_cost, replica_specs
from hetu_ext.plan.cost import step_model as sm
from hetu_ext.plan.cost.devices import load_device
from hetu_ext.plan.cost.stage import CostModel
from hetu_ext.plan.hotspa.strategies import auto_strategies
from hetu_ext.plan.hotspa.switch_cost import allreduce_seconds, switch_elements
from hetu_ext.plan.hydraulis.dynamic_program import shape_pool
from hetu_ext.plan.lobra.pool import lobra_cost_model, strategy_pool
from hetu_ext.plan.malleus import microbatch_bound_s, plan_malleus, plan_step_s

SPEC = ModelSpec(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8, seq_length=32768,
                 vocab_size=32000)


def test_a_cp_stage_is_cp_tp_groups_in_megatrons_order_and_round_trips_through_yaml():
    """uniform_plan(cp=2): rank t + tp (c + cp (d + dp p)) (Megatron's tp-cp-dp-pp order); a stage's TP degree is
    its ranks over cp; the YAML form keeps ``cp`` (and writes nothing new for CP 1 plans); a cp that does not divide
    the ranks, or a sequence that does not split in 2 cp chunks, is refused naming the fix; the plan runtime's gate
    takes CP stages but refuses a pipeline whose stages differ in cp; uniform_shape (the runtime's Megatron grid)
    is None for a CP plan."""
    plan = uniform_plan(world_size=16, tp=2, cp=2, pp=2, num_layers=4, num_microbatches=2)
    first = plan.pipelines[0].stages
    assert first[0].ranks == (0, 1, 2, 3) and first[1].ranks == (8, 9, 10, 11)
    assert plan.pipelines[1].stages[0].ranks == (4, 5, 6, 7) and first[0].tp == 2 and first[0].cp == 2
    text = dump_plan(plan)
    assert "cp: 2" in text and plan_from_dict(yaml.safe_load(text)) == plan
    assert "cp" not in dump_plan(uniform_plan(world_size=4, tp=2, num_layers=4))
    assert uniform_shape(plan) is None and uniform_shape(uniform_plan(world_size=4, tp=2, num_layers=4)) == (2, 1, 2)
    bad = yaml.safe_load(text)
    bad["pipelines"][0]["stages"][0]["cp"] = 3
    with pytest.raises(PlanError, match="cp 3 must be an integer >= 1 dividing its 4 ranks"):
        validate_plan(plan_from_dict(bad))
    model = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=6)
    with pytest.raises(PlanError, match="--seq-length 6 must be divisible by 2 x cp = 4"):
        validate_plan(plan, model)
    from hetu_ext.megatron.launch_plan import check_runnable

    check_runnable(plan)  # the plan runtime runs CP (tests/test_context_parallel_training.py)
    mixed = yaml.safe_load(text)
    mixed["pipelines"][0]["stages"][1]["cp"] = 1
    with pytest.raises(PlanError, match=r"its stages have cp \[2, 1\]"):
        check_runnable(plan_from_dict(mixed))


def test_cp_cost_is_the_step_models_all_gather_cp_and_multiplies_the_pack():
    """cp_cost divides a layer's attention and per-token seconds and its activations per token by cp (so a pack
    holds cp times the tokens) and adds the K/V exchange; its added seconds per token equal the step model's
    exposed all-gather + reduce-scatter (cp_exchange_s) at the same link, latency aside."""
    layer = LengthCost(a=1e-10, b=1e-6, c=1e-4, memory_per_token_bytes=8000.0, memory_fixed_bytes=1e8)
    two = cp_cost(layer, SPEC, tp=2, cp=2, link_bytes_per_s=100e9)
    assert two.a == layer.a / 2 and two.c == layer.c and two.memory_per_token_bytes == 4000.0
    assert two.memory_fixed_bytes == layer.memory_fixed_bytes and cp_cost(layer, SPEC, tp=2, cp=1) is layer
    device = sm.Device(**{**load_device("a100-80gb-sxm").__dict__, "nvlink_bytes_per_s": 100e9,
                          "nvlink_latency_s": 0.0})
    par = sm.Parallel(tp=2, cp=2, cp_comm_type="all_gather")
    f, b = sm.cp_exchange_s(SPEC, device, par, attention_s=0.0)
    assert two.b - layer.b / 2 == pytest.approx((f + b) / SPEC.seq_length, rel=1e-12)


def test_hotspa_hydraulis_and_lobra_spaces_gain_cp_shapes_that_hold_longer_sequences():
    """With CP_DEGREES each planner's space holds CP shapes (none by default: the switching layer does not run CP), a CP
    shape's pack holds more tokens than the same TP without CP, and a CP plan's replicas price what cp_cost says."""
    cost = CostTable(device_memory_bytes=80 * 2**30)
    plain, with_cp = auto_strategies(SPEC, 16, cost), auto_strategies(SPEC, 16, cost, cp_degrees=CP_DEGREES)
    assert all(s.plan.pipelines[0].stages[0].cp == 1 for s in plain.items)
    cap = {s.name: s.max_len for s in with_cp.items}
    assert cap["tp2cp2pp1dp4"] > cap["tp2pp1dp8"] and {s.name for s in plain.items} < set(cap)
    pool = {s.name: s for s in shape_pool(SPEC, cost, world_size=16, max_len=32768, cp_degrees=CP_DEGREES)}
    assert pool["TP2PP1CP2"].capacity > pool["TP2PP1"].capacity and pool["TP2PP1CP2"].gpus == 4
    # a CP shape never prunes a CP-free one (the homes): the pruned pool without CP is inside the one with CP
    for max_len in (16384, 32768):
        plain_pool = {s.name for s in shape_pool(SPEC, cost, world_size=16, max_len=max_len)}
        assert plain_pool <= {s.name for s in shape_pool(SPEC, cost, world_size=16, max_len=max_len,
                                                          cp_degrees=CP_DEGREES)}
    (replica,) = replica_specs(uniform_plan(world_size=4, tp=2, cp=2, num_layers=32), SPEC, cost,
                               max_pack_tokens=32768)
    assert replica.stage_costs[0] == cp_cost(cost.for_tp(2), SPEC, tp=2, cp=2).times_layers(32)
    lobra = strategy_pool(SPEC, lobra_cost_model(), gpu_memory_bytes=80 * 2**30, gpus_per_node=8, max_gpus=16,
                          cp_degrees=CP_DEGREES, prune=False)
    by = {s.name: s for s in lobra}
    assert by["TP1PP1CP2"].capacity > by["TP1PP1"].capacity and by["TP1PP1CP4"].gpus == 4


def test_cp_shares_weights_in_switches_and_reduces_gradients_over_dp_x_cp():
    """A CP rank holds its TP rank's shard: switching from TP 2 x DP 2 to TP 2 x CP 2 moves nothing for ranks that
    keep their TP index's shard; the gradient all-reduce of a TP 2 x CP 2 x DP 1 plan spans its 2 CP ranks."""
    home = uniform_plan(world_size=4, tp=2, num_layers=4, num_microbatches=2)
    cp = uniform_plan(world_size=4, tp=2, cp=2, num_layers=4)
    assert all(v == 0 for v in switch_elements(home, cp, SPEC).values())
    assert allreduce_seconds(cp, SPEC, bandwidth=1e11) == pytest.approx(allreduce_seconds(home, SPEC, bandwidth=1e11))


def test_malleus_searches_cp_templates_and_its_bound_still_holds():
    """plan_malleus(cp_degrees=CP_DEGREES) at 16K tokens on 64 GPUs (attention scores kept: no CP-free layout
    fits 80 GB) returns a CP plan whose predicted time plan_step_s reproduces, with microbatch_bound_s over the same
    degrees below it; without CP the same job does not fit (one line)."""
    spec = ModelSpec(num_layers=32, hidden_size=4096, num_attention_heads=32, seq_length=16384, vocab_size=32000)
    cluster = Cluster(world_size=64, gpus_per_node=8, gpu_memory_bytes=80 * 2**30, slowdowns={3: 2.0})
    cost = CostModel(optimizer_sharded=True)
    with pytest.raises(ValueError, match="no plan fits"):
        plan_malleus(cluster, spec, micro_batch=1, num_microbatches=64, cost=cost)
    planned = plan_malleus(cluster, spec, micro_batch=1, num_microbatches=64, cost=cost, cp_degrees=CP_DEGREES)
    assert {s.cp for p in planned.plan.pipelines for s in p.stages} != {1} and "cp=" in planned.template
    assert plan_step_s(planned.plan, cluster, spec, micro_batch=1, cost=cost) == pytest.approx(
        planned.predicted_step_s, rel=1e-9)
    bound = microbatch_bound_s(cluster, spec, micro_batch=1, num_microbatches=64, cost=cost, cp_degrees=CP_DEGREES)
    assert 0 < bound <= planned.predicted_step_s


def test_hybrid_cp_prices_megatrons_own_schedule_with_its_power_of_two_rule():
    """hetu_ext.plan.cost.hybrid_cp: the CP size per sequence is Megatron-core's BalancedCPScheduler.gpus_needed
    (its class, imported from the venv, on every length up to 8 x N); the groups its get_groups_and_subsamples
    forms for a batch hold every sequence once (on as many ranks as its CP size, a power of two) and price to
    the slowest rank's sum of one-sequence microbatches, which is at least the batch's work spread evenly over
    the ranks (a check the pricing cannot pass by returning a too small time)."""
    from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    from hetu_ext.plan.cost import hybrid_cp

    class Group:
        def size(self) -> int:
            return 8

    n = 1000
    scheduler = BalancedCPScheduler(max_seq_len_per_rank=n, dp_cp_group=Group())
    assert all(hybrid_cp.cp_size(s, n) == scheduler.gpus_needed(s) for s in range(1, 8 * n + 1, 7))
    lengths = [7900, 4000, 3100, 2000, 1500, 900, 800, 700, 300, 200, 120, 60]
    groups, ids = scheduler.get_groups_and_subsamples(list(enumerate(lengths)), None)
    placed = [i for group in ids for i in hybrid_cp.group_cp_sizes(group)]  # group: per rank, its sample ids
    assert sorted(placed) == list(range(len(lengths)))  # every sequence in exactly one group
    for group in ids:
        sizes = hybrid_cp.group_cp_sizes(group)
        assert all(c & (c - 1) == 0 and c >= hybrid_cp.cp_size(lengths[i], n) for i, c in sizes.items())
    layer = LengthCost(a=1e-10, b=1e-6, c=1e-4)
    spec = ModelSpec(num_layers=2, hidden_size=1024, num_attention_heads=16, seq_length=8192)
    step = hybrid_cp.step_seconds(list(zip(groups, ids)), layer, spec, tp=1, num_layers=2)
    even = sum(2 * layer.document_s(s) for s in lengths) / 8
    assert step >= even
    assert hybrid_cp.fits(7900, n, capacity=1000, ranks=8) and not hybrid_cp.fits(9000, n, capacity=1000, ranks=8)


def test_hybrid_cp_link_per_cp_size_follows_the_node_rule():
    """hybrid_cp.node_links (LobRA's hybrid-CP row): a sub-sample whose tp x cp GPUs fit in a node is priced on the
    intra-node link, a wider one on the inter-node link, each equal to the one-link pricing at that link; a
    constant link_for_cp reproduces link_bytes_per_s."""
    from hetu_ext.plan.cost import hybrid_cp

    layer = LengthCost(a=1e-10, b=1e-6, c=1e-4)
    spec = ModelSpec(num_layers=2, hidden_size=1024, num_attention_heads=16, seq_length=8192)
    links = hybrid_cp.node_links(tp=2, gpus_per_node=8, intra_bytes_per_s=150e9, inter_bytes_per_s=12.5e9)
    assert links(4) == 150e9 and links(8) == 12.5e9
    narrow = ([[4000]] * 4, [[0]] * 4)  # CP 4 x TP 2: 8 GPUs, one node
    wide = ([[8000]] * 8, [[0]] * 8)  # CP 8 x TP 2: 16 GPUs, two nodes

    def priced(group, **link):
        return hybrid_cp.group_seconds(*group, layer, spec, tp=2, num_layers=2, **link)

    assert priced(narrow, link_for_cp=links) == priced(narrow, link_bytes_per_s=150e9)
    assert priced(wide, link_for_cp=links) == priced(wide, link_bytes_per_s=12.5e9)
    assert priced(wide, link_for_cp=links) > priced(wide, link_bytes_per_s=150e9)
    assert hybrid_cp.step_seconds([narrow, wide], layer, spec, tp=2, num_layers=2, link_for_cp=lambda cp: 100e9) \
        == hybrid_cp.step_seconds([narrow, wide], layer, spec, tp=2, num_layers=2)
