"""python -m hetu_ext.checkpoint: inspect, verify, convert; bad input ends with one error line and exit code 2."""

from __future__ import annotations

import subprocess
import sys

import torch
from safetensors.torch import load_file

from hetu_ext.checkpoint.cli import main
from hetu_ext.checkpoint.storage import LocalStorage
from hetu_ext.checkpoint.writer import save_offline
from hetu_ext.plan import plan_to_dict, uniform_plan
from hetu_ext.runtime.reshard import Piece


def _save(root, iteration: int) -> dict:
    g = torch.Generator().manual_seed(iteration)
    full = {("param/decoder.layers.mlp.linear_fc1.weight", (layer,)): torch.randn(8, 4, generator=g)
            for layer in range(2)}
    full[("param/embedding.word_embeddings.weight", ())] = torch.randn(16, 4, generator=g)
    full[("exp_avg/embedding.word_embeddings.weight", ())] = torch.randn(16, 4, generator=g)
    pieces = [[Piece(n, i, ((r * t.shape[0] // 2, (r + 1) * t.shape[0] // 2), (0, 4)),
                     t[r * t.shape[0] // 2:(r + 1) * t.shape[0] // 2]) for (n, i), t in full.items()] for r in range(2)]
    plan = plan_to_dict(uniform_plan(world_size=2, tp=2, num_layers=2))
    save_offline(LocalStorage(root), iteration=iteration, pieces_by_rank=pieces, info={"plan": plan})
    return full


def test_inspect_verify_convert(tmp_path, capsys):
    _save(tmp_path, 1)
    full = _save(tmp_path, 3)
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "iteration 3" in out and "param/decoder.layers.mlp.linear_fc1.weight" in out and "pipeline" in out
    assert main(["verify", str(tmp_path), "--all"]) == 0
    assert capsys.readouterr().out.count("OK: iteration") == 2
    assert main(["convert", str(tmp_path / "iter_0000003"), str(tmp_path / "out.safetensors")]) == 0
    exported = load_file(str(tmp_path / "out.safetensors"))
    assert sorted(exported) == ["decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.1.mlp.linear_fc1.weight",
                                "embedding.word_embeddings.weight"]
    assert torch.equal(exported["decoder.layers.1.mlp.linear_fc1.weight"],
                       full[("param/decoder.layers.mlp.linear_fc1.weight", (1,))])


def test_bad_input_exits_2_with_one_error_line(tmp_path, capsys):
    assert main(["verify", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no such directory" in err and err.count("\n") == 1
    _save(tmp_path, 2)
    assert main(["convert", str(tmp_path), str(tmp_path / "o.safetensors"), "--kind", "master"]) == 2
    assert "the checkpoint holds ['exp_avg', 'param']" in capsys.readouterr().err
    shard = tmp_path / "iter_0000002" / "shard_00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 1
    shard.write_bytes(bytes(data))
    proc = subprocess.run([sys.executable, "-m", "hetu_ext.checkpoint", "verify", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "shard_00001.safetensors" in lines[0] and "checksum mismatch" in lines[0], lines
