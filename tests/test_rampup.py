"""--rampup-batch-size START INCREMENT SAMPLES on hetu_ext's trainer: Megatron-LM's steps, samples and LR.

Pure: each step's global batch and the run's step count equal megatron-core's own
``RampupBatchsizeNumMicroBatchesCalculator`` driven as Megatron-LM's ``update_train_iters`` and ``train`` drive it,
and the LR after each step equals Megatron-core's ``OptimizerParamScheduler`` stepped by each step's global batch
(Megatron-LM's ``train_step``); the pipelines' shares are the largest-remainder apportionment of the planned counts.

Gold: a ramped run (global batches 4, 6, 8, 8, 8) on a heterogeneous 4-rank plan (a TP 2 + TP 1 pipeline with 6
planned microbatches beside a TP 1 replica with 2: shares 3/1, 5/1, 6/2) equals one process on the same global
batches within test_plan_runtime's tolerances (LOSS_RTOL on losses, WEIGHT_ATOL on gathered weights: only the
order of floating-point sums differs); a run whose step reads ``iteration x global batch`` instead of the
consumed samples, or whose pipelines' shares overlap, moves step-2 losses by far more. A DP 2 run saved after step
2 of the ramp 2, 2, 4, 6, 8 and resumed equals the uninterrupted one bit for bit (same layout), and its log lines
carry Megatron-LM's consumed samples, global batches and LRs.
"""

from __future__ import annotations

import re

import pytest
from helpers import compare, gpt_argv, LOSS_RTOL, megatron_lm, WEIGHT_ATOL

from hetu_ext.cli.runs import train
from hetu_ext.plan import Pipeline, Plan, Stage
from hetu_ext.plan.core.batches import BatchRamp, split_microbatches
from hetu_ext.testing.multiproc import run_ranks

# (START, INCREMENT, SAMPLES, global batch, micro batch, data-parallel size, --train-samples)
CASES = [(16, 16, 5859375, 1536, 1, 16, 7_000_000),  # Megatron-LM's examples/gpt3 (train samples cut)
         (4, 2, 8, 8, 1, 1, 34), (2, 2, 12, 8, 1, 2, 38), (32, 32, 1000, 256, 2, 4, 5000), (8, 8, 100, 64, 2, 4, 101),
         (3, 3, 10, 12, 1, 1, 11), (4, 4, 7, 16, 2, 2, 3)]


def _megatron_steps(start, increment, samples, gbs, mbs, dp, train_samples) -> tuple[int, list[int]]:
    """(train_iters, each step's global batch) as Megatron-LM gets them, from megatron-core's calculator."""
    from megatron.core.num_microbatches_calculator import RampupBatchsizeNumMicroBatchesCalculator

    calc = RampupBatchsizeNumMicroBatchesCalculator(gbs, mbs, dp, False, 1, start, increment, samples)
    iterations = consumed = 0  # Megatron-LM's update_train_iters
    while consumed <= samples and consumed <= train_samples:
        calc.update(consumed, consistency_check=False)
        consumed += calc.get_current_global_batch_size()
        iterations += 1
    if train_samples > consumed:
        iterations += (train_samples - consumed) // gbs
    batches, consumed = [], 0  # Megatron-LM's train loop: update_num_microbatches(consumed) before each step
    for _ in range(iterations):
        calc.update(consumed, consistency_check=True)
        batches.append(calc.get_current_running_global_batch_size())
        assert batches[-1] == calc.get() * mbs * dp
        consumed += batches[-1]
    return iterations, batches


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}_{c[1]}_{c[2]}_gbs{c[3]}" for c in CASES])
def test_steps_equal_megatron_cores_calculator(case):
    start, increment, samples, gbs, mbs, dp, train_samples = case
    iterations, want = _megatron_steps(*case)
    ramp = BatchRamp(start=start, increment=increment, samples=samples, global_batch=gbs)
    assert ramp.train_iters(train_samples) == iterations
    assert [ramp.batch(i) for i in range(iterations)] == want
    assert [ramp.consumed(i) for i in range(iterations + 1)] == [sum(want[:i]) for i in range(iterations + 1)]


def _config(*flags: str):
    from hetu_ext.cli.args import parse_run_config

    argv = [t for t in gpt_argv(1, 1, "unused") if t not in ("--train-iters", "3", "--data-path", "unused")]
    return parse_run_config([*argv, "--mock-data", *flags])


def test_lr_equals_megatron_lms_schedule_over_each_steps_batch():
    """The trainer's scheduler (scheduler_settings, stepped by each step's samples as run_step does) against
    Megatron-core's scheduler built with Megatron-LM's sample-based settings and stepped by the calculator's
    global batch: warmup 10 samples and cosine decay over 60 end inside and after the ramp."""
    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from hetu_ext.megatron.state import scheduler_settings
    from hetu_ext.plan.core.batches import batch_ramp

    config = _config("--train-samples", "70", "--rampup-batch-size", "2", "2", "12", "--lr-decay-style", "cosine",
                     "--min-lr", "1e-4", "--lr-warmup-samples", "10", "--lr-decay-samples", "60")
    training = config.training
    iterations, batches = _megatron_steps(2, 2, 12, 8, 2, 1, 70)
    assert training.train_iters == iterations == 11 and batches[:5] == [2, 2, 4, 6, 8]

    def lrs(settings: dict, increments: list[int]) -> list[float]:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
        sched = OptimizerParamScheduler(opt, init_lr=0.0, **settings)
        out = []
        for inc in increments:
            sched.step(increment=inc)
            out.append(opt.param_groups[0]["lr"])
        return out

    megatron = dict(max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=10, lr_decay_steps=60, lr_decay_style="cosine",
                    start_wd=0.01, end_wd=0.01, wd_incr_steps=70, wd_incr_style="constant")
    ramp = batch_ramp(training)
    ours = lrs(scheduler_settings(training, 8), [ramp.batch(i) for i in range(iterations)])
    assert ours == lrs(megatron, batches)
    assert ours != lrs(megatron, [8] * iterations)  # the ramp matters to the LR


def test_shares_are_the_largest_remainder_of_the_planned_counts():
    plan = Plan(pipelines=(Pipeline(num_microbatches=6, stages=(Stage(ranks=(0,), layer_start=0, layer_stop=4),)),
                           Pipeline(num_microbatches=2, stages=(Stage(ranks=(1,), layer_start=0, layer_stop=4),)),
                           Pipeline(num_microbatches=3, stages=(Stage(ranks=(2,), layer_start=0, layer_stop=4),))))
    # quotas at 5 of 11: 2.73, 0.91, 1.36 -> floors 2, 0, 1; the 2 left go to the remainders .91 and .73
    assert split_microbatches(plan, 5) == [3, 1, 1]
    assert split_microbatches(plan, 11) == [6, 2, 3]
    for n in range(0, 23):
        counts = split_microbatches(plan, n)
        assert sum(counts) == n and all(abs(c - n * w / 11) < 1 for c, w in zip(counts, (6, 2, 3)))
    uniform = Plan(pipelines=tuple(Pipeline(num_microbatches=4,
                                            stages=(Stage(ranks=(r,), layer_start=0, layer_stop=4),))
                                   for r in range(2)))
    assert split_microbatches(uniform, 6) == [3, 3] and split_microbatches(uniform, 3) == [2, 1]


@pytest.mark.parametrize("flags,needle", [
    (["--train-iters", "5", "--rampup-batch-size", "4", "2", "8"], "not --train-iters"),
    (["--train-samples", "34", "--rampup-batch-size", "8", "2", "8"], "less than --global-batch-size"),
    (["--train-samples", "34", "--rampup-batch-size", "4", "3", "8"], "multiple of INCREMENT"),
    (["--train-samples", "34", "--rampup-batch-size", "3", "1", "8"], "multiples of --micro-batch-size"),
    (["--train-samples", "34", "--rampup-batch-size", "4", "2", "0"], ">= 1"),
    (["--train-samples", "34", "--rampup-batch-size", "4", "2", "x"], "three integers"),
    (["--train-samples", "34", "--rampup-batch-size", "4", "2", "8", "--hetu-straggler-interval", "2"],
     "--hetu-straggler-interval"),
    (["--train-samples", "34", "--rampup-batch-size", "4", "2", "8", "--hetu-migrate", "2:plan.yaml"],
     "--hetu-migrate"),
])
def test_bad_input_is_one_line(flags, needle):
    with pytest.raises(ValueError) as err:
        _config(*flags)
    assert needle in str(err.value) and "\n" not in str(err.value) and "--rampup-batch-size" in str(err.value)


def test_launcher_refuses_a_ramp_that_leaves_a_pipeline_without_microbatches(tmp_path, capsys):
    """Checked before any rank starts: one line, exit code 2."""
    from hetu_ext.cli.train import main

    plan = tmp_path / "plan.yaml"
    plan.write_text(HETERO_PLAN)
    argv = _ramp_argv("unused", "2", "2", "8", "34", ("--hetu-plan", str(plan)))
    argv = [t for t in argv if t not in ("--data-path", "unused")] + ["--mock-data", "--nproc-per-node", "4"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "gives the plan's 2 pipelines [2, 0] microbatches" in err[0], err


# ---------------------------------------------------------------- gold runs

HETERO_PLAN = ("pipelines: [{num_microbatches: 6, stages: [{ranks: [0, 1], layers: [0, 3]},"
               " {ranks: [2], layers: [3, 4]}]}, {num_microbatches: 2, stages: [{ranks: [3], layers: [0, 4]}]}]")


def _ramp_argv(prefix: str, start: str, increment: str, samples: str, train_samples: str, extra=()) -> list[str]:
    """The gold model at micro batch 1 (global batch 8), ramped, trained on ``train_samples`` samples."""
    argv = gpt_argv(1, 1, prefix, ("--rampup-batch-size", start, increment, samples, "--train-samples",
                                   train_samples, "--lr-decay-style", "cosine", "--min-lr", "1e-4",
                                   "--lr-warmup-samples", "6", "--lr-decay-samples", "40", *extra))
    argv[argv.index("--micro-batch-size") + 1] = "1"
    i = argv.index("--train-iters")
    return argv[:i] + argv[i + 2:]


def _log_fields(lines: list[str]) -> list[tuple[int, int, float]]:
    """(consumed samples, global batch size, LR) of each step's log line."""
    pattern = r"consumed samples:\s+(\d+) .* learning rate: (\S+) \| global batch size:\s+(\d+)"
    return [(int(m[1]), int(m[3]), float(m[2])) for line in lines if (m := re.search(pattern, line))]


def _recording_train(rank: int, world_size: int, argv: list[str], out: str) -> dict | None:
    """hetu_ext.cli.runs.train with every training sample read recorded (SampleRecorder) under ``out``."""
    from pathlib import Path

    from hetu_ext.cli.args import parse_run_config
    from hetu_ext.cli.runs import SampleRecorder
    from hetu_ext.cli.train import build_run
    from hetu_ext.megatron.weights import gather_weights

    trainer = build_run(parse_run_config(argv))
    trainer.dataset = SampleRecorder(trainer.dataset, trainer, Path(out) / f"ids_{world_size}_{rank}.txt")
    lines: list[str] = []
    losses = trainer.train(log=lines.append)
    weights = gather_weights(trainer.model, **trainer.placement.shard_kwargs)
    return {"losses": losses, "weights": weights, "log_lines": lines} if rank == trainer.log_rank else None


def _run_recording(world: int, argv: list[str], out) -> tuple[dict, dict[int, list[int]]]:
    """(the logging rank's result, step -> the distinct sample ids every rank read in it)."""
    from hetu_ext.cli.runs import recorded_samples

    out.mkdir()
    result = next(r for r in run_ranks(_recording_train, world, argv, str(out), timeout=240) if r is not None)
    return result, {step: sorted(set(ids)) for step, ids in recorded_samples(out, world).items()}


def _megatron_lrs(batches: list[int]) -> list[float]:
    """Megatron-core's scheduler with Megatron-LM's settings of _ramp_argv, stepped by each step's batch."""
    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=6,
                                    lr_decay_steps=40, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                                    wd_incr_steps=40, wd_incr_style="constant")
    out = []
    for batch in batches:
        sched.step(increment=batch)
        out.append(opt.param_groups[0]["lr"])
    return out


def _check_steps(lines: list[str], batches: list[int], first: int = 0) -> None:
    """The log lines of steps ``first + 1``... carry Megatron-LM's consumed samples, batches and LRs."""
    fields = _log_fields(lines)
    consumed = [sum(batches[:i + 1]) for i in range(len(batches))]
    assert [(c, b) for c, b, _ in fields] == list(zip(consumed, batches))[first:]
    assert [lr for _, _, lr in fields] == pytest.approx(_megatron_lrs(batches)[first:], rel=1e-6)


def _samples_of(batches: list[int]) -> dict[int, list[int]]:
    """Step (1-based) -> the samples it reads: the ones consumed before it onward, its global batch of them."""
    return {k + 1: list(range(sum(batches[:k]), sum(batches[:k + 1]))) for k in range(len(batches))}


def test_heterogeneous_plan_with_a_ramp_equals_one_process(sample_prefix, tmp_path):
    """With evaluations after steps 2 and 4 and at the end (--global-batch-size samples each, as Megatron-LM's
    evaluate): the same validation losses."""
    argv = _ramp_argv(sample_prefix, "4", "2", "8", "34", ("--split", "80,20,0", "--eval-iters", "1",
                                                          "--eval-interval", "2"))
    batches = [4, 6, 8, 8, 8]
    reference, ref_samples = _run_recording(1, argv, tmp_path / "one")
    plan = tmp_path / "plan.yaml"
    plan.write_text(HETERO_PLAN)
    result, samples = _run_recording(4, argv + ["--hetu-plan", str(plan)], tmp_path / "plan")
    assert len(reference["losses"]) == 5
    _check_steps(reference["log_lines"], batches)
    _check_steps(result["log_lines"], batches)
    assert samples == ref_samples == _samples_of(batches)
    pattern = r"validation loss at .* value: (\S+) \|"
    valid = [[float(m[1]) for line in r["log_lines"] if (m := re.search(pattern, line))] for r in (result, reference)]
    assert len(valid[1]) == 3 and valid[0] == pytest.approx(valid[1], rel=LOSS_RTOL)
    loss_diff, weight_diff = compare(result, reference)
    print(f"ramp 4 -> 8 on a 6/2 plan: loss rel diff {loss_diff:.2e}, weight abs diff {weight_diff:.2e}")
    assert loss_diff <= LOSS_RTOL and weight_diff <= WEIGHT_ATOL


def test_resume_mid_ramp_equals_the_uninterrupted_run(sample_prefix, tmp_path):
    """Saved after steps 1-2 of the ramp 2, 2, 4, 6, 8, 8, 8 (--train-samples 3 stops there, as Megatron-LM's
    update_train_iters counts), resumed with the uninterrupted run's flags (--override-opt_param-scheduler: the
    first run's --train-samples differs, the LR settings do not): steps 3-7 read samples 4-37 and equal the
    uninterrupted run bit for bit (the same DP 2 layout)."""
    batches = [2, 2, 4, 6, 8, 8, 8]
    full, full_samples = _run_recording(2, _ramp_argv(sample_prefix, "2", "2", "12", "38"), tmp_path / "full")
    ckpt = str(tmp_path / "ckpt")
    first, _ = _run_recording(2, _ramp_argv(sample_prefix, "2", "2", "12", "3", ("--save", ckpt)),
                              tmp_path / "first")
    resumed, resumed_samples = _run_recording(
        2, _ramp_argv(sample_prefix, "2", "2", "12", "38", ("--load", ckpt, "--override-opt_param-scheduler")),
        tmp_path / "resumed")
    _check_steps(full["log_lines"], batches)
    _check_steps(resumed["log_lines"], batches, first=2)
    assert full_samples == _samples_of(batches)
    assert resumed_samples == {k: v for k, v in full_samples.items() if k > 2}
    assert first["losses"] == full["losses"][:2]
    assert resumed["losses"] == full["losses"]
    for key, want in full["weights"].items():
        assert (resumed["weights"][key] == want).all(), key


MEGATRON_LM = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
               "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
               "--global-batch-size", "8", "--rampup-batch-size", "4", "2", "8", "--train-samples", "34", "--lr",
               "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-samples", "6",
               "--lr-decay-samples", "40", "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7",
               "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--transformer-impl",
               "local", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm", "--distributed-backend",
               "gloo", "--calculate-per-token-loss", "--eval-iters", "0", "--eval-interval", "1000",
               "--log-interval", "1"]
"""A Megatron-LM command line with examples/gpt3's ramp (sizes cut): 4, 6, 8, 8, 8 samples."""


def test_hand_off_ramps_as_megatron_lms_own_loop(tmp_path):
    """``torchrun -m hetu_ext.megatron_lm pretrain_gpt.py <flags> --rampup-batch-size 4 2 8 --hetu-plan`` (6/2
    microbatches) against Megatron-LM's own loop on the same flags (DP 2, Megatron-LM's native ramp): the same
    consumed samples, global batches and LRs (Megatron-LM logs the LR through a float32 all-reduce: rel 1e-6);
    the hand-off's losses equal one process's (launch/pretrain_gpt.py's parser; the log's 7 digits: rel 2e-6).
    The two loops' losses differ: Megatron-LM initialises weights per rank, hetu_ext per global tensor."""
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "shared" / "thirdparty" / "Megatron-LM-core_v0.16.1" / \
        "pretrain_gpt.py"
    if not script.is_file():
        pytest.skip(f"no Megatron-LM checkout at {script.parent}")
    plan = tmp_path / "plan.yaml"
    plan.write_text("pipelines: [{num_microbatches: 6, stages: [{ranks: [0], layers: [0, 4]}]},"
                    " {num_microbatches: 2, stages: [{ranks: [1], layers: [0, 4]}]}]")
    def launch(*extra: str) -> str:
        proc = megatron_lm(tmp_path, script, *MEGATRON_LM, *extra, timeout=600)
        return proc.stdout + proc.stderr

    handoff = launch("--hetu-plan", str(plan)).splitlines()
    megatron = _log_fields(launch().splitlines())
    fields = _log_fields(handoff)
    assert [(c, b) for c, b, _ in fields] == [(c, b) for c, b, _ in megatron] == \
        [(4, 4), (10, 6), (18, 8), (26, 8), (34, 8)]
    assert [lr for _, _, lr in fields] == pytest.approx([lr for _, _, lr in megatron], rel=1e-6)
    losses = [float(m[1]) for line in handoff if (m := re.search(r"\| lm loss: (\S+) \|", line))]
    reference = run_ranks(train, 1, MEGATRON_LM, False, timeout=300)[0]["losses"]
    assert losses == pytest.approx(reference, rel=2e-6)


@pytest.mark.parametrize("world,extra", [(2, ()), (4, ("--tensor-model-parallel-size", "2"))],
                         ids=["dp2", "tp2_dp2"])
def test_uniform_grid_with_uneven_shares_equals_one_process(world, extra, sample_prefix, one_process):
    """Megatron's own grid (the uniform runtime): the ramp 3, 4, 6, 8, 8 at DP 2 gives the data-parallel ranks
    2/1, 2/2, 3/3, 4/4 microbatches (a share Megatron-LM would refuse, here exact: the loss is normalised by the
    global batch's tokens); equal to one process within the plan runtime's tolerances."""
    argv = _ramp_argv(sample_prefix, "3", "1", "10", "30")
    reference = one_process(argv)
    result = next(r for r in run_ranks(train, world, argv + list(extra), timeout=240) if r is not None)
    assert [(c, b) for c, b, _ in _log_fields(reference["log_lines"])] == \
        [(3, 3), (7, 4), (13, 6), (21, 8), (29, 8)]
    loss_diff, weight_diff = compare(result, reference)
    assert loss_diff <= LOSS_RTOL and weight_diff <= WEIGHT_ATOL
