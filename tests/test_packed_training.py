"""Hydraulis gold tests: training on packed, length-aware microbatches equals the single-process reference on the
unpacked documents of the same global batches, under uniform and heterogeneous plans.

The reference runs one rank with ``--hetu-packing unpacked``: each sequence of a global batch is its own
microbatch, through Megatron's ordinary causal attention. The packed runs put several sequences in one THD pack
(PackedDotProductAttention, document-causal), spread the global batch over pipelines of different depth and
speed, and choose microbatch counts per step; the loss is a per-token sum normalised once per global batch, so
packing changes only the order of floating-point sums.

Tolerances (fp32, 3 Adam steps at lr 1e-3): measured here, losses agree within 2.3e-8 relative and weights within
1.1e-6 absolute (Adam divides near-zero gradients by their own RMS, which amplifies last-bit differences); we allow
the uniform-equivalence test's 1e-6 / 2e-6. A pack whose documents attended to each
other, a sequence dropped or counted twice, or a loss normalised per microbatch moves losses by > 1e-3.
"""

from __future__ import annotations

import json

import pytest
from helpers import LENGTHS, LOSS_RTOL, WEIGHT_ATOL, compare, packed_argv

from hetu_ext.testing.multiproc import run_ranks
from hetu_ext.cli.runs import train

@pytest.fixture(scope="module")
def reference(one_process):
    return one_process(packed_argv("unpacked"))


HETERO = """
pipelines:
  - num_microbatches: 1
    stages:
      - {ranks: [0], layers: [0, 4]}
  - num_microbatches: 1
    stages:
      - {ranks: [1], layers: [0, 1]}
      - {ranks: [2], layers: [1, 4]}
"""

CASES = {  # name: (ranks, method, extra flags)
    "dp2-balanced": (2, "balanced", ()),
    "pp2-balanced": (2, "balanced", ("--pipeline-model-parallel-size", "2")),
    "dp2-greedy": (2, "greedy", ()),
    "hetero-balanced": (3, "balanced", ("--hetu-plan", "HETERO")),  # pipelines of 1 and 2 stages
    # the straggler monitor times layers and divides by each step's packed work: it must not change the math
    "dp2-balanced-monitored": (2, "balanced", ("--hetu-straggler-interval", "1")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_packed_training_matches_unpacked_reference(case, reference, tmp_path):
    world, method, extra = CASES[case]
    plan = tmp_path / "hetero.yaml"
    plan.write_text(HETERO)
    extra = tuple(str(plan) if e == "HETERO" else e for e in extra)
    result = run_ranks(train, world, packed_argv(method, *extra), timeout=240)[0]
    loss_diff, weight_diff = compare(result, reference)
    print(f"{case}: loss rel diff {loss_diff:.2e}, weight abs diff {weight_diff:.2e}")
    assert loss_diff <= LOSS_RTOL and weight_diff <= WEIGHT_ATOL, (loss_diff, weight_diff)
    # the global batch is the reference's: same sequences consumed, same tokens
    assert [l.split("consumed samples:")[1].split("|")[0] for l in result["log_lines"]] == \
        [l.split("consumed samples:")[1].split("|")[0] for l in reference["log_lines"]]


def _packed_steps(method: str, *, documents: int, seed: int):
    """Pipeline 0's packed steps over ``documents`` lognormal documents (LENGTHS) split at 64 tokens, 600-token
    global batches, a uniform 2-pipeline plan of the gold tests' model, default cost table."""
    import numpy as np
    import torch

    from hetu_ext.data.cost import CostTable
    from hetu_ext.data.lengths import parse_length_spec
    from hetu_ext.plan.core.replicas import replica_specs
    from hetu_ext.data.sequences import GlobalBatches, SequenceTable
    from hetu_ext.megatron.packed_data import PackedSteps, SyntheticDocuments
    from hetu_ext.plan import ModelSpec, uniform_plan

    lengths = parse_length_spec(LENGTHS).sample(documents, seed)
    docs = SyntheticDocuments(np.asarray(lengths) + 1, 257, seed)
    table = SequenceTable.from_documents(docs.token_counts, 64)
    spec = ModelSpec(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=257,
                     seq_length=64)
    replicas = replica_specs(uniform_plan(world_size=2, num_layers=4), spec, CostTable(), max_pack_tokens=64)
    return PackedSteps(docs, table, GlobalBatches(table, seed=seed, tokens=600), method=method, replicas=replicas,
                       pipeline=0, max_len=64, device=torch.device("cpu"))


def test_packing_packs_several_sequences_per_microbatch(reference):
    """The reference runs one sequence per microbatch; balanced packing must actually pack (else the gold test
    above would compare the reference with itself)."""
    steps = _packed_steps("balanced", documents=2000, seed=7)
    try:
        ids, per, _ = steps.plan_step(0)
        packs = [mb for rep in per for mb in rep]
        assert sum(len(mb) for mb in packs) == ids.size  # every sequence once
        assert len(packs) < ids.size  # several sequences share a pack
        assert all(sum(n for _, _, n in mb) <= 64 for mb in packs)
        batch = steps.step(0).microbatches[0]
        cu = batch["packed_seq_params"].cu_seqlens_q
        assert int(cu[-1]) == batch["tokens"].shape[1] and cu.numel() >= 2
    finally:
        steps.close()


def _cli_argv(*data: str) -> list[str]:
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "64",
            "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "1", "--lr", "1e-3",
            "--hetu-packing", "balanced", *data]


def test_bad_data_gives_one_clear_error(tmp_path):
    """Acceptance 5: a dataset path that does not exist, an empty dataset, a length file with a non-integer line:
    exit code 2 and one error line naming the file (and the line)."""
    from helpers import assert_one_error_line, run

    from hetu_ext.megatron.preprocess_data import preprocess

    missing = str(tmp_path / "nowhere_text_document")
    assert_one_error_line(run(_cli_argv("--data-path", missing)), f"{missing}.idx not found")

    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n' * 3)  # documents of the EOD token only
    prefix, count = preprocess(str(tmp_path / "empty.jsonl"), str(tmp_path / "empty"))
    assert count == 3
    assert_one_error_line(run(_cli_argv("--data-path", prefix)), "the dataset is empty")

    lengths = tmp_path / "lengths.txt"
    lengths.write_text("12\n7\nseven\n")
    spec = json.dumps({"mode": "file", "path": str(lengths)})
    proc = run(_cli_argv("--mock-data", "--hetu-varlen-mock", spec))
    assert_one_error_line(proc, str(lengths))
    assert "line 3" in proc.stderr and "'seven'" in proc.stderr


def test_packing_section_of_hetu_config(tmp_path):
    """``packing:`` in --hetu-config fills the --hetu-* packing flags (paths relative to the file), the command
    line wins, and an unknown key is named with the closest valid one."""
    from hetu_ext.config import build_parser, from_namespace, parse_namespace

    config = tmp_path / "hydraulis.yaml"
    config.write_text("packing:\n  method: greedy\n  global_batch_tokens: 4096\n  cost_model: cal/cpu.yaml\n"
                      "  varlen_mock: {mode: file, path: lens.txt}\n")
    argv = [a for a in _cli_argv("--mock-data", "--hetu-config", str(config)) if a != "balanced"]
    argv.remove("--hetu-packing")  # not given on the command line: the file's method
    packing = from_namespace(parse_namespace(argv, build_parser())).packing
    assert (packing.method, packing.global_batch_tokens) == ("greedy", 4096)
    assert packing.cost_model == str(tmp_path / "cal" / "cpu.yaml")
    assert json.loads(packing.varlen_mock) == {"mode": "file", "path": str(tmp_path / "lens.txt")}
    packing = from_namespace(parse_namespace(_cli_argv("--mock-data", "--hetu-config", str(config)),
                                             build_parser())).packing
    assert (packing.method, packing.global_batch_tokens) == ("balanced", 4096)  # the typed flag wins
    config.write_text("packing:\n  methods: balanced\n")
    with pytest.raises(ValueError, match=r"unknown key 'methods' under packing in --hetu-config .*; did you mean "
                                         r"'method'\?"):
        parse_namespace(_cli_argv("--mock-data", "--hetu-config", str(config)), build_parser())


@pytest.mark.parametrize("method", ["concat", "concat-causal"])
def test_concat_baselines_cover_every_position_once(method):
    """The Megatron-style baselines: packs of exactly --seq-length tokens (the last may be short) covering every
    (input, label) position of the global batch once; ``concat`` attends per piece, ``concat-causal`` over the
    whole pack with positions running through it."""
    steps = _packed_steps(method, documents=500, seed=3)
    table = steps.table
    try:
        ids, per, _ = steps.plan_step(1)
        covered = {}
        for mb in (mb for rep in per for mb in rep):
            for seq, offset, count in mb:
                covered.setdefault(seq, []).append((offset, count))
        assert sorted(covered) == sorted(ids.tolist())
        for seq, parts in covered.items():  # consecutive pieces, no gap or overlap, the whole sequence
            parts.sort()
            assert parts[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(parts, parts[1:]))
            assert parts[-1][0] + parts[-1][1] == table.length[seq]
        sizes = [sum(n for *_, n in mb) for rep in per for mb in rep]
        assert all(n == 64 for n in sizes[:-1]) and 0 < sizes[-1] <= 64
        batch = steps.step(1).microbatches[0]
        cu = batch["packed_seq_params"].cu_seqlens_q.tolist()
        if method == "concat-causal":
            assert cu == [0, 64] and batch["position_ids"].tolist() == [list(range(64))]
        else:
            assert len(cu) > 2  # several pieces, each attending to itself
    finally:
        steps.close()


def test_a_pipeline_the_packer_leaves_empty_gets_a_sequence():
    """Each pipeline's schedule and gradient sync take part in every step, so a pipeline with no document (fewer
    documents than pipelines, or a far slower pipeline) receives the shortest sequence of the fullest one."""
    from hetu_ext.megatron.packed_data import _fill_empty

    per = [[[(1, 0, 30), (2, 0, 5)], [(3, 0, 9)]], [], [[(4, 0, 7)]]]
    assert _fill_empty(per) == [[[(1, 0, 30)], [(3, 0, 9)]], [[(2, 0, 5)]], [[(4, 0, 7)]]]


def test_pipelines_run_microbatches_most_expensive_first():
    """Under 1F1B a stage runs microbatch k's backward while its predecessor runs k + 1's forward; decreasing
    costs keep the predecessor from making it wait, and the drain is the cheapest microbatch's backward."""
    from hetu_ext.data.cost import LengthCost
    from hetu_ext.data.packing import ReplicaSpec
    from hetu_ext.megatron.packed_data import _fill_drain_order

    replica = ReplicaSpec(stage_costs=(LengthCost(a=1e-6, b=1e-4),) * 2, token_capacity=64)
    mbs = [[(0, 0, 40)], [(1, 0, 10)], [(2, 0, 64)], [(3, 0, 20)], [(4, 0, 30)]]
    assert _fill_drain_order(mbs, replica) == [[(2, 0, 64)], [(0, 0, 40)], [(4, 0, 30)], [(3, 0, 20)], [(1, 0, 10)]]
