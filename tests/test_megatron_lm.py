"""Megatron-LM's own ``pretrain_gpt.py`` (the unmodified copy of tag core_v0.16.1 in ../shared/thirdparty) run by
``torchrun -m hetu_ext.megatron_lm`` with ``--hetu-*`` flags, on 2 CPU ranks.

One launch per group of checks:

* **A**, the reference: data-parallel 2, plain Megatron-LM loop (loss falls, Megatron-LM's own log lines), saving
  hetu checkpoints through Megatron-LM's ``--save --save-interval`` call sites;
* **B**: loads A's checkpoint of iteration 3 (``--load --ckpt-step 3``) under tensor-parallel 2 and continues:
  iterations 4-6 equal A's;
* **C**: rank 1 emulated 4x slow from step 1, ``--hetu-straggler-interval 1``: the monitor detects it, the slow rank
  runs fewer microbatches (e.g. 6 and 2 instead of 4 and 4), and every loss equals A's (the entry point added
  ``--calculate-per-token-loss``, so the global batch's loss does not depend on which rank ran which sample);
* **P**: ``--hetu-packing balanced`` on DP 2 equals ``--hetu-packing unpacked`` on one rank;
* **H**: a heterogeneous plan (pipelines of 6 and 2 microbatches) handed to hetu_ext's trainer;
* a checkout whose ``train_step`` is gone is refused naming the symbol and the tested tag; bad combinations exit 2
  with one line (no launch).

Megatron-LM's log averages the first two iterations of a run into its second line (``training_log``: the first
iteration does not reset the accumulator), so per-step losses are derived from the lines (:func:`step_losses`).
Tolerance: the uniform-equivalence test's (relative 1e-6) over Megatron-LM's printed 7 significant digits.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hetu_ext.patches.megatron_lm import TESTED_TAG, MegatronLMVersionError, check_patch_points
from helpers import LOSS_RTOL, megatron_lm

from hetu_ext.megatron_lm.flags import PROG
from hetu_ext.megatron_lm.run import main

ROOT = Path(__file__).resolve().parents[1]
CHECKOUT = ROOT.parent / "shared" / "thirdparty" / "Megatron-LM-core_v0.16.1"
SCRIPT = CHECKOUT / "pretrain_gpt.py"
needs_checkout = pytest.mark.skipif(not SCRIPT.is_file(), reason=f"no Megatron-LM checkout at {CHECKOUT}")

COMMON = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
          "--max-position-embeddings", "64", "--micro-batch-size", "1", "--global-batch-size", "8",
          "--train-iters", "6", "--lr", "1e-3", "--hidden-dropout", "0", "--attention-dropout", "0",
          "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--log-interval", "1",
          "--eval-iters", "0", "--eval-interval", "1000", "--transformer-impl", "local",
          "--no-gradient-accumulation-fusion", "--no-persist-layer-norm", "--distributed-backend", "gloo"]
LINE = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.*?lm loss: ([0-9.E+-]+) \|")


def torchrun(tmp: Path, *flags: str, nproc: int = 2, timeout: float = 300) -> subprocess.CompletedProcess:
    """``torchrun -m hetu_ext.megatron_lm SCRIPT flags`` on ``nproc`` ranks (forked from the session's zygote:
    helpers.megatron_lm); asserts it succeeded."""
    return megatron_lm(tmp, SCRIPT, *flags, nproc=nproc, timeout=timeout)


def step_losses(log: str) -> dict[int, float]:
    """Iteration -> its own loss, from Megatron-LM's lines (log interval 1): the second line of a run averages the
    first two iterations (``training_log`` does not reset after the first), so that one is undone."""
    lines = [(int(i), float(loss)) for i, _, loss in LINE.findall(log)]
    losses = dict(lines)
    if len(lines) >= 2:
        (first, a), (second, b) = lines[:2]
        losses[second] = 2 * b - a
    return losses


def assert_close(got: dict[int, float], want: dict[int, float], steps) -> None:
    for step in steps:
        assert abs(got[step] - want[step]) <= LOSS_RTOL * abs(want[step]) + 1e-6, (step, got, want)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Launch A: the plain run, saving hetu checkpoints at iterations 3 and 6."""
    tmp = tmp_path_factory.mktemp("megatron_lm")
    proc = torchrun(tmp, *COMMON, "--calculate-per-token-loss", "--save", str(tmp / "ckpt"), "--save-interval",
                    "3", "--hetu-ckpt-format", "hetu")
    return tmp, proc.stdout + proc.stderr


@needs_checkout
def test_megatron_lm_plain_run_trains_and_saves_hetu(reference):
    tmp, log = reference
    losses = step_losses(log)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6], log[-3000:]
    assert losses[6] < losses[1] - 0.05, losses
    assert f"patches and hooks on Megatron-LM {TESTED_TAG}" in log
    assert "number of skipped iterations:   0" in log  # Megatron-LM's own log line
    for it in (3, 6):
        assert (tmp / "ckpt" / f"iter_{it:07d}" / "manifest.json").is_file()
    assert (tmp / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "6"


@needs_checkout
def test_megatron_lm_hetu_checkpoint_dp2_into_tp2_continues(reference):
    """Launch B: A's iteration-3 checkpoint (DP 2) loaded under TP 2 continues as A did."""
    tmp, log = reference
    proc = torchrun(tmp, *COMMON, "--calculate-per-token-loss", "--load", str(tmp / "ckpt"), "--ckpt-step", "3",
                    "--tensor-model-parallel-size", "2", "--hetu-ckpt-format", "hetu")
    out = proc.stdout + proc.stderr
    assert "loaded hetu checkpoint" in out and "'tp': 2" in out, out[-3000:]
    resumed = step_losses(out)
    assert sorted(resumed) == [4, 5, 6], out[-3000:]
    assert_close(resumed, step_losses(log), [4, 5, 6])


@needs_checkout
def test_megatron_lm_straggler_weighting(reference):
    """Launch C: the slow rank runs fewer microbatches; the losses stay the reference's."""
    tmp, log = reference
    # --hetu-ckpt-format hetu as in A: it masks the vocabulary's padding logits (hetu_ext.megatron.vocab)
    proc = torchrun(tmp, *COMMON, "--hetu-straggler-interval", "1", "--hetu-straggler-window", "2",
                    "--hetu-straggler-threshold", "2.0", "--hetu-emulate-slowdown", "step=1:rank=1:x=4",
                    "--hetu-emulate-layer-ms", "10", "--hetu-ckpt-format", "hetu")
    out = proc.stdout + proc.stderr
    assert "added --calculate-per-token-loss" in out
    detected = re.findall(r"straggler monitor: step \d+: stragglers (.*)", out)
    assert detected and all(d.startswith("rank 1 x") and ", rank" not in d for d in detected), out[-3000:]
    counts = [tuple(map(int, m.split(", "))) for m in
              re.findall(r"microbatches per data-parallel rank: ([0-9, ]+) \(were", out)]
    assert counts and counts[0][1] < counts[0][0] and sum(counts[0]) == 8, counts
    assert_close(step_losses(out), step_losses(log), range(1, 7))


LENGTHS = ('{"mode": "distribution", "type": "lognormal", "min_seq_len": 2, "max_seq_len": 300, '
           '"mean_seq_len": 40, "lognormal_sigma": 1.0}')
PACKING = [*COMMON, "--global-batch-size", "16", "--train-iters", "3", "--hetu-varlen-mock", LENGTHS,
           "--hetu-mock-documents", "2000"]  # the later --global-batch-size and --train-iters win (argparse)


@needs_checkout
def test_megatron_lm_packing_equals_unpacked(tmp_path):
    """Launch P: Hydraulis's balanced packs on DP 2 (THD packs through pretrain_gpt.py's get_batch into hetu_ext's
    packed attention, fewer microbatches than sequences) train as the unpacked reference on one rank (one sequence
    per microbatch, ordinary causal attention; a single process without torchrun: the entry point gives it one
    rank's environment)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "TMPDIR": str(tmp_path)}
    ref = subprocess.run([sys.executable, "-m", "hetu_ext.megatron_lm", str(SCRIPT), *PACKING, "--hetu-packing",
                          "unpacked"], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    proc = torchrun(tmp_path, *PACKING, "--hetu-packing", "balanced")
    out = proc.stdout + proc.stderr
    packs = [(int(s), int(p)) for s, p in re.findall(r"(\d+) sequences, \d+ tokens \| (\d+) packs", out)]
    assert len(packs) == 3 and all(p < s / 2 for s, p in packs), out[-3000:]  # DP rank 0 packs < its share
    assert_close(step_losses(out), step_losses(ref.stdout + ref.stderr), [1, 2, 3])


HETERO = """
pipelines:
  - num_microbatches: 6
    stages:
      - {ranks: [0], layers: [0, 2]}
  - num_microbatches: 2
    stages:
      - {ranks: [1], layers: [0, 2]}
"""


@needs_checkout
def test_megatron_lm_hetero_plan_handed_to_hetu_trainer(tmp_path):
    """Launch H: --hetu-plan runs in hetu_ext's trainer; the Megatron-LM-only flags it implies are accepted."""
    plan = tmp_path / "hetero.yaml"
    plan.write_text(HETERO)
    flags = [f for f in COMMON]
    flags[flags.index("--train-iters") + 1] = "4"
    proc = torchrun(tmp_path, *flags, "--hetu-plan", str(plan))
    out = proc.stdout + proc.stderr
    assert "2 pipeline(s), 8 microbatches per global batch" in out, out[-3000:]
    losses = step_losses(out)
    assert sorted(losses) == [1, 2, 3, 4] and losses[4] < losses[1], out[-3000:]


@needs_checkout
def test_megatron_lm_missing_patch_point_refused(tmp_path):
    """A checkout whose training.py lacks ``train_step`` (another Megatron-LM version) is refused before any
    process group: one line naming the symbol and the tested tag, exit code 2."""
    fake = tmp_path / "Megatron-LM"
    for item in CHECKOUT.iterdir():
        if item.name != "megatron":
            (fake / item.name).parent.mkdir(parents=True, exist_ok=True)
            (fake / item.name).symlink_to(item)
    (fake / "megatron").mkdir()
    for item in (CHECKOUT / "megatron").iterdir():
        if item.name != "training":
            (fake / "megatron" / item.name).symlink_to(item)
    shutil.copytree(CHECKOUT / "megatron" / "training", fake / "megatron" / "training", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    training = fake / "megatron" / "training" / "training.py"
    training.write_text(training.read_text().replace("def train_step(", "def train_one_step("))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "hetu_ext.megatron_lm", str(fake / "pretrain_gpt.py"), *COMMON,
                           "--hetu-straggler-interval", "2"], capture_output=True, text=True, timeout=120, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith(f"{PROG}: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "megatron.training.training.train_step" in errors[0] and TESTED_TAG in errors[0], errors


def test_megatron_lm_patch_point_check_names_symbol_and_tag():
    with pytest.raises(MegatronLMVersionError, match=rf"json\.no_such_symbol .*{TESTED_TAG}"):
        check_patch_points(["json:no_such_symbol"])


@pytest.mark.parametrize("flags, needle", [
    (["--hetu-plan", "PLAN", "--num-experts", "4"], "--num-experts"),
    (["--hetu-ckpt-format", "hetu", "--load", "SAVED", "--no-load-optim"], "--no-load-optim"),
    (["--hetu-ckpt-format", "hetu", "--load", "SAVED", "--no-load-rng"], "--no-load-rng"),
    (["--hetu-ckpt-format", "hetu", "--context-parallel-size", "2"], "--context-parallel-size 2"),
    (["--hetu-cpu-patches", "on", "--context-parallel-size", "2"], "Transformer Engine"),
    (["--hetu-emulate-slowdown", "step=2:rank=1:x=3"], "--hetu-straggler-interval"),
    (["--hetu-metrics-file", "m.jsonl"], "--hetu-metrics-file"),
    (["--hetu-straggler-interval", "2", "--dataloader-type", "cyclic"], "--dataloader-type"),
    (["--hetu-straggler-interval", "2", "--rampup-batch-size", "4", "4", "64"], "--rampup-batch-size"),
    (["--hetu-config", "x.yaml"], "--hetu-config"),
    (["--hetu-packing", "balanced", "--hetu-varlen-mock", LENGTHS, "--hetu-straggler-interval", "2"],
     "--hetu-straggler-interval"),
    (["--hetu-packing", "balanced", "--micro-batch-size", "2", "--hetu-varlen-mock", LENGTHS],
     "--micro-batch-size"),
    (["--hetu-packing", "balanced"], "--hetu-varlen-mock"),
])
def test_megatron_lm_refuses_unsupported_combinations(tmp_path, capsys, flags, needle):
    plan = tmp_path / "hetero.yaml"
    plan.write_text(HETERO)
    script = tmp_path / "pretrain_gpt.py"  # nothing is imported or run before these checks
    script.write_text("raise SystemExit('must not run')\n")
    saved = tmp_path / "saved"  # a hetu checkpoint to resume: --no-load-optim / --no-load-rng are refused with it
    (saved / "iter_0000003").mkdir(parents=True)
    (saved / "iter_0000003" / "manifest.json").write_text("{}")
    argv = [str(script), *COMMON, *[{"PLAN": str(plan), "SAVED": str(saved)}.get(f, f) for f in flags]]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{PROG}: error:") and needle in err[0], err


def test_megatron_lm_unknown_hetu_flag_suggests(tmp_path, capsys):
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("")
    with pytest.raises(SystemExit) as exit_:
        main([str(script), *COMMON, "--hetu-straggler-intervall", "2"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "did you mean --hetu-straggler-interval" in err[0], err


@needs_checkout
def test_megatron_lm_checkpoint_of_another_model_is_one_line(reference):
    """A's checkpoint (hidden 64) loaded by a model of hidden 32 (every tensor a corner of a saved one): refused on
    every rank, one line on rank 0, before any tensor moves."""
    tmp, _ = reference
    flags = [*COMMON, "--calculate-per-token-loss", "--load", str(tmp / "ckpt"), "--hetu-ckpt-format", "hetu"]
    flags[flags.index("--hidden-size") + 1] = "32"
    proc = megatron_lm(tmp, SCRIPT, *flags, check=False)
    out = proc.stdout + proc.stderr
    errors = [line for line in out.splitlines() if line.startswith(f"{PROG}: error:")]
    assert proc.returncode != 0 and len(errors) == 1, out[-3000:]
    assert "was saved from another model" in errors[0] and "[1024, 64] there and [1024, 32]" in errors[0], errors
