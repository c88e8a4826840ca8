"""Context parallelism (issue 48) on the plan runtime: plans whose stages split every sequence over their CP ranks
train exactly like one process.

A stage of ``cp: 2`` holds two load-balanced chunks of every sequence per CP rank (chunks r and 3 - r of 4),
all-gathers keys and values over its CP group (the backward reduce-scatters their gradients) and attends with the
global causal positions; RoPE and learned positions see global positions, THD packs are split document by
document (padded to a multiple of 4), and the gradients of the weights (replicated over CP) are summed over DP x
CP. The gold runs below (K=3 Adam steps of the 4-layer gold model, 4 ranks at most) compare losses and gathered
weights with the single-process references the other gold modules use (conftest's ``one_process``), at the
uniform-equivalence tolerances (1e-6 relative on losses, 2e-6 absolute on weights): CP changes only the order of
floating-point sums. Measured on 2026-12-07 (2-core CPU, gloo): CP 2 beside a CP 1 PP 2 pipeline, GPT 5.2e-8 /
2.4e-7 and Llama 5.0e-8 / 6.0e-7; Llama PP 2 x CP 2 4.0e-8 / 6.0e-7 (TP 2 x CP 2: 2.0e-8 / 6.6e-7); packed CP 2
beside CP 1, GPT 2.0e-8 / 2.2e-7 and Llama 1.6e-8 / 9.9e-8; the migration CP 1 -> TP 2 x CP 2 -> CP 1 4.1e-8 /
5.4e-7.

What each would catch: a chunk attending to the wrong keys (no gather, wrong order, a top-left causal mask)
moves the losses far beyond the tolerance (the negative control below runs without the gather: 2.1e-4 relative
on the step-1 loss, 5.9e-3 on the weights); a gradient not summed over the CP ranks (were they one contributor of
the layout) leaves the CP ranks' copies of a weight different, which gather_weights refuses, and the pure layout
test below names the lanes that sum them.
"""

from __future__ import annotations

import pytest
from helpers import LLAMA, LOSS_RTOL, MODEL, WEIGHT_ATOL, assert_one_error_line, compare, gpt_argv, packed_argv, run

from hetu_ext.cli.runs import train
from hetu_ext.testing.multiproc import run_ranks

BESIDE_CP1 = """
pipelines:
  - num_microbatches: 2
    stages:
      - {ranks: [0, 1], layers: [0, 4], cp: 2}
  - num_microbatches: 2
    stages:
      - {ranks: [2], layers: [0, 2]}
      - {ranks: [3], layers: [2, 4]}
"""
"""CP 2 (TP 1) holding the whole model beside a CP 1 pipeline of two stages."""

PP2_CP2 = """
pipelines:
  - num_microbatches: 4
    stages:
      - {ranks: [0, 1], layers: [0, 1], cp: 2}
      - {ranks: [2, 3], layers: [1, 4], cp: 2}
"""
"""Two CP 2 stages: each CP rank's chunks pass to the next stage's rank of the same CP rank."""

PACKED_BESIDE_CP1 = """
pipelines:
  - num_microbatches: 1
    stages:
      - {ranks: [0, 1], layers: [0, 4], cp: 2}
  - num_microbatches: 1
    stages:
      - {ranks: [2], layers: [0, 4]}
"""

STEPS = ("--train-iters", "4", "--lr-decay-style", "linear")
"""test_migration's run (its reference is shared through ``one_process``)."""
CP1 = ("pipelines: [{num_microbatches: 2, stages: [{ranks: [0, 1], layers: [0, 4]}]},"
       " {num_microbatches: 2, stages: [{ranks: [2], layers: [0, 2]}, {ranks: [3], layers: [2, 4]}]}]")
TP2_CP2 = "pipelines: [{num_microbatches: 4, stages: [{ranks: [0, 1, 2, 3], layers: [0, 4], cp: 2}]}]"


def _plan_run(tmp_path, world: int, text: str, argv: list[str], body=train) -> dict:
    plan = tmp_path / "plan.yaml"
    plan.write_text(text)
    return next(r for r in run_ranks(body, world, [*argv, "--hetu-plan", str(plan)], timeout=300) if r is not None)


@pytest.mark.parametrize("model", [(), LLAMA], ids=["gpt", "llama"])
def test_cp2_beside_a_cp1_pipeline_equals_one_process(sample_prefix, one_process, tmp_path, model):
    result = _plan_run(tmp_path, 4, BESIDE_CP1, gpt_argv(1, 1, sample_prefix, model))
    loss_diff, weight_diff = compare(result, one_process(gpt_argv(1, 1, sample_prefix, model)))
    print(f"{'Llama' if model else 'GPT'} cp 2 beside cp 1: loss rel diff {loss_diff:.2e}, weight abs diff "
          f"{weight_diff:.2e}")
    assert loss_diff <= LOSS_RTOL and weight_diff <= WEIGHT_ATOL, (loss_diff, weight_diff)


def test_llama_pp2_cp2_with_the_sharded_optimizer_equals_one_process(sample_prefix, one_process, tmp_path):
    """RoPE at global positions (Megatron-core's CP slicing), GQA keys gathered per group, chunks passed between
    stages by CP rank, and the sharded optimizer's reduce-scatter over DP x CP (its holders: both CP ranks)."""
    result = _plan_run(tmp_path, 4, PP2_CP2, gpt_argv(1, 1, sample_prefix, (*LLAMA, "--use-distributed-optimizer")))
    loss_diff, weight_diff = compare(result, one_process(gpt_argv(1, 1, sample_prefix, LLAMA)))
    print(f"Llama pp 2 x cp 2: loss rel diff {loss_diff:.2e}, weight abs diff {weight_diff:.2e}")
    assert loss_diff <= LOSS_RTOL and weight_diff <= WEIGHT_ATOL, (loss_diff, weight_diff)


@pytest.mark.parametrize("model", [(), LLAMA], ids=["gpt", "llama"])
def test_packed_cp2_beside_cp1_equals_unpacked(one_process, tmp_path, model):
    """THD packs of log-normal documents (most not a multiple of 4: padded per document), split over 2 CP ranks
    beside a CP 1 pipeline, against one sequence per microbatch on one process."""
    result = _plan_run(tmp_path, 3, PACKED_BESIDE_CP1, packed_argv("balanced", *model))
    loss_diff, weight_diff = compare(result, one_process(packed_argv("unpacked", *model)))
    print(f"{'Llama' if model else 'GPT'} packed cp 2 beside cp 1: loss rel diff {loss_diff:.2e}, weight abs diff "
          f"{weight_diff:.2e}")
    assert loss_diff <= LOSS_RTOL and weight_diff <= WEIGHT_ATOL, (loss_diff, weight_diff)


def test_migration_cp1_to_cp2_and_back_continues_the_same_run(sample_prefix, one_process, tmp_path):
    """After step 1 the run moves from CP 1 (TP 2 beside PP 2) to one TP 2 x CP 2 stage, after step 3 back: the
    weights and Adam moments move by the reshard engine (replicated over CP: one more holder per element)."""
    cp1, cp2 = tmp_path / "cp1.yaml", tmp_path / "cp2.yaml"
    cp1.write_text(CP1)
    cp2.write_text(TP2_CP2)
    argv = gpt_argv(1, 1, sample_prefix, (*STEPS, "--hetu-migrate", f"step=1:plan={cp2},step=3:plan={cp1}"))
    result = _plan_run(tmp_path, 4, CP1, argv)
    reference = one_process(gpt_argv(1, 1, sample_prefix, STEPS))
    assert len(result["losses"]) == len(reference["losses"]) == 4
    loss_diff, weight_diff = compare(result, reference)
    print(f"migration cp 1 -> cp 2 -> cp 1: loss rel diff {loss_diff:.2e}, weight abs diff {weight_diff:.2e}")
    assert loss_diff <= LOSS_RTOL and weight_diff <= WEIGHT_ATOL, (loss_diff, weight_diff)
    moves = [line.split(" in ")[0] for line in result["log_lines"] if line.startswith("migrated to a new plan")]
    assert moves == ["migrated to a new plan after step 1", "migrated to a new plan after step 3"], moves


def _train_without_the_gather(rank: int, world: int, argv: list[str]) -> dict | None:
    """The negative control's rank body: CP attention that skips the key/value all-gather (each rank's slots
    hold its own chunks), as a runtime that forgot CP in the attention would compute."""
    from hetu_ext.megatron import context_parallel

    context_parallel.gather_over_group = lambda x, group: x.unsqueeze(0).expand(group.size(), *x.shape)
    return train(rank, world, argv)


def test_negative_control_without_the_key_value_gather_the_loss_is_wrong(sample_prefix, one_process, tmp_path):
    """The gold tests' comparison catches a CP attention that sees only its own chunks: measured 2.1e-4 relative
    on the step-1 loss (the gold model's attention at initialisation is nearly uniform, so the loss moves little;
    still 200x the tolerance), and the weights far outside theirs."""
    plan = "pipelines: [{num_microbatches: 4, stages: [{ranks: [0, 1], layers: [0, 4], cp: 2}]}]"
    result = _plan_run(tmp_path, 2, plan, gpt_argv(1, 1, sample_prefix), body=_train_without_the_gather)
    reference = one_process(gpt_argv(1, 1, sample_prefix))
    first = abs(result["losses"][0] - reference["losses"][0]) / reference["losses"][0]
    loss_diff, weight_diff = compare(result, reference)
    print(f"without the gather: step-1 loss rel diff {first:.2e}, weight abs diff {weight_diff:.2e}")
    assert first > 100 * LOSS_RTOL and weight_diff > 10 * WEIGHT_ATOL, (first, weight_diff)


# ---------------------------------------------------------------- pure: the split, the layout, the rules


def _pack(lengths: list[int]):
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    t = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    ids = torch.arange(t)[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]  # each document from 0, as packed_data's
    return {"tokens": ids + 100, "labels": ids + 200, "loss_mask": torch.ones(1, t), "position_ids": positions,
            "packed_seq_params": PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                 max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))}


def test_a_pack_is_split_document_by_document_into_load_balanced_chunks():
    """Documents of 5 and 11 tokens over CP 2: padded to 8 and 12 (chunks of 2 and 3); rank r keeps chunks r and
    3 - r of each; every real token on exactly one rank, pads masked at position 0; cu_seqlens the padded global
    bounds; the global positions kept."""
    from hetu_ext.megatron.context_parallel import cp_part

    batch = _pack([5, 11])
    parts = [cp_part(batch, r, 2) for r in range(2)]
    assert [p["packed_seq_params"].cu_seqlens_q.tolist() for p in parts] == [[0, 8, 20]] * 2
    assert parts[0]["position_ids"].tolist() == [[0, 1, 0, 0, 0, 1, 2, 9, 10, 0]]
    assert parts[1]["position_ids"].tolist() == [[2, 3, 4, 0, 3, 4, 5, 6, 7, 8]]
    kept = sorted(int(t) for p in parts for t, m in zip(p["tokens"][0], p["loss_mask"][0]) if m > 0)
    assert kept == list(range(100, 116))  # every real token once
    assert all(p["packed_seq_params"].max_seqlen_q == 12 for p in parts)
    assert cp_part(batch, 0, 1) is batch


def test_sequences_are_split_into_chunks_r_and_2cp_minus_1_minus_r():
    import torch

    from hetu_ext.megatron.context_parallel import cp_part

    rows = torch.arange(16).view(2, 8)
    batch = {"tokens": rows, "labels": rows, "loss_mask": torch.ones(2, 8), "position_ids": rows % 8}
    assert cp_part(batch, 1, 2)["position_ids"].tolist() == [[2, 3, 4, 5], [2, 3, 4, 5]]
    assert cp_part(batch, 0, 4)["tokens"].tolist() == [[0, 7], [8, 15]]
    odd = {key: value[:, :7] for key, value in batch.items()}  # a 7-token sequence: one pad, masked
    part = cp_part(odd, 1, 2)
    assert part["tokens"].tolist()[0] == [2, 3, 4, 5] and cp_part(odd, 0, 2)["loss_mask"].tolist()[0] == [1, 1, 1, 0]


def test_cp_ranks_are_contributors_of_the_gradient_reduction():
    """A CP 2 stage alone: its two CP ranks each hold a partial gradient, so every element is summed over them (a
    lane per TP rank); counted as one contributor (the TP copies' rule) no lane would be made."""
    from hetu_ext.plan.core.layout import ShardInfo, reduction_layout
    from hetu_ext.plan.core.optimizer_shards import optimizer_shards

    def shard(rank, cp_index, tp_index, box):
        return ShardInfo(rank=rank, stage=(0, 0), tp_index=tp_index, key="w", index=(), box=box, cp_index=cp_index)

    shards = [shard(0, 0, 0, ((0, 2),)), shard(1, 0, 1, ((2, 4),)), shard(2, 1, 0, ((0, 2),)),
              shard(3, 1, 1, ((2, 4),))]  # TP 2 x CP 2
    assert set(reduction_layout(shards).lanes) == {(0, 2), (1, 3)}
    assert all(s.reduce for s in optimizer_shards(shards).sets)
    as_tp_copies = [ShardInfo(**{**s.__dict__, "cp_index": 0}) for s in shards]
    assert reduction_layout(as_tp_copies).lanes == {}


def test_neighbours_pass_each_cp_ranks_chunks_along_the_pipeline():
    import yaml

    from hetu_ext.plan.core.io import plan_from_dict
    from hetu_ext.plan.core.plan import neighbours

    plan = plan_from_dict(yaml.safe_load(PP2_CP2))
    assert neighbours(plan, 1).send_forward_to == (3,) and neighbours(plan, 2).recv_forward_from == 0
    assert neighbours(plan, 3).send_backward_to == (1,)


def test_context_parallel_size_makes_megatrons_tp_cp_dp_pp_grid():
    from hetu_ext.cli.args import parse_run_config
    from hetu_ext.megatron.launch_plan import check_launch

    config = parse_run_config([*MODEL, "--mock-data", "--train-iters", "1", "--global-batch-size", "4",
                               "--tensor-model-parallel-size", "2", "--context-parallel-size", "2"])
    launch = check_launch(config, 8)
    assert launch.runtime == "plan"
    assert [(s.ranks, s.cp) for p in launch.plan.pipelines for s in p.stages] == [((0, 1, 2, 3), 2),
                                                                                   ((4, 5, 6, 7), 2)]


@pytest.mark.parametrize("world, text, extra, needle", [
    (3, "pipelines: [{num_microbatches: 4, stages: [{ranks: [0, 1], layers: [0, 2], cp: 2},"
        " {ranks: [2], layers: [2, 4]}]}]", (), "the same cp"),
    (2, "pipelines: [{num_microbatches: 4, stages: [{ranks: [1, 0], layers: [0, 4], cp: 2}]}]", (),
     "increasing order"),
    (2, "pipelines: [{num_microbatches: 4, stages: [{ranks: [0, 1], layers: [0, 4], cp: 2}]}]",
     ("--hetu-attention", "megatron"), "--hetu-attention megatron"),
])
def test_what_cp_does_not_run_is_one_line(tmp_path, world, text, extra, needle):
    from hetu_ext.cli.args import parse_run_config
    from hetu_ext.megatron.launch_plan import check_launch

    plan = tmp_path / "plan.yaml"
    plan.write_text(text)
    config = parse_run_config([*MODEL, "--mock-data", "--train-iters", "1", "--global-batch-size", "8",
                               "--hetu-plan", str(plan), *extra])
    with pytest.raises(ValueError, match=needle) as err:
        check_launch(config, world)
    assert "\n" not in str(err.value)


def test_cp_with_sequence_parallel_exits_2_with_one_line():
    proc = run([*MODEL, "--mock-data", "--train-iters", "1", "--tensor-model-parallel-size", "2",
                "--context-parallel-size", "2", "--sequence-parallel", "--nproc-per-node", "4"])
    assert_one_error_line(proc, "--sequence-parallel")
