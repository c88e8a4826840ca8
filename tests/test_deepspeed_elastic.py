"""Elastic rehearsal of a DeepSpeed job: 4 ranks run launch/pretrain_gpt_deepspeed.py's ``main`` (ZeRO-2, DeepSpeed
checkpoints every 2 steps); rank 3 is killed (SIGKILL, as a lost GPU's process would be) at the start of step 6;
the survivors' collectives fail and the job stops. It comes back on 3 ranks with the same flags plus ``--load DIR``
(DIR is also the --save directory, as an elastic supervisor relaunches), resumes from the newest checkpoint
(``global_step4``: the save of step 4 completed on every rank before step 5's collectives) and trains to step 8.

Every step's sample ids over the whole run must be exactly those of the uninterrupted 4-rank run (none skipped,
none repeated: global batch g is samples [12g, 12g + 12) at any world size), and the losses of steps 5-8 must
match it within test_uniform_equivalence's tolerance (3 ranks sum the same gradients in another grouping;
test_deepspeed_resume measured 1.4e-8).

The relaunch is done here by the test harness (a fresh 3-rank process group), standing in for the supervisor:
launch/elastic.py runs launch/pretrain_gpt.py and has no DeepSpeed launcher yet.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
from pathlib import Path

import pytest
from test_deepspeed_resume import ds_argv
from test_uniform_equivalence import LOSS_RTOL

from hetu_ext.testing.multiproc import RankError, run_ranks
from hetu_ext.testing.runs import SampleRecorder, recorded_samples

ROOT = Path(__file__).resolve().parents[1]
STEPS = 8
KILLED_RANK, KILLED_AT_STEP = 3, 6


def launcher_body(rank: int, world: int, argv: list[str], out: str, kill: bool) -> dict:
    """launch/pretrain_gpt_deepspeed.py's main() on this rank (the process group is the harness's), its dataset
    recorded and, with ``kill``, rank KILLED_RANK killed at the start of step KILLED_AT_STEP."""
    from hetu_ext.deepspeed.engine import DeepSpeedGPT

    spec = importlib.util.spec_from_file_location("pretrain_gpt_deepspeed", ROOT / "launch" /
                                                  "pretrain_gpt_deepspeed.py")
    launcher = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launcher)
    train, step, result = DeepSpeedGPT.train, DeepSpeedGPT._step, {}

    def recorded_train(self, *args, **kwargs):
        self.dataset = SampleRecorder(self.dataset, self, Path(out) / f"ids_{world}_{rank}.txt")
        result["start"] = self.iteration
        result["losses"] = train(self, *args, **kwargs)
        return result["losses"]

    def dying_step(self, *args, **kwargs):
        if kill and rank == KILLED_RANK and self.iteration + 1 == KILLED_AT_STEP:
            os.kill(os.getpid(), signal.SIGKILL)
        return step(self, *args, **kwargs)

    DeepSpeedGPT.train, DeepSpeedGPT._step = recorded_train, dying_step
    result["exit"] = launcher.main(argv)
    return result


def test_rank_lost_resumes_on_3_with_the_same_samples(sample_prefix, tmp_path):
    flags = ds_argv(sample_prefix, STEPS, ("--distributed-timeout-minutes", "0.5", "--zero-stage", "2",
                                           "--lr-decay-iters", str(STEPS)))
    reference_dir = tmp_path / "reference"
    reference_dir.mkdir()
    reference = run_ranks(launcher_body, 4, flags, str(reference_dir), False, timeout=180)[0]
    want = recorded_samples(reference_dir, 4)
    assert reference["exit"] == 0 and sorted(want) == list(range(1, STEPS + 1))
    assert all(len(v) == 12 for v in want.values())

    ckpt = tmp_path / "ckpt"
    job = flags + ["--save", str(ckpt), "--save-interval", "2"]
    with pytest.raises(RankError):
        run_ranks(launcher_body, 4, job, str(tmp_path), True, timeout=120)
    assert (ckpt / "latest").read_text().strip() == "global_step4"

    resumed = run_ranks(launcher_body, 3, job + ["--load", str(ckpt)], str(tmp_path), False, timeout=180)
    assert all(r["exit"] == 0 for r in resumed) and resumed[0]["start"] == 4
    assert (ckpt / "latest").read_text().strip() == "global_step8"
    before, after = recorded_samples(tmp_path, 4), recorded_samples(tmp_path, 3)
    trained = {s: v for s, v in before.items() if s <= 4} | after
    assert sorted(after) == list(range(5, STEPS + 1))
    assert trained == want, json.dumps({"trained": trained, "want": want})
    losses = resumed[0]["losses"]
    assert len(losses) == STEPS and losses[:4] == reference["losses"][:4]
    loss = max(abs(a - b) / abs(b) for a, b in zip(losses[4:], reference["losses"][4:]))
    print(f"4 ranks, rank 3 lost at step 6, resumed on 3 from global_step4: steps 5-8 loss rel diff {loss:.2e}")
    assert loss <= LOSS_RTOL
