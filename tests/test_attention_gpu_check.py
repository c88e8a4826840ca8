"""benchmarks/gpu_check.sh and its Python steps (benchmarks/gpu_check.py), checked without a GPU: the script parses
and refuses a machine without CUDA in one line (exit 2); the trainer step, with its TP 1 -> 1 migration, and the
summary run at toy sizes on CPU (``--model tiny``), so the device run does not fail on this code's bugs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import ROOT

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(ROOT))


def test_gpu_check_script_parses_and_refuses_a_machine_without_cuda(tmp_path):
    assert subprocess.run(["bash", "-n", "benchmarks/gpu_check.sh"], cwd=ROOT).returncode == 0
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh"], cwd=ROOT, capture_output=True, text=True,
                          env=dict(ENV, OUT=str(tmp_path / "out"), PYTHON=sys.executable), timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "no CUDA device" in proc.stderr, proc.stderr


def test_gpu_check_train_and_summary_at_toy_sizes(tmp_path):
    """A tiny Llama-style run of the trainer's default attention with a migration after step 3, then the summary
    beside a local-spec figure and a plan-predict line: the JSON holds the trainer's step figures, the migration's
    seconds, and the summary checks speed-up and prediction (their values on CPU mean nothing)."""
    out = tmp_path / "train_hetu.json"
    subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "train", "--model", "tiny", "--seq-length", "64",
                    "--iters", "4", "--migrate", "--out", str(out)], cwd=ROOT, env=ENV, check=True, timeout=300,
                   capture_output=True)
    result = json.loads(out.read_text())
    assert result["core_attention"] == "ScoreFreeAttention" and result["steps"] == 4
    assert result["tokens_per_step"] == 4 * 64 and result["step_s"] > 0 and len(result["migration_s"]) == 1
    local = dict(result, core_attention="PackedDotProductAttention", tokens_per_s=result["tokens_per_s"] / 2.5)
    (tmp_path / "train_local.json").write_text(json.dumps(local))
    (tmp_path / "predict.json").write_text(f"== predict\n{json.dumps({'step_s': result['step_s'] * 1.1})}\n")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "summary", str(tmp_path)], cwd=ROOT,
                          env=ENV, check=True, capture_output=True, text=True, timeout=120)
    final = json.loads(proc.stdout.strip().splitlines()[-1])
    speedup = final["checks"]["speedup_over_local"]
    assert speedup["ok"] and abs(speedup["got"] - 2.5) < 1e-9
    assert final["checks"]["predict"]["ok"] and final["extra"]["hetu"]["migration_s"] == result["migration_s"]
