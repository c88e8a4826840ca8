"""``--fp16`` with Megatron-LM's loss scaling in hetu_ext's own trainer (launch/pretrain_gpt.py, the hand-off).

The numbers are Megatron-core's: Float16Module (fp16 weights and activations), fp16 gradient buffers as Megatron-LM
keeps them under --fp16, ``Float16OptimizerWithFloat16Params`` (fp32 masters) and its ``DynamicGradScaler``. What
hetu_ext adds, and what these tests catch when it breaks:

* a heterogeneous plan scales, unscales and checks for overflow like one process (every used rank agrees to skip);
* a step whose gradients overflow is skipped as Megatron-LM skips it: weights, Adam's step and the LR schedule
  unchanged, the scale backed off by the hysteresis rule, the log line's ``loss scale`` and
  ``number of skipped iterations``;
* the scaler's state (scale, growth and hysteresis trackers) survives a hetu checkpoint: a resume continues bit for
  bit.

Tiny models (2 layers, hidden 32) on the shipped text sample, 1-4 ranks: 31 s of test calls measured on the 2-core
machine at load average 9 (20.9 + 5.7 + 4.5 + 0.2 s), 72 s at load average 11-14.
"""

from __future__ import annotations


import pytest
from conftest import ROOT
from helpers import gpt_argv

from hetu_ext.metrics import read_records
from hetu_ext.testing.multiproc import run_ranks

FP16 = ("--fp16", "--num-layers", "2")
"""gpt_argv's model with 2 layers (the later --num-layers wins)."""

PLAN = ("pipelines: [{num_microbatches: 3, stages: [{ranks: [0, 1], layers: [0, 1]}, {ranks: [2], layers: [1, 2]}]},"
        " {num_microbatches: 1, stages: [{ranks: [3], layers: [0, 2]}]}]")
"""Two pipelines of different shapes: TP 2 -> 1 inside one (the tied embedding on stages of different TP), 3 and
1 microbatches."""


def fp16_run(rank: int, world_size: int, argv: list[str]) -> dict | None:
    """Train ``argv`` as pretrain_gpt.py does; the log rank returns losses, log lines, the gathered weights before
    and after, the loss scaler's state, the scheduler's steps and Adam's step."""
    from hetu_ext.cli.args import parse_run_config
    from hetu_ext.cli.train import build_run
    from hetu_ext.megatron.state import optimizer_step, scaler_state
    from hetu_ext.megatron.weights import gather_weights

    trainer = build_run(parse_run_config(argv))
    before = gather_weights(trainer.model, **trainer.placement.shard_kwargs)
    lines: list[str] = []
    losses = trainer.train(log=lines.append)
    after = gather_weights(trainer.model, **trainer.placement.shard_kwargs)
    if rank != trainer.log_rank:
        return None
    return {"losses": losses, "log_lines": lines, "before": before, "after": after,
            "scaler": scaler_state(trainer.optimizer), "scheduler_steps": trainer.scheduler.num_steps,
            "adam_step": optimizer_step(trainer.placement), "skipped": trainer.skipped_iterations}


def _argv(prefix: str, *extra: str, steps: int = 3) -> list[str]:
    return gpt_argv(1, 1, prefix, (*FP16, "--train-iters", str(steps), *extra))


def test_heterogeneous_plan_in_fp16_matches_one_process(sample_prefix, tmp_path):
    """A plan of two differently shaped pipelines (TP 2 -> 1, 3 and 1 microbatches; the distributed optimizer's
    owners stepping fp32 masters of their boxes only) against one process, both in fp16 from a loss scale that
    grows every step (``--loss-scale-window 1``). The scales must be equal step by step (every rank's overflow
    check agrees with one process's: a rank that skipped alone, or a scaler per pipeline, breaks it) and the
    losses within 2e-3 relative. Bit-equality is not expected: the plans change the order of fp16 gradient sums
    (fp16 buffers, as Megatron-LM's --fp16; 4.9e-4 per rounding), and Adam turns a near-zero gradient whose sign
    flipped into a full step the other way. Measured: 5.1e-4 on step 3, with the sharded optimizer and (once, by
    hand) without it, final weights within 2.1e-3 = about 2 x lr. A mistake in the scale's magnitude alone is
    hidden by Adam's normalisation; the scale comparison here and the overflow test below catch those."""
    argv = _argv(sample_prefix, "--initial-loss-scale", "64", "--loss-scale-window", "1")
    ref = run_ranks(fp16_run, 1, argv, timeout=180)[0]
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN)
    got = next(r for r in run_ranks(fp16_run, 4, [*argv, "--hetu-plan", str(plan), "--use-distributed-optimizer"],
                                    timeout=240) if r is not None)
    scales = [s[0]["scale"] for s in (ref["scaler"], got["scaler"])]
    assert scales[0] == scales[1] and ref["skipped"] == got["skipped"], (ref["scaler"], got["scaler"])
    assert ref["scaler"][0]["scale"] != 64.0, ref["scaler"]  # the scale moved: the comparison can fail
    diff = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
    print(f"fp16 plan vs one process: loss rel diff {diff:.2e}, scale {scales[0]}")
    assert diff <= 2e-3, (got["losses"], ref["losses"])
    assert ref["losses"][2] != ref["losses"][0]


def test_overflowing_steps_are_skipped_as_megatron_lm_skips_them(sample_prefix, tmp_path):
    """--initial-loss-scale 2**40: every fp16 gradient overflows, on a DP-2 plan runtime that migrates online to
    rank 0 alone after step 2. Each step is skipped: the weights are the initial ones bit for bit, Adam holds no
    step, the LR schedule did not advance, and the scale follows Megatron's hysteresis rule (--hysteresis 2: the
    first overflow keeps 2**40, each later one halves it), across the migration. The log lines carry
    Megatron-LM's ``loss scale`` and ``number of skipped iterations`` fields. Catches a skipped update that still
    steps the scheduler or Adam, a rank that steps while another skips, a log line or metrics record without the
    fields, and a migration that rebuilds the scaler fresh (step 3 would print 2**40 again)."""
    single = tmp_path / "single.yaml"
    single.write_text("pipelines: [{num_microbatches: 4, stages: [{ranks: [0], layers: [0, 2]}]}]\nunused_ranks: [1]")
    metrics = tmp_path / "metrics.jsonl"
    argv = _argv(sample_prefix, "--initial-loss-scale", str(2**40), "--hetu-runtime", "plan",
                 "--hetu-migrate", f"step=2:plan={single}", "--hetu-metrics-file", str(metrics), steps=3)
    got = run_ranks(fp16_run, 2, argv, timeout=180)[0]
    assert got["skipped"] == 3
    assert got["scheduler_steps"] == 0 and got["adam_step"] is None
    assert all(bool((got["after"][k] == w).all()) for k, w in got["before"].items())
    assert got["scaler"][0]["scale"] == 2.0**38 and got["scaler"][0]["hysteresis_tracker"] == -1
    steps = [line for line in got["log_lines"] if " iteration " in line]
    assert any(line.startswith("migrated to a new plan after step 2") for line in got["log_lines"])
    scales = [float(line.split("loss scale: ")[1].split(" |")[0]) for line in steps]
    assert scales == [2.0**40, 2.0**39, 2.0**38], got["log_lines"]
    assert all("number of skipped iterations:   1 |" in line for line in steps), steps
    records = read_records(metrics, kind="step")
    assert [(r["loss_scale"], r["skipped_iterations"], r["grad_norm"]) for r in records] == \
        [(2.0**40, 1, None), (2.0**39, 1, None), (2.0**38, 1, None)], records


def test_resume_restores_the_loss_scale_bit_exact(sample_prefix, tmp_path):
    """4 steps against 2 + save + 2 resumed (a hetu checkpoint), fp16 from 2**10 with the scale doubling after
    every good step (``--loss-scale-window 1``, ``--hysteresis 2``): on this model steps 1, 2 and 4 overflow and
    step 3 updates (scales 1024, 512, 1024, 1024), so the saved scaler (512, hysteresis tracker 0) differs from a
    fresh one. The resumed steps' losses, the final weights, Adam's step, the LR schedule and the scaler's state
    (scale, growth and hysteresis trackers) equal the uninterrupted run's. Catches a scaler left out of the
    checkpoint or trackers reset on load (the resumed step 3 would run at 1024, overflow and skip: the update and
    step 4's loss would differ), and Adam's step taken as the iteration."""
    common = ("--initial-loss-scale", str(2**10), "--loss-scale-window", "1")
    full = run_ranks(fp16_run, 1, _argv(sample_prefix, *common, steps=4), timeout=180)[0]
    assert full["skipped"] >= 1 and full["adam_step"] >= 1, full["log_lines"]  # both kinds of step happen
    ckpt = tmp_path / "ckpt"
    first = run_ranks(fp16_run, 1, _argv(sample_prefix, *common, "--save", str(ckpt), steps=2), timeout=180)[0]
    fresh = [{"growth_tracker": 0, "hysteresis_tracker": 2, "scale": 2.0**10}]
    assert first["scaler"] != fresh, first["scaler"]  # a resume that restarted the scaler would differ
    second = run_ranks(fp16_run, 1, _argv(sample_prefix, *common, "--load", str(ckpt), steps=4), timeout=180)[0]
    assert second["losses"] == full["losses"], (second["losses"], full["losses"])
    assert second["scaler"] == full["scaler"]
    assert all(bool((second["after"][k] == w).all()) for k, w in full["after"].items())
    assert second["scheduler_steps"] == full["scheduler_steps"] and second["adam_step"] == full["adam_step"]


def test_fp16_refusals_are_one_line():
    """--fp16 with --bf16 (Megatron-LM's rule), LoRA tenants, HotSPa's or Hydraulis' strategies: one line naming both
    flags, before any process group; --fp16 is no longer in the table of refused Megatron-LM flags, and its
    settings have Megatron-LM's defaults (dynamic scale from 2**32, hysteresis 2, window 1000)."""
    import dataclasses

    from hetu_ext.cli.args import parse_run_config
    from hetu_ext.config.megatron_flags import take_megatron_flags
    from hetu_ext.megatron.launch_plan import check_launch

    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--fp16"]
    with pytest.raises(ValueError, match=r"^--fp16 and --bf16 are exclusive[^\n]*give one of them$"):
        parse_run_config([*base, "--bf16"])
    assert take_megatron_flags(["--fp16"]).refused == []
    config = parse_run_config(base)
    t = config.training
    assert (t.fp16, t.loss_scale, t.initial_loss_scale, t.min_loss_scale, t.loss_scale_window, t.hysteresis) == \
        (True, None, 2.0**32, 1.0, 1000.0, 2)
    lora = [*base[:-2], "--fp16", "--hetu-lora-tenants", str(ROOT / "configs" / "lobra" / "tenants_3.yaml")]
    with pytest.raises(ValueError, match=r"^--fp16 is not supported with --hetu-lora-tenants:"):
        parse_run_config(lora)
    for flag, field in (("--hetu-hotspa", "hotspa"), ("--hetu-strategies", "strategies")):
        switched = dataclasses.replace(config, packing=dataclasses.replace(config.packing, **{field: "auto"}))
        with pytest.raises(ValueError, match=rf"^--fp16 is not supported with {flag}:"):
            check_launch(switched, 1)
