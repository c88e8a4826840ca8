"""Straggler-weighted microbatches on DeepSpeed's engine (ZeRO-1 and ZeRO-0, unmanaged gradient accumulation) equal
the single-process run on the same global batches.

Two ranks split each global batch of 4 microbatches 3:1 (given, and found by the straggler monitor from an
emulated 3x straggler). Each rank's loss is its token sum over the global batch's tokens times the world size
(DeepSpeed averages over ranks), so the update is the single-process one for any split; the order of
floating-point sums differs (per rank, then across ranks), hence test_uniform_equivalence's tolerances (1e-6
relative on losses, 2e-6 absolute on weights). Negative control: each rank normalising by its own tokens (the
default of a data-parallel engine) weighs rank 1's single microbatch 3x too much and moves the weights by far
more than the tolerance, so the test catches a lost global normalisation.
"""

from __future__ import annotations

import re

import pytest
import torch
from test_ckpt_resume import SCHEDULE
from test_ckpt_resume import _run as megatron_run
from helpers import LOSS_RTOL, WEIGHT_ATOL, gpt_argv

from hetu_ext.testing.multiproc import run_ranks

STEPS = 4


def weighted_body(rank: int, world: int, argv: list[str], microbatches: tuple[int, ...] | None,
                  interval: int, per_rank_normalisation: bool = False, stage: int = 1) -> dict | None:
    from hetu_ext.config import from_namespace
    from hetu_ext.deepspeed.engine import ZeroConfig, add_deepspeed_args, build
    from hetu_ext.deepspeed.zero_checkpoint import hetu_name
    from hetu_ext.cli.args import build_parser, validate_args

    args = add_deepspeed_args(build_parser()).parse_args(argv)
    validate_args(args)
    run = build(from_namespace(args), ZeroConfig(stage=stage, microbatches=microbatches, straggler_interval=interval))
    if per_rank_normalisation:  # the control: this rank's mean instead of a share of the global batch's mean
        backward, factor = run.engine.backward, sum(run.weighting.counts) / run.weighting.counts[rank]
        run.engine.backward = lambda loss, **kw: backward(loss * factor, **kw)
    lines: list[str] = []
    losses = run.train(log=lines.append)
    tensors = {hetu_name("param", n): p.detach().clone() for n, p in run.engine.module.named_parameters()}
    return {"losses": losses, "tensors": tensors, "history": run.weighting.history, "lines": lines} \
        if rank == 0 else None


def _argv_steps(sample_prefix: str, extra: tuple[str, ...] = ()) -> list[str]:
    return gpt_argv(1, 1, sample_prefix, SCHEDULE + ("--train-iters", str(STEPS)) + extra)


EMULATED = ("--hetu-straggler-interval", "1", "--hetu-straggler-window", "2", "--hetu-emulate-layer-ms", "10",
            "--hetu-emulate-slowdown", "step=1:rank=1:x=3")
"""Rank 1 emulated 3x slower from step 1 (every layer's forward 10 ms of emulated device time, backward 20 ms),
timings exchanged after every step, a 2-step window."""

TWO_RANK_CASES = {  # name: (ZeRO stage, --hetu-microbatches, straggler interval, per-rank normalisation, flags)
    "zero1": (1, (3, 1), 0, False, ()), "zero1_control": (1, (3, 1), 0, True, ()), "zero0": (0, (3, 1), 0, False, ()),
    "zero0_bf16": (0, (3, 1), 0, False, ("--bf16",)), "zero1_emulated": (1, None, 1, False, EMULATED)}
"""The 2-rank runs of the tests below, one engine after the other in one launch."""


def weighted_bodies(rank: int, world: int, argv: list[str]) -> dict[str, dict] | None:
    """TWO_RANK_CASES in these processes; rank 0 reports each."""
    out = {name: weighted_body(rank, world, argv + list(flags), microbatches, interval, control, stage)
           for name, (stage, microbatches, interval, control, flags) in TWO_RANK_CASES.items()}
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def two_rank_runs(sample_prefix) -> dict[str, dict]:
    """One 2-rank launch of the five ZeRO-0/1 runs (a launch's start-up costs more than a run's 4 steps)."""
    return run_ranks(weighted_bodies, 2, _argv_steps(sample_prefix), timeout=300)[0]


@pytest.fixture(scope="module")
def reference(sample_prefix):
    return megatron_run(1, _argv_steps(sample_prefix))["final"]


def _diffs(result: dict, reference: dict) -> tuple[float, float]:
    assert len(result["losses"]) == len(reference["losses"]) == STEPS
    loss = max(abs(a - b) / abs(b) for a, b in zip(result["losses"], reference["losses"]))
    params = {k: v for k, v in reference["tensors"].items() if k[0].startswith("param/")}
    assert result["tensors"].keys() == params.keys()
    return loss, max(float((result["tensors"][k] - v).abs().max()) for k, v in params.items())


def test_zero1_weighted_3_to_1_equals_single_process(reference, two_rank_runs):
    """Given counts 3:1 (micro-batch 2, global batch 8): the same losses and weights as one process."""
    result = two_rank_runs["zero1"]
    loss, weight = _diffs(result, reference)
    print(f"ZeRO-1 weighted 3:1 vs single process: loss rel diff {loss:.2e}, weight abs diff {weight:.2e}")
    assert result["history"] == [(1, (3, 1))]
    assert loss <= LOSS_RTOL and weight <= WEIGHT_ATOL
    control = two_rank_runs["zero1_control"]
    _, control_weight = _diffs(control, reference)
    print(f"per-rank normalisation (control): weight abs diff {control_weight:.2e}")
    assert control_weight > 100 * WEIGHT_ATOL


def test_zero0_weighted_3_to_1_equals_single_process(reference, two_rank_runs):
    """ZeRO-0 (DeepSpeed without ZeRO): the backwards accumulate locally and ``step()`` all-reduces once, so the
    3:1 split works as under ZeRO-1, within the same tolerances of one process (the clipping is DeepSpeed's fp32
    path here, grads x clip / (norm + 1e-6) as Megatron's)."""
    result = two_rank_runs["zero0"]
    loss, weight = _diffs(result, reference)
    print(f"ZeRO-0 weighted 3:1 vs single process: loss rel diff {loss:.2e}, weight abs diff {weight:.2e}")
    assert result["history"] == [(1, (3, 1))]
    assert loss <= LOSS_RTOL and weight <= WEIGHT_ATOL


def test_zero0_bf16_weighted_3_to_1_follows_single_process(two_rank_runs, sample_prefix):
    """ZeRO-0 with --bf16 (DeepSpeed's FP16_UnfusedOptimizer: an fp32 copy of every parameter, whole on every
    rank; its start-up step on zero gradients undone, engine_state.undo_initial_step): 3:1 over 2 ranks follows
    the single-process bf16 run within test_ckpt_resume's BF16_LOSS_RTOL on the losses. Without the undo, Adam's
    bias correction runs one step ahead and the losses differ by 4.7e-3 (measured; 1.4e-5 with it)."""
    from test_ckpt_resume import BF16_LOSS_RTOL

    argv = _argv_steps(sample_prefix, ("--bf16",))
    reference = megatron_run(1, argv)["final"]
    result = two_rank_runs["zero0_bf16"]
    loss = max(abs(a - b) / abs(b) for a, b in zip(result["losses"], reference["losses"]))
    print(f"ZeRO-0 bf16 weighted 3:1 vs single process bf16: loss rel diff {loss:.2e}")
    assert len(result["losses"]) == STEPS and loss <= BF16_LOSS_RTOL


def test_emulated_straggler_moves_microbatches_and_stays_exact(reference, two_rank_runs):
    """Rank 1 emulated 3x slower from step 1 (every layer's forward 10 ms of emulated device time, backward 20 ms,
    so the emulation, not the shared CPU, sets the pace: 3x vs 1x holds on a busy machine); the monitor, with a
    2-step window, finds it at step 2 and gives rank 1 one microbatch of 4 from step 3 on. The training equals
    the single-process run throughout (counts 2:2, then 3:1)."""
    result = two_rank_runs["zero1_emulated"]
    print("\n".join(result["lines"]))
    assert result["history"] == [(1, (2, 2)), (3, (3, 1))]
    assert any("stragglers rank 1 x" in line and "[3, 1]" in line for line in result["lines"])
    loss, weight = _diffs(result, reference)
    print(f"emulated straggler, 2:2 then 3:1 vs single process: loss rel diff {loss:.2e}, weight abs diff "
          f"{weight:.2e}")
    assert loss <= LOSS_RTOL and weight <= WEIGHT_ATOL


def test_weighted_counts_and_refusals():
    """Pure: Malleus's split over one-stage pipelines, one microbatch (under ZeRO-2/3 one sample per microbatch) at
    least per rank; per-rank microbatch counts under ZeRO-2/3 and counts that do not fit the global batch are
    refused with one line naming rule, values and fix."""
    from hetu_ext.config import from_namespace
    from hetu_ext.deepspeed.engine import ZeroConfig, add_deepspeed_args, deepspeed_config
    from hetu_ext.deepspeed.weighting import budget_microbatches, weighted_counts
    from hetu_ext.cli.args import build_parser

    assert weighted_counts(4, {1: 3.0}, 2) == (3, 1)
    assert weighted_counts(4, {}, 2) == (2, 2)
    counts = weighted_counts(12, {2: 2.0}, 4)  # a 2x rank takes 2, the others 3-4: the slowest rank's time 4
    assert sum(counts) == 12 and counts[2] == 2 and max(c * (2.0 if r == 2 else 1.0) for r, c in enumerate(counts)) == 4
    assert weighted_counts(3, {0: 50.0}, 3) == (1, 1, 1)
    assert weighted_counts(12, {2: 3.0}, 3, least=2) == (5, 5, 2)  # samples under ZeRO-2/3, 2 microbatches each
    assert weighted_counts(6, {2: 9.0}, 3, least=2) == (2, 2, 2)
    assert budget_microbatches((5, 5, 2), 0, 1, 2) == [range(12, 15), range(15, 17)]
    assert budget_microbatches((5, 5, 2), 2, 1, 2) == [range(22, 23), range(23, 24)]
    for stage in (2, 3):
        assert ZeroConfig(stage=stage, straggler_interval=5).weighted  # samples move, the counts stay equal
        with pytest.raises(ValueError, match=f"--hetu-microbatches 3,1 gives the ranks different microbatch counts"
                                             f".*ZeRO-{stage} reduces gradients on every backward.*--zero-stage 1"):
            ZeroConfig(stage=stage, microbatches=(3, 1))
    args = from_namespace(add_deepspeed_args(build_parser()).parse_args(gpt_argv(1, 1, "unused")))
    config = deepspeed_config(args, ZeroConfig(stage=1, microbatches=(3, 1)), 2)
    assert config["managed_gradient_accumulation"] is False
    assert "managed_gradient_accumulation" not in deepspeed_config(args, ZeroConfig(stage=1), 2)
    with pytest.raises(ValueError, match="--hetu-microbatches 3,2 must give each of the 2 ranks a count, summing "
                                         "to --global-batch-size 8 / --micro-batch-size 2 = 4"):
        deepspeed_config(args, ZeroConfig(stage=1, microbatches=(3, 2)), 2)
    assert deepspeed_config(args, ZeroConfig(stage=0, microbatches=(3, 1)), 2)["zero_optimization"] == {"stage": 0}


THREE_RANKS = ("--global-batch-size", "12", "--hetu-straggler-interval", "1", "--hetu-straggler-window", "1",
               "--hetu-emulate-layer-ms", "40", "--hetu-emulate-slowdown", "step=1:rank=2:x=3")
"""3 ranks, global batch 12 = 2 microbatches of 2 samples per rank; rank 2 emulated 3x slower from step 1 (a
full microbatch's layer forward 40 ms of emulated device time, backward 80 ms, times 3; a microbatch of fewer
tokens proportionally less), timings exchanged after every step (a 1-step window). The emulated time must exceed
the layers' real compute on the healthy ranks, or it dilutes the reading: at 20 ms, on the 2 shared cores at
load average 8-13, a healthy layer's first-step forward took 20-90 ms of real compute and step 1 read x1.4-2.4."""


BUDGET_CASES = ((2, "bf16"), (2, "fp32"), (3, "bf16"), (3, "fp32"))
"""(ZeRO stage, precision) of the budget runs: one engine after the other in one 3-rank launch."""


def budget_body(rank: int, world: int, argv: list[str]) -> list[dict] | None:
    """ZeRO-2/3, bf16 and fp32, with the straggler monitor, each a new engine in these processes (BUDGET_CASES):
    losses, the fp32 masters gathered by DeepSpeed, the counts' history and every rank's tokens per step."""
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param

    from hetu_ext.cli.args import build_parser, validate_args
    from hetu_ext.config import from_namespace
    from hetu_ext.deepspeed.engine import ZeroConfig, add_deepspeed_args, build
    from hetu_ext.deepspeed.zero_checkpoint import hetu_name

    out = []
    for stage, precision in BUDGET_CASES:
        args = add_deepspeed_args(build_parser()).parse_args(argv + (["--bf16"] if precision == "bf16" else []))
        validate_args(args)
        config = from_namespace(args)
        run = build(config, ZeroConfig(stage=stage, straggler_interval=config.straggler.interval))
        lines: list[str] = []
        losses = run.train(log=lines.append)
        masters = {hetu_name("param", n): safe_get_full_fp32_param(p).detach().clone()
                   for n, p in run.engine.module.named_parameters()}
        tokens: list = [None] * world
        dist.all_gather_object(tokens, run.rank_tokens)
        out.append({"losses": losses, "tensors": masters, "history": run.weighting.history, "lines": lines,
                    "tokens": tokens})
        run.engine.destroy()  # ZeRO-3's module hooks off the finished model
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def budget_runs(sample_prefix) -> dict[tuple[int, str], dict]:
    """The four budget runs (one launch: each 3-rank launch costs ~40 s of start-up on the shared cores, the
    four runs' steps ~10 s together)."""
    results = run_ranks(budget_body, 3, _argv_steps(sample_prefix, THREE_RANKS), timeout=420)[0]
    return dict(zip(BUDGET_CASES, results))


@pytest.fixture(scope="module")
def one_process(sample_prefix):
    """precision -> the single-process run on THREE_RANKS' global batches (ZeRO-2 and ZeRO-3 share it)."""
    runs: dict[str, dict] = {}

    def run(precision: str) -> dict:
        if precision not in runs:
            flags = THREE_RANKS[:2] + (("--bf16",) if precision == "bf16" else ())
            runs[precision] = megatron_run(1, _argv_steps(sample_prefix, flags))["final"]
        return runs[precision]
    return run


@pytest.mark.parametrize("stage, precision", BUDGET_CASES)
def test_emulated_straggler_moves_samples_under_zero_2_and_3(stage, precision, budget_runs, one_process):
    """ZeRO-2 and ZeRO-3 reduce (and gather) on every pass, so every rank runs 2 microbatches per step and the
    monitor moves samples instead: 4:4:4, then from step 2 (the first exchange's reading) 5:5:2 (the slow rank's 2
    microbatches of 1 sample each: its tokens per step fall from 128 to 64), and no other change to step 4 (no
    oscillation). The healthy ranks' waits for the slow one inside their layers (ZeRO-3's parameter gathers,
    ZeRO-2/3's gradient reductions) are left out of their timed spans: before that, ZeRO-3's first exchange read
    x1.0-1.9 (no change, or 4:5:3). No rank waits in a collective the others skip (the run would hang
    to the timeout). The losses equal the single-process run's on the same global batches: fp32 within
    test_uniform_equivalence's tolerances (and the fp32 masters within its weight tolerance); bf16 within
    test_ckpt_resume's BF16_LOSS_RTOL (bf16 roundings of differently ordered sums)."""
    from test_ckpt_resume import BF16_LOSS_RTOL

    reference, result = one_process(precision), budget_runs[(stage, precision)]
    print("\n".join(result["lines"]))
    print(f"tokens per step of each rank: {result['tokens']}")
    assert result["history"] == [(1, (4, 4, 4)), (2, (5, 5, 2))]
    found = re.findall(r"stragglers (.*?); samples per rank", "\n".join(result["lines"]))
    assert len(found) == 1 and re.fullmatch(r"rank 2 x\d+\.\d+", found[0]), found
    tokens = result["tokens"]  # 32 tokens a sample
    assert tokens[2] == [128] + [64] * (STEPS - 1)
    assert [sum(t[s] for t in tokens) for s in range(4)] == [12 * 32] * 4
    if precision == "bf16":  # the reference's fp32 masters beside DeepSpeed's
        reference = {"losses": reference["losses"], "tensors": {
            ("param/" + k[0].split("/", 1)[1], k[1]): v for k, v in reference["tensors"].items()
            if k[0].startswith("master/")}}
    loss, weight = _diffs(result, reference)
    print(f"ZeRO-{stage} {precision} 3 ranks, samples per rank {result['history']} vs single process: loss rel diff "
          f"{loss:.2e}, master abs diff {weight:.2e}")
    if precision == "fp32":
        assert loss <= LOSS_RTOL and weight <= WEIGHT_ATOL
    else:
        assert loss <= BF16_LOSS_RTOL
