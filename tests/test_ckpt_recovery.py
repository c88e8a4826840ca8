"""Recovery from partial GPU loss (Elastor): 6 ranks train with periodic asynchronous saves; rank 4 is killed
(SIGKILL, as a lost GPU's process would be) at the start of step 6; the survivors' collectives fail and the job
stops. It comes back on the 5 GPUs left (two nodes of 3, one of which lost a GPU) with a Malleus plan made for
them, loads the newest complete checkpoint (iteration 4, or 2 if the kill beat the asynchronous commit of 4) and
trains to the end. Every step's sample ids, over the whole run, must be exactly those of an uninterrupted
single-process run (none skipped, none repeated), and the resumed losses must match it within
test_uniform_equivalence's tolerance (the layouts differ only in the order of floating-point sums).

The relaunch is done here by the test harness (a fresh 5-rank process group), standing in for the launcher."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from test_ckpt_resume import PLANS, SCHEDULE
from helpers import LOSS_RTOL, gpt_argv

from hetu_ext.checkpoint.reader import candidates
from hetu_ext.checkpoint.storage import LocalStorage
from hetu_ext.testing.multiproc import RankError, run_ranks
from hetu_ext.cli.runs import SampleRecorder, recorded_samples

STEPS = 8
KILLED_RANK, KILLED_AT_STEP = 4, 6


def recovery_body(rank: int, world: int, argv: list[str], out: str, kill: bool) -> list[float] | None:
    from hetu_ext.cli.args import parse_run_config
    from hetu_ext.cli.train import build_run

    trainer = build_run(parse_run_config(argv))
    where = trainer.plan.stage_of(rank)
    if where is not None and where[1] == 0 and trainer.placement.tp_rank == 0:  # one reader per pipeline
        trainer.dataset = SampleRecorder(trainer.dataset, trainer, Path(out) / f"ids_{world}_{rank}.txt")
    if kill and rank == KILLED_RANK:  # dies as its step KILLED_AT_STEP starts (the step kind's first part)
        kind = trainer.step_kind
        prepare = kind.prepare

        def dying_prepare(trainer_, data):
            if trainer_.iteration + 1 == KILLED_AT_STEP:
                os.kill(os.getpid(), signal.SIGKILL)
            return prepare(trainer_, data)

        kind.prepare = dying_prepare
    losses = trainer.train(log=lambda line: None)
    return losses if rank == trainer.log_rank else None


def _malleus_plan(argv: list[str], world: int) -> str:
    from hetu_ext.cli.args import parse_run_config
    from hetu_ext.megatron.data import make_tokenizer
    from hetu_ext.megatron.launch_plan import model_spec
    from hetu_ext.plan import dump_plan
    from hetu_ext.plan.core.cluster import Cluster
    from hetu_ext.plan.malleus import plan_malleus

    config = parse_run_config(argv)
    spec = model_spec(config.model, make_tokenizer(config.data.tokenizer_type, config.data.vocab_size).vocab_size)
    cluster = Cluster(world_size=world, gpus_per_node=3, gpu_memory_bytes=80 * 2**30)
    training = config.training
    planned = plan_malleus(cluster, spec, micro_batch=training.micro_batch_size,
                           num_microbatches=training.global_batch_size // training.micro_batch_size)
    return dump_plan(planned.plan)


def test_rank_lost_mid_run_resumes_on_the_survivors_with_the_same_samples(sample_prefix, tmp_path):
    common = SCHEDULE + ("--train-iters", str(STEPS), "--distributed-timeout-minutes", "0.5")
    reference_dir = tmp_path / "reference"
    reference_dir.mkdir()
    reference = run_ranks(recovery_body, 1, gpt_argv(1, 1, sample_prefix, common), str(reference_dir), False)[0]
    want = recorded_samples(reference_dir, 1)
    assert sorted(want) == list(range(1, STEPS + 1)) and all(len(v) == 8 for v in want.values())

    ckpt = tmp_path / "ckpt"
    plan6 = tmp_path / "plan6.yaml"
    plan6.write_text(PLANS["h6"][1])
    first = gpt_argv(1, 1, sample_prefix, common + ("--hetu-plan", str(plan6), "--save", str(ckpt),
                                                 "--save-interval", "2"))
    with pytest.raises(RankError):
        run_ranks(recovery_body, 6, first, str(tmp_path), True, timeout=120)
    resumed_at = candidates(LocalStorage(ckpt), fallback=False)[0]
    assert resumed_at in (2, 4), resumed_at

    plan5 = tmp_path / "plan5.yaml"
    plan5.write_text(_malleus_plan(first, 5))
    second = gpt_argv(1, 1, sample_prefix, common + ("--hetu-plan", str(plan5), "--load", str(ckpt), "--save",
                                                  str(ckpt), "--save-interval", "2"))
    losses = next(r for r in run_ranks(recovery_body, 5, second, str(tmp_path), False, timeout=180) if r is not None)

    before, after = recorded_samples(tmp_path, 6), recorded_samples(tmp_path, 5)
    trained = {s: v for s, v in before.items() if s <= resumed_at} | after
    print(f"resumed at iteration {resumed_at} on 5 ranks under\n{plan5.read_text()}")
    assert sorted(after) == list(range(resumed_at + 1, STEPS + 1))
    assert trained == want, json.dumps({"resumed_at": resumed_at, "trained": trained, "want": want})
    assert len(losses) == STEPS
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, reference)) <= LOSS_RTOL
