"""Evaluation (--eval-iters / --eval-interval, hetu_ext/train/eval.py): the validation loss is the same under
every plan, evaluating changes no training number, and it is logged as Megatron-LM logs it and recorded.

The runs are the gold runs of tests/helpers.py (4 layers, 3 Adam steps, global batch 8) on the shipped sample
split 80/10/10, evaluating 2 global batches after step 2 and after step 3 (validation, then test): three
validation-loss records per run. Tolerance: the validation loss is a forward-only token sum of weights that
differ between layouts by the training's reduction order, so it gets the gold runs' loss tolerance (1e-6
relative; measured 1e-8 to 3e-8, printed by test_validation_loss_is_the_same_under_every_plan). A loss averaged
per pipeline instead of per token moves it by 3.2e-3 in the heterogeneous plan (3 microbatches vs 1; tried); a
pipeline's sums missed or counted twice, or batches read from another position of the split, by more.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import LOSS_RTOL, assert_one_error_line, compare, gpt_argv, run

from hetu_ext.cli.args import parse_run_config
from hetu_ext.cli.runs import train
from hetu_ext.metrics import format_eval_lines, read_records
from hetu_ext.testing.multiproc import run_ranks
from hetu_ext.train.eval import Evaluation, check_evaluation, eval_samples

EVAL = ("--split", "80,10,10", "--eval-iters", "2", "--eval-interval", "2")
HETERO = ("pipelines: [{num_microbatches: 3, stages: [{ranks: [0, 1], layers: [0, 3]}, {ranks: [2], layers: [3, 4]}]},"
          " {num_microbatches: 1, stages: [{ranks: [3], layers: [0, 4]}]}]")
"""TP 2 -> 1 along one pipeline beside a TP-1 replica, 3 microbatches vs 1 (test_plan_runtime's microbatches_3_1)."""
IDLE = ("pipelines: [{num_microbatches: 2, stages: [{ranks: [0], layers: [0, 2]}, {ranks: [1], layers: [2, 4]}]},"
        " {num_microbatches: 2, stages: [{ranks: [3], layers: [0, 4]}]}]\nunused_ranks: [2]")
"""An unused rank between the pipelines: it takes no part in evaluating (and must not hang it)."""


def _eval_run(world, argv, metrics):
    """``argv`` on ``world`` ranks writing ``metrics``; the logging rank's result with its eval records."""
    results = run_ranks(train, world, [*argv, "--hetu-metrics-file", str(metrics)], timeout=240)
    result = next(r for r in results if r is not None)
    return {**result, "evals": read_records(metrics, kind="eval"), "records": read_records(metrics)}


@pytest.fixture(scope="module")
def reference(sample_prefix, tmp_path_factory):
    return _eval_run(1, gpt_argv(1, 1, sample_prefix, EVAL), tmp_path_factory.mktemp("eval_ref") / "m.jsonl")


LAYOUTS = [("tp2", 2, (2, 1), ()), ("pp2", 2, (1, 2), ()), ("dp2", 2, (1, 1), ()), ("hetero", 4, (1, 1), HETERO),
           ("unused_rank", 4, (1, 1), IDLE)]


@pytest.mark.parametrize("name,world,shape,plan", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_validation_loss_is_the_same_under_every_plan(name, world, shape, plan, reference, sample_prefix, tmp_path):
    extra = EVAL
    if plan:
        (tmp_path / "plan.yaml").write_text(plan)
        extra = (*EVAL, "--hetu-plan", str(tmp_path / "plan.yaml"))
    result = _eval_run(world, gpt_argv(*shape, sample_prefix, extra), tmp_path / "m.jsonl")
    loss_diff, _ = compare(result, reference)  # the training it evaluates is the gold runs'
    assert loss_diff <= LOSS_RTOL
    got, want = result["evals"], reference["evals"]
    assert [(r["split"], r["iteration"], r["final"]) for r in got] == \
        [(r["split"], r["iteration"], r["final"]) for r in want] == \
        [("valid", 2, False), ("valid", 3, True), ("test", 3, True)]
    diff = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(got, want))
    print(f"{name}: validation losses {[r['loss'] for r in got]}, max rel diff {diff:.2e}")
    assert diff <= LOSS_RTOL
    assert [r["tokens"] for r in got] == [r["tokens"] for r in want] == [512] * 3  # 2 x 8 samples x 32 tokens


def test_evaluations_read_different_batches(reference):
    """Guards the comparison against passing vacuously: the three evaluations differ (the periodic and the
    final one read different validation batches; the test split is another part of the documents)."""
    losses = [r["loss"] for r in reference["evals"]]
    assert len(set(losses)) == 3
    assert all(abs(a - b) > 100 * LOSS_RTOL * b for a, b in zip(losses, losses[1:]))


def test_a_resumed_run_evaluates_the_samples_of_the_uninterrupted_one(reference, sample_prefix, tmp_path):
    """Saved after step 2 and resumed to step 3 (one rank, so bit for bit): the evaluation after the last step
    reads validation batches [2, 4) as the uninterrupted run's does, because the position is derived from the
    step (Megatron-LM's consumed_valid_samples), not counted by the process; a count from the resumed process's
    start would read batches [0, 2) and differ (tried). Then --skip-train on the same checkpoint."""
    schedule = (*EVAL, "--lr-decay-iters", "3")
    saved = _eval_run(1, gpt_argv(1, 1, sample_prefix, (*schedule, "--train-iters", "2", "--save",
                                                         str(tmp_path / "ckpt"))), tmp_path / "a.jsonl")
    resumed = _eval_run(1, gpt_argv(1, 1, sample_prefix, (*schedule, "--load", str(tmp_path / "ckpt"))),
                        tmp_path / "b.jsonl")
    assert saved["evals"][0]["loss"] == reference["evals"][0]["loss"]  # after step 2
    assert [(r["split"], r["iteration"], r["final"]) for r in resumed["evals"]] == [("valid", 3, True),
                                                                                    ("test", 3, True)]
    assert [r["loss"] for r in resumed["evals"]] == [r["loss"] for r in reference["evals"][1:]]
    # --skip-train (Megatron-LM's): no step, no save, one evaluation at the loaded step from the split's start,
    # which is the uninterrupted run's evaluation after step 2
    skipped = _eval_run(1, gpt_argv(1, 1, sample_prefix, (*schedule, "--load", str(tmp_path / "ckpt"),
                                                          "--save", str(tmp_path / "again"), "--skip-train")),
                        tmp_path / "c.jsonl")
    assert skipped["losses"] == saved["losses"]  # the checkpoint's, none added
    assert [r.get("event", r["kind"]) for r in skipped["records"]] == ["checkpoint_load", "eval", "eval"]
    assert [(r["split"], r["iteration"], r["final"]) for r in skipped["evals"]] == [("valid", 2, True),
                                                                                    ("test", 2, True)]
    assert skipped["evals"][0]["loss"] == reference["evals"][0]["loss"]
    assert skipped["evals"][1]["loss"] == saved["evals"][2]["loss"]  # the test split at the same weights


def test_training_is_bit_identical_with_and_without_evaluation(sample_prefix, tmp_path):
    """TP 2 with dropout 0.1, evaluating after every step: the training losses and the final weights equal, bit
    for bit, those of the run without evaluation. Catches a model left in eval mode (dropout off from step 2),
    an RNG stream advanced by evaluation (TP's dropout draws from Megatron's tracker), a training batch taken by
    evaluation, a gradient or optimizer step from it."""
    dropout = ("--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--split", "80,10,10")
    plain = run_ranks(train, 2, gpt_argv(2, 1, sample_prefix, dropout), timeout=180)[0]
    evaluated = _eval_run(2, gpt_argv(2, 1, sample_prefix, (*dropout, "--eval-iters", "2", "--eval-interval", "1")),
                          tmp_path / "m.jsonl")
    assert len(evaluated["evals"]) == 5  # after steps 1, 2 and 3, after the last (validation, test)
    assert evaluated["losses"] == plain["losses"]
    for key, want in plain["weights"].items():
        assert torch.equal(evaluated["weights"][key], want), key


def test_evaluation_runs_in_eval_mode(sample_prefix, tmp_path):
    """With lr 0 the weights stay at their initialisation: the validation loss with dropout 0.5 must equal, bit
    for bit, the one without dropout (dropout is off in eval mode); the training losses must differ (dropout on
    again while training)."""
    runs = []
    for p in ("0", "0.5"):
        argv = gpt_argv(1, 1, sample_prefix, (*EVAL, "--lr", "0", "--min-lr", "0", "--hidden-dropout", p,
                                              "--attention-dropout", p))
        runs.append(_eval_run(1, argv, tmp_path / f"m{p}.jsonl"))
    assert [r["loss"] for r in runs[0]["evals"]] == [r["loss"] for r in runs[1]["evals"]]
    assert runs[0]["losses"][0] != runs[1]["losses"][0]


def test_megatron_lm_block_and_records(reference):
    """The log shows Megatron-LM's block (evaluate_and_print_results: dashes one longer than the line; after
    the last step "on validation set" / "on test set"), formatted from the metrics file's eval records, which
    sit between the step records where the evaluation ran."""
    lines, evals = reference["log_lines"], reference["evals"]
    for record, suffix in zip(evals, ("", " on validation set", " on test set")):
        text = (f" validation loss at iteration {record['iteration']}{suffix} | lm loss value: "
                f"{record['loss']:.6E} | lm loss PPL: {math.exp(record['loss']):.6E} | ")
        at = lines.index(text)
        assert lines[at - 1] == lines[at + 1] == "-" * (len(text) + 1)
        assert record["ppl"] == pytest.approx(math.exp(record["loss"]))
        assert record["samples"] == 16 and record["eval_iters"] == 2 and record["seconds"] > 0
    assert lines.index(format_eval_lines(evals[0])[1]) < next(i for i, line in enumerate(lines)
                                                               if "iteration        3/" in line)
    kinds = [(r["kind"], r["iteration"]) for r in reference["records"]]
    assert kinds == [("step", 1), ("step", 2), ("eval", 2), ("step", 3), ("eval", 3), ("eval", 3)]


MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3"]


def test_refusals_name_the_setting():
    base = [*MODEL, "--mock-data", "--eval-iters", "2"]
    check_evaluation(parse_run_config(base))
    with pytest.raises(ValueError, match="--skip-train only evaluates: give --eval-iters N"):
        check_evaluation(parse_run_config([*MODEL, "--mock-data", "--skip-train"]))
    with pytest.raises(ValueError, match="--eval-interval must be >= 1"):
        check_evaluation(parse_run_config([*base, "--eval-interval", "0"]))
    with pytest.raises(ValueError, match="--eval-iters must be >= 0"):
        check_evaluation(parse_run_config([*MODEL, "--mock-data", "--eval-iters", "-1"]))
    packed = [*MODEL, "--micro-batch-size", "1", "--global-batch-size", "4", "--mock-data", "--hetu-packing", "ffd",
              "--hetu-varlen-mock",
              '{"mode": "distribution", "type": "lognormal", "min_seq_len": 2, "max_seq_len": 30, '
              '"mean_seq_len": 10, "lognormal_sigma": 1.0}', "--eval-iters", "2"]
    with pytest.raises(ValueError, match="not for --hetu-packing ffd"):
        check_evaluation(parse_run_config(packed))
    training = parse_run_config(base).training
    with pytest.raises(ValueError, match="--split 100,0,0 gives it no documents"):
        Evaluation.of(training, "100,0,0", None, None)
    assert Evaluation.of(parse_run_config(MODEL + ["--mock-data"]).training, "100,0,0", None, None) is None


def test_split_sizes_follow_megatron_lm():
    """(train_iters // interval + 1) evaluations of eval_iters global batches (get_train_valid_test_num_samples)."""
    config = parse_run_config([*MODEL, "--mock-data", "--train-iters", "10", "--eval-iters", "3",
                               "--eval-interval", "4"])
    assert eval_samples(config.training, 8) == ((10 // 4 + 1) * 3 * 8, 3 * 8)
    assert eval_samples(parse_run_config([*MODEL, "--mock-data", "--eval-iters", "3"]).training, 8) == (24, 24)
    assert eval_samples(parse_run_config([*MODEL, "--mock-data"]).training, 8) == (0, 0)
    config = parse_run_config([*MODEL, "--mock-data", "--train-iters", "10", "--eval-iters", "3", "--eval-interval",
                               "4", "--skip-train"])
    assert eval_samples(config.training, 8) == (24, 24)  # one evaluation


def test_no_validation_split_is_one_line_and_exit_2(sample_prefix):
    proc = run([*MODEL, "--data-path", sample_prefix, "--split", "100,0,0", "--eval-iters", "2"], timeout=180)
    assert_one_error_line(proc, "--split 100,0,0 gives it no documents")


def test_a_split_part_without_documents_is_one_line_not_a_hang(sample_prefix):
    """The Mixtral example's --split 99990,8,2 on a 79-document dataset leaves validation no document; Megatron-core's
    builder would count its epochs forever."""
    proc = run([*MODEL, "--data-path", sample_prefix, "--split", "99990,8,2", "--eval-iters", "2"], timeout=180)
    assert_one_error_line(proc, "the validation part of")


def test_eval_records_reach_tensorboard_under_megatron_lms_names(tmp_path):
    """An eval record's loss is TensorBoard's ``lm loss validation`` (``lm loss test``) at its iteration, read back
    with tensorboard's own reader; the metrics file keeps the record as written."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hetu_ext.metrics import MetricsWriter

    writer = MetricsWriter(tmp_path / "m.jsonl", tensorboard_dir=str(tmp_path / "tb"))
    for split, iteration, loss in (("valid", 2, 5.5), ("valid", 4, 5.25), ("test", 4, 5.0)):
        writer.evaluation(split=split, iteration=iteration, final=split == "test", loss=loss, ppl=math.exp(loss),
                          eval_iters=2, samples=16, tokens=512, seconds=0.1)
    writer.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("lm loss validation")] == [(2, 5.5), (4, 5.25)]
    assert [(e.step, e.value) for e in events.Scalars("lm loss test")] == [(4, 5.0)]
    assert [r["loss"] for r in read_records(tmp_path / "m.jsonl", kind="eval")] == [5.5, 5.25, 5.0]
