"""--use-distributed-optimizer on the plan runtime: each element's optimizer state on exactly one of its holders.

Gold: heterogeneous plans of test_plan_runtime (TP changes along a pipeline, TP 2 beside TP 1 replicas, unused
ranks, three pipelines) train with the flag exactly like one process, at test_uniform_equivalence's tolerances
(1e-6 relative on losses, 2e-6 absolute on weights). Sharding changes no arithmetic of the update (Megatron's
own optimizer class steps each owned element with the same Adam math; the gradient is the same sum, reduced
over the holders in another order), so only the order of floating-point sums differs. An element owned twice or
by no rank, a TP copy's gradient added twice, a norm counting an element twice, or a weight not gathered back
moves step-2 losses by >1e-3 or fails gather_weights' bit-identity check of every copy.

In the same launch, per rank: the optimizer bytes actually allocated (moments; no masters in fp32) equal the
assignment's figure (plan/core/optimizer_shards.py) and the memory table's, and are <= 1.05 x the even share (each
element held divided by its number of holders); the bytes handed to collectives in a step equal the minimum
for reduce-scatter + all-gather over each holder set (ring: (n-1) x ceil(B/n) per collective).
"""

from __future__ import annotations

import pytest
from test_plan_runtime import PLANS
from helpers import LOSS_RTOL, WEIGHT_ATOL, compare, gpt_argv

from hetu_ext.testing.multiproc import run_ranks
from hetu_ext.cli.runs import train

SHARDED = ["microbatches_3_1", "tp_1_to_2_in_pipeline", "rank0_unused_and_rank_order", "unused_ranks",
           "tp_differs_between_pipelines", "one_pipeline_uneven"]
"""Six plans of 4-5 ranks: TP 2 -> 1 and 1 -> 2 along pipelines, unused ranks (rank 0; one in the middle and one
at the end), TP 2 beside two TP-1 replicas, a single pipeline whose only reduced tensor is the tied embedding."""


def train_and_measure(rank: int, world_size: int, argv: list[str]) -> dict:
    """Train; the lowest used rank returns losses and weights, every rank its optimizer memory and bytes."""
    from hetu_ext.cli.args import parse_run_config
    from hetu_ext.megatron.memory import optimizer_bytes_per_element, rank_memory
    from hetu_ext.megatron.state import MOMENTS
    from hetu_ext.train.trainer import build_trainer
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
def reference(sample_prefix, one_process):
    return one_process(gpt_argv(1, 1, sample_prefix))


@pytest.mark.parametrize("name", SHARDED)
def test_sharded_optimizer_matches_single_process(name, reference, sample_prefix, tmp_path):
    _, world, covers, text = next(p for p in PLANS if p[0] == name)
    plan = tmp_path / f"{name}.yaml"
    plan.write_text(text)
    argv = gpt_argv(1, 1, sample_prefix, ("--hetu-plan", str(plan), "--use-distributed-optimizer"))
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


# ---------------------------------------------------------------- checkpoints and migration with sharded state

STEPS = ("--train-iters", "4", "--lr-decay-style", "linear")
"""4 steps with a decaying LR: a resume that lost the schedule position, Adam's moments or step count, or the
data position moves the losses of steps 3-4 by >1e-3."""


def _plan(tmp_path, name: str) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(next(p[3] for p in PLANS if p[0] == name))
    return str(path)


@pytest.fixture(scope="module")
def reference4(sample_prefix, one_process):
    return one_process(gpt_argv(1, 1, sample_prefix, STEPS))


def _close(result: dict, ref: dict) -> None:
    """Losses (a resumed run's include the checkpoint's) and final weights as the uninterrupted run's."""
    got, want = result["losses"], ref["losses"][:len(result["losses"])]
    assert len(got) == len(want) and all(abs(a - b) <= LOSS_RTOL * abs(b) for a, b in zip(got, want)), (got, want)
    assert max(float((result["weights"][k] - w).abs().max()) for k, w in ref["weights"].items()) <= WEIGHT_ATOL


def test_sharded_checkpoint_loads_into_other_plans_sharded_or_not(reference4, sample_prefix, tmp_path):
    """Saved sharded under TP 2 beside two TP-1 replicas after step 2; loaded (a) sharded into TP 2 -> 1 along a
    pipeline and (b) unsharded into TP 1 -> 2, each continuing to step 4 like the uninterrupted run; (b) saves
    again unsharded after step 3, which (c) loads sharded back into the first plan for step 4. The hetu format
    stores each owned box once; the reshard engine cuts boxes of any plan from it."""
    first, second, third = (_plan(tmp_path, n) for n in ("tp_differs_between_pipelines", "microbatches_3_1",
                                                         "tp_1_to_2_in_pipeline"))
    sharded, plain = tmp_path / "sharded", tmp_path / "plain"
    flag = ("--use-distributed-optimizer",)
    two = ("--train-iters", "2", "--lr-decay-style", "linear", "--lr-decay-iters", "4")
    saved = next(r for r in run_ranks(train, 4, gpt_argv(1, 1, sample_prefix, two + flag + (
        "--hetu-plan", first, "--save", str(sharded))), timeout=240) if r is not None)
    assert saved["losses"] == pytest.approx(reference4["losses"][:2], rel=LOSS_RTOL)
    a = next(r for r in run_ranks(train, 4, gpt_argv(1, 1, sample_prefix, STEPS + flag + (
        "--hetu-plan", second, "--load", str(sharded))), timeout=240) if r is not None)
    _close(a, reference4)
    b = next(r for r in run_ranks(train, 4, gpt_argv(1, 1, sample_prefix, ("--train-iters", "3", "--lr-decay-style",
             "linear", "--lr-decay-iters", "4", "--hetu-plan", third, "--load", str(sharded), "--save", str(plain))),
             timeout=240) if r is not None)
    assert b["losses"] == pytest.approx(reference4["losses"][:3], rel=LOSS_RTOL)
    c = next(r for r in run_ranks(train, 4, gpt_argv(1, 1, sample_prefix, STEPS + flag + (
        "--hetu-plan", first, "--load", str(plain))), timeout=240) if r is not None)
    _close(c, reference4)


def test_migration_between_sharded_plans_continues_the_same_run(reference4, sample_prefix, tmp_path):
    """--hetu-migrate with sharded state: after step 2 from TP 1 -> 2 along a pipeline beside a replica to TP 2
    -> 1 (other owners, other holder sets); the owned masters' moments move through the reshard engine and
    steps 3-4 match the uninterrupted run."""
    first, second = _plan(tmp_path, "tp_1_to_2_in_pipeline"), _plan(tmp_path, "microbatches_3_1")
    argv = gpt_argv(1, 1, sample_prefix, STEPS + ("--use-distributed-optimizer", "--hetu-plan", first,
                                               "--hetu-migrate", f"step=2:plan={second}"))
    result = next(r for r in run_ranks(train, 4, argv, timeout=240) if r is not None)
    assert any(line.startswith("migrated to a new plan after step 2") for line in result["log_lines"])
    _close(result, reference4)


def test_bf16_sharded_follows_the_replicated_optimizer(sample_prefix, tmp_path):
    """--bf16: fp32 masters of the owned boxes only (Megatron's Float16 optimizer over bf16 views), cast into the
    model's views and all-gathered as bf16. Against the replicated optimizer on the same plan (TP 2 beside two
    TP-1 replicas): losses within 1e-6 relative and the bf16 weights within one bf16 rounding (measured: equal);
    a master not cast back or not gathered leaves copies that differ (gather_weights fails) or moves the losses."""
    plan = _plan(tmp_path, "tp_differs_between_pipelines")
    runs = [next(r for r in run_ranks(train, 4, gpt_argv(1, 1, sample_prefix, ("--bf16", "--hetu-plan", plan) + extra),
                                      timeout=240) if r is not None)
            for extra in ((), ("--use-distributed-optimizer",))]
    plain, sharded = runs
    assert sharded["losses"] == pytest.approx(plain["losses"], rel=LOSS_RTOL)
    for key, want in plain["weights"].items():
        assert float((sharded["weights"][key] - want).abs().max()) <= 2**-8 * max(1.0, float(want.abs().max())), key
