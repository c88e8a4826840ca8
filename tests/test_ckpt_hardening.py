"""Issue 12, items 1-3 and 10: what a new user hit with checkpoints, each a test that failed before its fix.

1. A reused --save directory: another run's checkpoints were deleted by retention and --load / inspect took the
   highest iteration instead of the tracker's. Now the tracker decides, retention deletes only the run's own
   checkpoints (the run identity in the manifest), and a new run saving beside another run's checkpoints is
   refused before training (one line, the same on every rank) unless --hetu-ckpt-reuse-dir.
2. --load with a longer --train-iters trained at LR 0 (the checkpoint's decay length won silently). Now a
   schedule setting that differs from the checkpoint's is an error naming both values, on every rank (idle ones
   too), unless --override-opt_param-scheduler or --use-checkpoint-opt_param-scheduler.
3. --use-distributed-optimizer --save crashed at the first save (flattened_range) and left an empty iter_
   folder. Now it saves Megatron-LM's dp_reshardable layout and a resume continues the uninterrupted run bit for
   bit (same plan: the same sums in the same order); a failed save leaves no folder that looks like a checkpoint.
10. The checkpoint CLI: verify --all stopped at the first bad checkpoint; inspect missed a truncated shard; the
   fallback hint repeated itself, appeared in the CLI (which has no such flag) and after a fallback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_ckpt_resume import PLANS
from helpers import gpt_argv

from hetu_ext.checkpoint.cli import main as ckpt_cli
from hetu_ext.checkpoint.manifest import CheckpointError
from hetu_ext.checkpoint.reader import candidates, latest_iteration
from hetu_ext.checkpoint.schedule import resolve_schedule
from hetu_ext.checkpoint.storage import LocalStorage
from hetu_ext.checkpoint.writer import SaveConfig, save_offline
from hetu_ext.runtime.reshard import Piece
from hetu_ext.testing.multiproc import run_ranks

ROOT = Path(__file__).resolve().parents[1]
LINEAR = ("--lr-decay-style", "linear")


def _pieces(iteration: int) -> list[list[Piece]]:
    """Two ranks, each holding half of every tensor."""
    g = torch.Generator().manual_seed(iteration)
    full = {("param/w", (0,)): torch.randn(8, 4, generator=g), ("exp_avg/w", (0,)): torch.randn(8, 4, generator=g)}
    return [[Piece(n, i, ((4 * r, 4 * r + 4), (0, 4)), t[4 * r:4 * r + 4]) for (n, i), t in full.items()]
            for r in range(2)]


def _offline(root, iteration: int, run_id: str | None = None, keep: int = 2) -> None:
    config = SaveConfig(keep=keep, run_id=run_id) if run_id is not None else SaveConfig(keep=keep)
    save_offline(LocalStorage(root), iteration=iteration, pieces_by_rank=_pieces(iteration), info={}, config=config)


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def outcome_body(rank: int, world: int, argv: list[str]) -> dict:
    """Build (loading if --load), train; every rank returns its error (one line) or what it ran."""
    from hetu_ext.cli.args import parse_run_config
    from hetu_ext.cli.train import build_run

    try:
        trainer = build_run(parse_run_config(argv))
        start = trainer.iteration
        trainer.train(log=lambda line: None)
    except ValueError as e:  # CheckpointError is one: what the launcher prints as its one error line
        return {"error": f"{type(e).__name__}: {e}"}
    return {"start": start, "losses": list(trainer.losses),
            "scheduler": trainer.scheduler.state_dict() if trainer.scheduler is not None else None,
            "lr": trainer.optimizer.param_groups[0]["lr"] if trainer.scheduler is not None else None}


def _outcomes(world: int, argv: list[str]) -> list[dict]:
    return run_ranks(outcome_body, world, argv, timeout=240)


def _one_error(results: list[dict]) -> str:
    """Every rank raised the same one-line error (none of them hung or trained)."""
    errors = {r.get("error") for r in results}
    assert len(errors) == 1 and None not in errors, results
    error = errors.pop()
    assert "\n" not in error
    return error


# ---------------------------------------------------------------- 1. whose checkpoints


def test_the_tracker_names_the_latest(tmp_path, capsys):
    """iter_10 is newer than the tracker's iter_6 (another run's, or a commit whose tracker move a crash cut
    short): --load and inspect take the tracker's, as Megatron-LM does. Before: the highest number."""
    for it in (5, 10, 6):
        _offline(tmp_path, it, keep=3)
    assert candidates(LocalStorage(tmp_path), fallback=False) == [6]
    assert ckpt_cli(["inspect", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("iteration 6,")


def test_tracker_decides_and_retention_keeps_other_runs(tmp_path, capsys):
    """Run A left iter_5 and iter_10; run B (keep 2) saves 6, 7, 8 into the same folder. Before: B's first
    commit deleted iter_5 and the latest was 10 (the highest number), not the tracker's 6."""
    _offline(tmp_path, 5, "run-a")
    _offline(tmp_path, 10, "run-a")
    before = _snapshot(tmp_path / "iter_0000005") | _snapshot(tmp_path / "iter_0000010")
    _offline(tmp_path, 6, "run-b")
    storage = LocalStorage(tmp_path)
    assert candidates(storage, fallback=False) == [6]
    assert candidates(storage, fallback=True) == [6]  # run A's iter_5 is no fallback of run B
    _offline(tmp_path, 7, "run-b")
    _offline(tmp_path, 8, "run-b")
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000005", "iter_0000007", "iter_0000008",
                                                               "iter_0000010"]
    assert _snapshot(tmp_path / "iter_0000005") | _snapshot(tmp_path / "iter_0000010") == before
    assert latest_iteration(storage) == 8 and candidates(storage, fallback=True) == [8, 7]
    assert ckpt_cli(["inspect", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("iteration 8,")
    (tmp_path / "latest_checkpointed_iteration.txt").unlink()  # no tracker: the newest committed one
    assert candidates(storage, fallback=False) == [10]


def test_new_run_is_refused_beside_another_runs_checkpoints(sample_prefix, tmp_path):
    """A run without --load saving into a folder of another run's checkpoints stops before training, on every
    rank, with one line naming the folder's checkpoints and the flag; with --hetu-ckpt-reuse-dir it saves
    beside them (never over one of them) and leaves them byte for byte; --load then follows the tracker."""
    ckpt = tmp_path / "ckpt"
    first = gpt_argv(1, 1, sample_prefix, ("--train-iters", "4", "--save", str(ckpt), "--save-interval", "2"))
    run_ranks(outcome_body, 1, first, timeout=240)
    before = _snapshot(ckpt)
    second = gpt_argv(2, 1, sample_prefix, ("--train-iters", "3", "--save", str(ckpt), "--hetu-ckpt-keep", "1"))
    error = _one_error(_outcomes(2, second))
    assert "iter_0000002, iter_0000004 (run " in error and "--hetu-ckpt-reuse-dir" in error, error
    assert _snapshot(ckpt) == before
    clash = _one_error(_outcomes(2, second[:-4] + ["--train-iters", "4", "--save", str(ckpt),
                                                  "--hetu-ckpt-reuse-dir"]))
    assert "would save iteration(s) [4]" in clash and "never replaces" in clash, clash
    assert _snapshot(ckpt) == before
    reused = _outcomes(2, second + ["--hetu-ckpt-reuse-dir"])
    assert reused[0]["start"] == 0 and len(reused[0]["losses"]) == 3
    assert {k: v for k, v in _snapshot(ckpt).items() if k.startswith(("iter_0000002", "iter_0000004"))} == \
        {k: v for k, v in before.items() if k.startswith("iter_")}
    assert latest_iteration(LocalStorage(ckpt)) == 3  # not 4, the highest number
    resumed = _outcomes(1, gpt_argv(1, 1, sample_prefix, ("--train-iters", "3", "--load", str(ckpt))))
    assert resumed[0]["start"] == 3


def test_a_resumed_run_is_the_same_run(sample_prefix, tmp_path):
    """--load DIR --save DIR continues the run whose checkpoint it loaded: no refusal, and retention deletes that
    run's older checkpoint (its identity was kept). A guard of the fix above (it passed before it, too)."""
    ckpt = tmp_path / "ckpt"
    run_ranks(outcome_body, 1, gpt_argv(1, 1, sample_prefix, ("--train-iters", "2", "--save", str(ckpt))), timeout=240)
    again = gpt_argv(1, 1, sample_prefix, ("--train-iters", "3", "--load", str(ckpt), "--save", str(ckpt),
                                        "--hetu-ckpt-keep", "1"))
    result = run_ranks(outcome_body, 1, again, timeout=240)[0]
    assert result.get("start") == 2, result
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000003"]


# ---------------------------------------------------------------- 2. the LR schedule on resume


def test_resolve_schedule_follows_megatron_lm():
    flags = {"max_lr": 1e-3, "min_lr": 0.0, "lr_warmup_steps": 0, "lr_decay_steps": 32, "lr_decay_style": "linear",
             "start_wd": 0.01, "end_wd": 0.01, "wd_incr_steps": 32, "wd_incr_style": "constant"}
    saved = {**flags, "lr_decay_steps": 16, "wd_incr_steps": 16, "num_steps": 16}
    with pytest.raises(CheckpointError, match=r"^the LR schedule of the flags differs from x's: --lr-decay-iters 4 "
                                              r"\(checkpoint: 2\); resume with"):
        resolve_schedule(saved, flags, policy="check", unit=8, where="x")
    assert resolve_schedule(saved, flags, policy="override", unit=8) == {**flags, "num_steps": 16}
    assert resolve_schedule(saved, flags, policy="checkpoint", unit=8) == saved
    constant = {**flags, "lr_decay_style": "constant"}  # the decay length of a constant LR has no effect
    assert resolve_schedule({**saved, "lr_decay_style": "constant"}, constant, policy="check")["lr_decay_steps"] == 32
    legacy = {"start_lr": 1e-3, "min_lr": 0.0, "warmup_iter": 0, "end_iter": 32, "decay_style": "linear",
              "num_iters": 5}  # Megatron-LM's older names
    assert resolve_schedule(legacy, flags, policy="check")["num_steps"] == 5


@pytest.fixture(scope="module")
def tp2_checkpoint(sample_prefix, tmp_path_factory):
    """2 steps of linear decay over --train-iters (2), saved by TP 2."""
    ckpt = tmp_path_factory.mktemp("tp2") / "ckpt"
    run_ranks(outcome_body, 2, gpt_argv(2, 1, sample_prefix, LINEAR + ("--train-iters", "2", "--save", str(ckpt))),
              timeout=240)
    return ckpt


def test_longer_train_iters_on_resume_is_an_error_on_every_rank(tp2_checkpoint, sample_prefix, tmp_path):
    """Resumed on 3 ranks, one idle (it has no scheduler, and must not wait for the others): the same one-line
    error everywhere. Before: training went on at LR 0 (the decay had ended at iteration 2)."""
    plan = tmp_path / "idle.yaml"
    plan.write_text(PLANS["idle"][1])
    argv = gpt_argv(1, 1, sample_prefix, LINEAR + ("--train-iters", "4", "--load", str(tp2_checkpoint),
                                                "--hetu-plan", str(plan)))
    error = _one_error(_outcomes(3, argv))
    assert "--lr-decay-iters 4 (checkpoint: 2)" in error and "--override-opt_param-scheduler" in error, error


@pytest.mark.parametrize("choice,lr,decay", [(None, None, None), ("--override-opt_param-scheduler", 5e-4, 8),
                                             ("--use-checkpoint-opt_param-scheduler", 0.0, 2)])
def test_lr_decay_iters_on_resume(choice, lr, decay, tp2_checkpoint, sample_prefix):
    """--lr-decay-iters 8 given on resume: an error by default (before: silently ignored), the flags' decay with
    --override-opt_param-scheduler (LR after step 4 of 8: half the peak), the checkpoint's with
    --use-checkpoint-opt_param-scheduler (ended: LR 0)."""
    argv = gpt_argv(2, 1, sample_prefix, LINEAR + ("--train-iters", "4", "--lr-decay-iters", "8", "--load",
                                                str(tp2_checkpoint)) + ((choice,) if choice else ()))
    results = _outcomes(2, argv)
    if choice is None:
        assert "--lr-decay-iters 8 (checkpoint: 2)" in _one_error(results)
        return
    assert results[0]["start"] == 2 and results[0]["scheduler"]["lr_decay_steps"] == decay * 8
    assert results[0]["lr"] == pytest.approx(lr, abs=1e-12)


def test_schedule_error_is_one_line_and_exit_2_from_the_launcher(tp2_checkpoint, sample_prefix):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    argv = gpt_argv(1, 1, sample_prefix, LINEAR + ("--train-iters", "4", "--load", str(tp2_checkpoint)))
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "pretrain_gpt.py"), *argv], capture_output=True,
                          text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "--lr-decay-iters 4 (checkpoint: 2)" in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------- 3. --use-distributed-optimizer --save


def failing_save_body(rank: int, world: int, argv: list[str]) -> str:
    """Training whose dist_checkpointing save raises on every rank (a full disk, say); returns the error."""
    from megatron.core import dist_checkpointing

    def broken(*args, **kwargs):
        raise OSError("No space left on device")

    dist_checkpointing.save = broken
    try:
        outcome_body(rank, world, argv)
    except OSError as e:
        return str(e)
    return ""


def test_distributed_optimizer_save_and_resume_continue_the_run(sample_prefix, tmp_path):
    """ZeRO-1 over 2 data-parallel ranks, saved at step 2 and resumed to step 4: losses and the final LR schedule
    equal the uninterrupted 4-step run exactly (same plan, so the same sums). Before: the first save raised
    'ShardedTensor.flattened_range is not supported' and left an empty iter_0000002 folder."""
    zero1 = LINEAR + ("--lr-decay-iters", "4", "--use-distributed-optimizer")
    full = _outcomes(2, gpt_argv(1, 1, sample_prefix, zero1 + ("--train-iters", "4")))[0]
    ckpt = tmp_path / "ckpt"
    saved = _outcomes(2, gpt_argv(1, 1, sample_prefix, zero1 + ("--train-iters", "2", "--save", str(ckpt))))[0]
    assert "error" not in saved, saved
    assert (ckpt / "iter_0000002" / "metadata.json").exists() and not list(ckpt.glob(".tmp_*"))
    resumed = _outcomes(2, gpt_argv(1, 1, sample_prefix, zero1 + ("--train-iters", "4", "--load", str(ckpt))))[0]
    assert resumed.get("start") == 2, resumed
    assert resumed["losses"] == full["losses"] and resumed["scheduler"] == full["scheduler"]
    # ZeRO-1's flat buffers load only into ZeRO-1 runs: one line, not a Megatron traceback
    plain = _one_error(_outcomes(2, gpt_argv(1, 1, sample_prefix, LINEAR + ("--lr-decay-iters", "4", "--train-iters",
                                                                         "4", "--load", str(ckpt)))))
    assert "was saved with --use-distributed-optimizer (dp_reshardable" in plain, plain
    # a save that fails leaves nothing that looks like a checkpoint
    broken = tmp_path / "broken"
    error = run_ranks(failing_save_body, 2, gpt_argv(1, 1, sample_prefix, zero1 + ("--train-iters", "1", "--save",
                                                                                 str(broken))), timeout=240)
    assert error == ["No space left on device"] * 2
    assert not list(broken.glob("iter_*")) and not (broken / "latest_checkpointed_iteration.txt").exists()


# ---------------------------------------------------------------- 10. the checkpoint CLI


def _flip(path: Path, offset: int = -3) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1
    path.write_bytes(bytes(data))


def test_verify_all_reports_every_checkpoint(tmp_path, capsys):
    for it in (1, 2, 3):
        _offline(tmp_path, it, keep=3)
    _flip(tmp_path / "iter_0000002" / "shard_00001.safetensors")
    assert ckpt_cli(["verify", str(tmp_path), "--all"]) == 2
    out, err = capsys.readouterr()
    lines = out.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["OK", "BAD", "OK"], out
    assert "iteration 2" in lines[1] and "shard_00001.safetensors" in lines[1] and "checksum mismatch" in lines[1]
    assert err.count("\n") == 1 and err.startswith("error: 1 of 3 checkpoint(s) failed verification")
    assert "fallback" not in out + err  # the CLI has no such flag


def test_inspect_notices_a_truncated_shard(tmp_path, capsys):
    _offline(tmp_path, 4)
    shard = tmp_path / "iter_0000004" / "shard_00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    assert ckpt_cli(["inspect", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert "iteration 4" in out and "shard_00000.safetensors" in out and "bytes but the manifest says" in out
    assert err.count("\n") == 1 and "'verify' checks every checksum" in err and "fallback" not in err


def load_error_body(rank: int, world: int, root: str, fallback: bool) -> str:
    from hetu_ext.checkpoint.load import load_pieces

    storage = LocalStorage(root)

    def destinations(manifest):
        return [Piece(t.name, t.index, tuple((0, d) for d in t.shape), torch.zeros(t.shape))
                for t in manifest.tensors]

    try:
        load_pieces(storage, destinations, fallback=fallback)
    except CheckpointError as e:
        return str(e)
    return ""


def test_fallback_hint_once_and_only_where_it_helps(tmp_path):
    """Before: the hint came twice without fallback ('use --hetu-ckpt-fallback ...; --hetu-ckpt-fallback loads
    ...') and also after the fallback had been used."""
    for it in (1, 2):
        _offline(tmp_path, it)
    _flip(tmp_path / "iter_0000002" / "shard_00000.safetensors")
    error = run_ranks(load_error_body, 2, str(tmp_path), False)[0]
    assert "checksum mismatch" in error and error.count("--hetu-ckpt-fallback") == 1, error
    assert error.endswith("--hetu-ckpt-fallback loads the previous complete one (iteration 1)")
    _flip(tmp_path / "iter_0000001" / "shard_00001.safetensors")
    error = run_ranks(load_error_body, 2, str(tmp_path), True)[0]
    assert "--hetu-ckpt-fallback" not in error and error.startswith("no usable checkpoint (tried iterations 2, 1)")
