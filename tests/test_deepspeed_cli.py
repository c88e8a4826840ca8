"""launch/pretrain_gpt_deepspeed.py: bad input is one error line and exit code 2 (no traceback), before launch
(flags) and after it (a checkpoint that does not fit: another model, a missing tag, other data settings or LR
schedule); the real launcher saves, resumes and saves in hetu's format."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import assert_one_error_line

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch" / "pretrain_gpt_deepspeed.py"
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
         "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "2", "--lr", "1e-3",
         "--lr-decay-iters", "4", "--mock-data"]


def run(args: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, str(LAUNCH), *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)


@pytest.mark.parametrize("args,needle", [
    (["--zero-stage", "3", "--hetu-microbatches", "2"],
     "--hetu-microbatches 2 gives the ranks different microbatch counts, which needs a ZeRO stage whose backwards "
     "only accumulate locally (0, 1); ZeRO-3 reduces gradients on every backward"),
    (["--zero-stage", "1", "--hetu-microbatches", "3,1"],
     "--hetu-microbatches 3,1 must give each of the 1 ranks a count, summing to --global-batch-size 2"),
    (["--hetu-microbatches", "2,0"], "'2,0': every rank needs at least 1 microbatch"),
    (["--hetu-plan", "configs/plans/hetero_2pipes.yaml"], "--hetu-plan is a feature of launch/pretrain_gpt.py"),
    (["--hetu-ckpt-format", "torch_dist", "--save", "x"], "--hetu-ckpt-format torch_dist is a feature of"),
    (["--eval-iters", "2", "--eval-interval", "1"], "--eval-iters is a feature of launch/pretrain_gpt.py"),
    (["--decoupled-lr", "1e-3"], "--decoupled-lr is a feature of launch/pretrain_gpt.py"),
    (["--exit-duration-in-mins", "5"], "--exit-duration-in-mins is a feature of launch/pretrain_gpt.py"),
    (["--load", "/nonexistent/ckpt"], "--load /nonexistent/ckpt: no such directory"),
    (["--ckpt-step", "2"], "--ckpt-step 2 names a checkpoint to resume from: add --load DIR"),
    (["--exit-interval", "0"], "argument --exit-interval: '0': expected a step count of at least 1"),
])
def test_bad_flags_exit_2_with_one_line(args, needle):
    assert_one_error_line(run(MODEL + ["--train-iters", "2", *args]), needle)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """One rank, ZeRO-1, 2 steps, saved by the launcher (DeepSpeed's format)."""
    directory = tmp_path_factory.mktemp("ds") / "ckpt"
    proc = run(MODEL + ["--zero-stage", "1", "--train-iters", "2", "--save", str(directory)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "saved DeepSpeed ZeRO-1 checkpoint" in proc.stdout and (directory / "latest").is_file()
    return directory


def _with(flag: str, value: str) -> list[str]:
    argv = list(MODEL)
    argv[argv.index(flag) + 1] = value
    return argv


def test_checkpoint_of_another_model_is_one_line(checkpoint):
    proc = run(_with("--ffn-hidden-size", "96") + ["--zero-stage", "1", "--train-iters", "4", "--load",
                                                   str(checkpoint)])
    assert_one_error_line(proc, "linear_fc1.weight[0]: the model holds box ((0, 96), (0, 32)) but the DeepSpeed "
                                "checkpoint stores [64, 32]; the model configuration differs from the saved one")


def test_missing_tag_is_one_line(checkpoint, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    (broken / "latest").write_text("global_step9")
    proc = run(MODEL + ["--zero-stage", "1", "--train-iters", "4", "--load", str(broken)])
    assert_one_error_line(proc, f"{broken}/global_step9: named by {broken}/latest but holds no *_optim_states.pt")


def test_other_data_settings_or_schedule_are_one_line(checkpoint):
    proc = run(_with("--global-batch-size", "4") + ["--zero-stage", "1", "--train-iters", "4", "--load",
                                                    str(checkpoint)])
    assert_one_error_line(proc, "was trained with other data settings (saved, now): {'global_batch_size': (2, 4)}")
    proc = run(_with("--lr", "2e-3") + ["--zero-stage", "1", "--train-iters", "4", "--load", str(checkpoint)])
    assert_one_error_line(proc, "the LR schedule of the flags differs")


def test_resume_and_hetu_save_through_the_launcher(checkpoint, tmp_path):
    """The ZeRO-1 checkpoint resumed under ZeRO-3 (another stage: the fragments differ, the tensors do not),
    saved every step in hetu's format with retention 2: iterations 3 and 4 kept, the tracker at 4, the manifest
    stating the stage; the log names the source and iteration."""
    out = tmp_path / "hetu"
    proc = run(MODEL + ["--zero-stage", "3", "--train-iters", "4", "--load", str(checkpoint), "--save", str(out),
                        "--save-interval", "1", "--hetu-ckpt-format", "hetu", "--hetu-ckpt-keep", "2"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from deepspeed checkpoint {checkpoint}/global_step2 (saved on 1 rank(s)) at iteration 2" \
        in proc.stdout
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("iter_")) == ["iter_0000003", "iter_0000004"]
    assert (out / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    from hetu_ext.checkpoint.reader import read_manifest
    from hetu_ext.checkpoint.storage import LocalStorage

    manifest = read_manifest(LocalStorage(str(out)), 4)
    assert manifest.config["deepspeed_zero_stage"] == 3 and manifest.state["optimizer_step"] == 4.0


def _losses(stdout: str) -> dict[int, str]:
    """iteration -> the printed loss of each Megatron-LM log line."""
    import re

    return {int(m.group(1)): m.group(2) for m in re.finditer(r"iteration +(\d+)/ +\d+ .*?lm loss: (\S+)", stdout)}


def test_exit_interval_and_ckpt_step(tmp_path):
    """Megatron-LM's --exit-interval and --ckpt-step on the DeepSpeed launcher (ZeRO-2, bf16): a run of 6 steps
    with --exit-interval 3 stops after step 3, saving it (with steps 1 and 2 from --save-interval 1); --ckpt-step 1
    resumes the first of them instead of the newest and trains steps 2-4 with the same losses as the first run's
    steps 2-3 (one rank: the same sums); a step that was not saved is one line naming the saved ones."""
    directory = tmp_path / "ckpt"
    common = MODEL + ["--zero-stage", "2", "--bf16", "--train-iters", "4", "--log-interval", "1"]
    first = run(common + ["--save", str(directory), "--save-interval", "1", "--exit-interval", "3"])
    assert first.returncode == 0, first.stderr[-3000:]
    assert "exiting after iteration 3 (--exit-interval 3)" in first.stdout
    assert sorted(p.name for p in directory.iterdir() if p.is_dir()) == [f"global_step{i}" for i in (1, 2, 3)]
    assert (directory / "latest").read_text() == "global_step3" and sorted(_losses(first.stdout)) == [1, 2, 3]
    second = run(common + ["--load", str(directory), "--ckpt-step", "1"])
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed from deepspeed checkpoint {directory}/global_step1 (saved on 1 rank(s)) at iteration 1" \
        in second.stdout
    before, after = _losses(first.stdout), _losses(second.stdout)
    assert sorted(after) == [2, 3, 4] and after[2] == before[2] and after[3] == before[3], (before, after)
    proc = run(common + ["--load", str(directory), "--ckpt-step", "5"])
    assert_one_error_line(proc, f"--ckpt-step 5: {directory} has no checkpoint of step 5")
    assert "its saved steps are [1, 2, 3]" in proc.stderr
