"""--use-distributed-optimizer on the plan runtime: each element's optimizer state on exactly one of its holders.

Gold: heterogeneous plans of test_plan_runtime (TP changes along a pipeline, TP 2 beside TP 1 replicas, unused
ranks, three pipelines) train with the flag exactly like one process, at test_uniform_equivalence's tolerances
(1e-6 relative on losses, 2e-6 absolute on weights). Sharding changes no arithmetic of the update (Megatron's
own optimizer class steps each owned element with the same Adam math; the gradient is the same sum, reduced
over the holders in another order), so only the order of floating-point sums differs. An element owned twice or
by no rank, a TP copy's gradient added twice, a norm counting an element twice, or a weight not gathered back
moves step-2 losses by >1e-3 or fails gather_weights' bit-identity check of every copy.

In the same launch, per rank: the optimizer bytes actually allocated (moments; no masters in fp32) equal the
assignment's figure (plan/optimizer_shards.py) and the memory table's, and are <= 1.05 x the even share (each
element held divided by its number of holders); the bytes handed to collectives in a step equal the minimum
for reduce-scatter + all-gather over each holder set (ring: (n-1) x ceil(B/n) per collective).
"""

from __future__ import annotations

import pytest
from test_plan_runtime import PLANS
from test_uniform_equivalence import LOSS_RTOL, WEIGHT_ATOL, _argv, compare

from hetu_ext.testing.multiproc import run_ranks
from hetu_ext.testing.runs import train

SHARDED = ["microbatches_3_1", "tp_1_to_2_in_pipeline", "rank0_unused_and_rank_order", "three_pipelines",
           "tp_2_1_2_chain", "one_pipeline_uneven"]
"""Six plans: TP 2 -> 1 and 1 -> 2 along pipelines, TP 2 -> 1 -> 2, an unused rank 0 with ranks in decreasing
order, three pipelines, a single pipeline whose only reduced tensor is the tied embedding."""


def train_and_measure(rank: int, world_size: int, argv: list[str]) -> dict:
    """Train; the lowest used rank returns losses and weights, every rank its optimizer memory and bytes."""
    from hetu_ext.megatron.args import parse_run_config
    from hetu_ext.megatron.memory import optimizer_bytes_per_element, rank_memory
    from hetu_ext.megatron.state import MOMENTS
    from hetu_ext.megatron.trainer import build_trainer
    from hetu_ext.megatron.weights import gather_weights

    config = parse_run_config(argv)
    trainer = build_trainer(config)
    losses = trainer.train(log=lambda line: None)
    weights = gather_weights(trainer.model, **trainer.placement.shard_kwargs)
    out: dict = {"rank": rank, "active": trainer.placement.active}
    if trainer.placement.active:
        sharded = trainer.optimizer.hetu_sharded
        shards, sync = sharded.sync.shards, sharded.sync
        per = optimizer_bytes_per_element(config.training.optimizer, config.training.bf16)
        allocated = sum(t.numel() * t.element_size() for e in sharded.entries()
                        for t in [*(e.state[m] for m in MOMENTS if m in e.state),
                                  *([e.master] if e.master is not None else [])])
        out.update(allocated=allocated, assigned=shards.owned_numel(rank) * per, fair=shards.fair_numel(rank) * per,
                   table=rank_memory(trainer.model, config.training.optimizer, config.training.bf16,
                                     trainer.optimizer)["optimizer"],
                   sent=sync.bytes_sent, minimum=shards.exchange_bytes(rank, 4, 4))
    if rank == trainer.log_rank:
        out.update(losses=losses, weights=weights)
    return out


@pytest.fixture(scope="module")
def reference(sample_prefix):
    return run_ranks(train, 1, _argv(1, 1, sample_prefix), timeout=120)[0]


@pytest.mark.parametrize("name", SHARDED)
def test_sharded_optimizer_matches_single_process(name, reference, sample_prefix, tmp_path):
    _, world, covers, text = next(p for p in PLANS if p[0] == name)
    plan = tmp_path / f"{name}.yaml"
    plan.write_text(text)
    argv = _argv(1, 1, sample_prefix, ("--hetu-plan", str(plan), "--use-distributed-optimizer"))
    rows = run_ranks(train_and_measure, world, argv, timeout=240)
    result = next(r for r in rows if "losses" in r)
    loss_diff, weight_diff = compare(result, reference)
    print(f"{name} ({covers}): loss rel diff {loss_diff:.2e}, weight abs diff {weight_diff:.2e}")
    assert loss_diff <= LOSS_RTOL, (result["losses"], reference["losses"])
    assert weight_diff <= WEIGHT_ATOL
    for r in (r for r in rows if r["active"]):
        assert r["allocated"] == r["assigned"] == r["table"], r
        assert r["assigned"] <= 1.05 * r["fair"], r
        assert r["sent"] == r["minimum"], r
    assert sum(r["assigned"] for r in rows if r["active"]) == pytest.approx(sum(r["fair"] for r in rows if r["active"]))
