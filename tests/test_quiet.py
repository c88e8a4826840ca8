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

import torch

from hetu_ext.checkpoint.storage import LocalStorage
from hetu_ext.checkpoint.writer import save_offline
from hetu_ext.hostlog import quiet_host_frameworks
from hetu_ext.plan import plan_to_dict, uniform_plan
from hetu_ext.runtime.reshard import Piece


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
    out = _run("hetu_ext.data.calibrate", "--out", str(table), "--hidden-size", "32", "--num-attention-heads", "2",
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
