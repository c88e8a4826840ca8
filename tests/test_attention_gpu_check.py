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
    # compile on vs off, and the chunked loss, each beside the same run (their decisions in the summary)
    assert result["first_step_s"] > 0 and result["loss_chunk_tokens"] == 0 and result["compile"] is False
    (tmp_path / "train_hetu_compile.json").write_text(json.dumps(dict(result, step_s=result["step_s"] / 1.2)))
    (tmp_path / "train_hetu_loss_chunk.json").write_text(json.dumps(dict(result, loss_chunk_tokens=1024)))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "summary", str(tmp_path)], cwd=ROOT,
                          env=ENV, check=True, capture_output=True, text=True, timeout=120)
    final = json.loads(proc.stdout.strip().splitlines()[-1])
    speedup = final["checks"]["speedup_over_local"]
    assert speedup["ok"] and abs(speedup["got"] - 2.5) < 1e-9
    assert final["checks"]["predict"]["ok"] and final["extra"]["hetu"]["migration_s"] == result["migration_s"]
    compiled = final["decisions"]["hetu_compile"]
    assert compiled["default_on_cuda"] == "on" and abs(compiled["gain"] - 1.2) < 1e-9
    assert final["decisions"]["hetu_loss_chunk_tokens"]["chunk"] == 1024


def test_gpu_check_passes_the_decided_flags():
    """The train step's flags for the two runs whose defaults the device decides."""
    from benchmarks.gpu_check import parse_args, train_argv

    args = parse_args(["train", "--out", "x.json", "--compile", "--loss-chunk-tokens", "1024"])
    argv = train_argv(args, ROOT, cuda=True)
    assert "--hetu-compile" in argv and argv[argv.index("--hetu-loss-chunk-tokens") + 1] == "1024"


COMPILED_FLEX = """
import torch
from torch._dynamo.utils import counters
from hetu_ext.megatron import flex_packs
gen = torch.Generator().manual_seed(0)
q = torch.randn(1000, 4, 16, generator=gen)
k, v = torch.randn(1000, 2, 16, generator=gen), torch.randn(1000, 2, 16, generator=gen)
for lengths in ([500, 300, 200], [100, 900], [10] * 100):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    got = flex_packs.packed_flex_attention(q, k, v, cu, scale=0.25, compiled=True)
    want = flex_packs.packed_flex_attention(q, k, v, cu, scale=0.25, compiled=False)
    print(float((got - want).abs().max() / want.abs().max()), counters["stats"]["unique_graphs"])
"""


def test_compiled_flex_compiles_once_per_shape_class():
    """The path packed training takes on CUDA, compiled by inductor for the CPU (forward only: flex has no CPU
    backward): three pack layouts of one shape class (1,000 tokens -> 1,024) give one compiled graph pair, not
    one per layout (each layout's block mask and mask_mod are new objects), and equal eager flex within 1e-6.
    Run in a fresh process without TORCHDYNAMO_DISABLE (which hetu_ext's CPU support sets)."""
    env = {k: v for k, v in ENV.items() if k != "TORCHDYNAMO_DISABLE"}
    proc = subprocess.run([sys.executable, "-c", COMPILED_FLEX], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900, check=True)
    rows = [line.split() for line in proc.stdout.strip().splitlines()]
    assert len(rows) == 3 and all(float(err) <= 1e-6 for err, _ in rows), proc.stdout
    assert len({graphs for _, graphs in rows}) == 1, proc.stdout  # no recompilation after the first layout
