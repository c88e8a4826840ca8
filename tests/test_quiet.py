"""The offline tools print their own output and nothing of the host frameworks' (issue 12, item 11).

Megatron-core warns four times at import that Transformer Engine and Apex are absent, and logs a deprecation line
for every legacy tokenizer; before ``hetu_ext.hostlog.quiet_host_frameworks`` these 8-14 lines came before the
output of preprocess_data and calibrate. Each tool runs here as the user runs it (a subprocess, smallest
settings) and the combined stdout + stderr must hold no line matching ``warn`` (as ``grep -ci warn`` counts)
next to the tool's normal output.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import torch

from hetu_ext.checkpoint.storage import LocalStorage
from hetu_ext.checkpoint.writer import save_offline
from hetu_ext.hostlog import quiet_host_frameworks
from hetu_ext.plan import plan_to_dict, uniform_plan
from hetu_ext.runtime.reshard import Piece

ROOT = Path(__file__).resolve().parents[1]


def _run(*argv: str, cwd=None) -> str:
    proc = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=300, cwd=cwd,
                          env={**_env(), "PYTHONWARNINGS": "default"})  # show every warning the tool does not drop
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    return out


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _warning_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if "warn" in line.lower()]


def test_preprocess_data_and_calibrate_print_no_warnings(tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("hello world", "a second document")))
    out = _run("hetu_ext.megatron.preprocess_data", "--input", str(docs), "--output-prefix", str(tmp_path / "d"),
               "--append-eod")
    assert "wrote 2 documents" in out and _warning_lines(out) == [], out
    table = tmp_path / "cost.yaml"
    out = _run("hetu_ext.cli.calibrate", "--out", str(table), "--hidden-size", "32", "--num-attention-heads", "2",
               "--seq-lengths", "16,32,64", "--repeats", "1")
    assert f"wrote {table}" in out and table.exists() and _warning_lines(out) == [], out


def test_checkpoint_inspect_prints_no_warnings(tmp_path):
    full = {("param/embedding.word_embeddings.weight", ()): torch.randn(16, 4),
            ("param/decoder.layers.mlp.linear_fc1.weight", (0,)): torch.randn(8, 4)}
    pieces = [[Piece(n, i, ((0, t.shape[0]), (0, 4)), t) for (n, i), t in full.items()]]
    save_offline(LocalStorage(tmp_path), iteration=2, pieces_by_rank=pieces,
                 info={"plan": plan_to_dict(uniform_plan(world_size=1, num_layers=1))})
    out = _run("hetu_ext.checkpoint", "inspect", str(tmp_path))
    assert "iteration 2" in out and _warning_lines(out) == [], out


def test_quiet_host_frameworks_is_idempotent_and_keeps_other_warnings():
    """A second call adds no filter; a warning from outside the host frameworks still shows."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_host_frameworks()
        count = len(warnings.filters)
        quiet_host_frameworks()
        assert len(warnings.filters) == count
        warnings.warn("Transformer Engine and Apex are not installed. Falling back", UserWarning)
        warnings.warn("ours", UserWarning)
    assert [str(w.message) for w in caught] == ["ours"]


def test_deepspeed_run_prints_megatron_log_lines_and_no_warnings(tmp_path):
    """launch/pretrain_gpt_deepspeed.py, as the README runs it (torchrun, 2 CPU ranks, ZeRO-2): rank 0 prints
    Megatron-LM's log line per step (the Megatron path's format_log_line: it printed its own INFO format), no
    warning line (Megatron's legacy-tokenizer and MockGPTDataset lines, torch's all_gather_into_tensor
    FutureWarning from ZeRO), and the checkpoint CLI reads the DeepSpeed folder it saved without warnings.

    The first start took minutes in silence: DeepSpeed JIT-compiled its shared-memory all-reduce op (used only by
    DeepSpeed inference) into TORCH_EXTENSIONS_DIR; with an empty one here, nothing may be compiled."""
    save, extensions = tmp_path / "ds", tmp_path / "torch_extensions"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0",
                           "launch/pretrain_gpt_deepspeed.py", "--zero-stage", "2", "--num-layers", "2",
                           "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
                           "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3", "--lr",
                           "1e-3", "--mock-data", "--save", str(save)], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env={**_env(), "PYTHONWARNINGS": "default",
                                                      "TORCH_EXTENSIONS_DIR": str(extensions)})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert not extensions.exists() and "built successfully" not in out, out
    steps = [line for line in proc.stdout.splitlines() if " iteration " in line]
    assert len(steps) == 3, proc.stdout
    assert steps[0].startswith(" [") and "iteration        1/       3 | consumed samples:            4 |" in steps[0]
    for field in ("elapsed time per iteration (ms):", "learning rate:", "global batch size:     4 |", "lm loss:",
                  "grad norm:", "tokens/s:"):
        assert field in steps[-1], steps[-1]
    assert _warning_lines(out) == [], out
    out = _run("hetu_ext.checkpoint", "inspect", str(save))
    assert "DeepSpeed ZeRO-2 checkpoint" in out and _warning_lines(out) == [], out
