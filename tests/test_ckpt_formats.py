"""The seam through which DeepSpeed folders reach ``python -m hetu_ext.checkpoint`` (checkpoint/formats.py).

checkpoint/ imports no host framework (tests/test_layering.py), so the DeepSpeed reader lives in
hetu_ext/deepspeed/zero_checkpoint.py and the entry point hands it to the CLI. These tests catch the ways that
seam can break without a DeepSpeed run (test_ckpt_deepspeed.py reads real ZeRO folders through it): a CLI that
stops asking its formats, an entry point that forgets DeepSpeed's, and a recognition that imports DeepSpeed or
Megatron (every ``inspect`` of a hetu folder would then pay for importing them).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field

from hetu_ext.checkpoint.cli import main
from hetu_ext.checkpoint.formats import recognising


@dataclass
class _Marked:
    """A format recognising directories that hold a file ``MARK``; records what the CLI asked."""

    name: str = "marked"
    calls: list = field(default_factory=list)

    def recognises(self, path: str) -> bool:
        from pathlib import Path

        return (Path(path) / "MARK").exists()

    def cli_lines(self, command: str, path: str, output: str | None, kind: str, to: str) -> list[str]:
        self.calls.append((command, path, output, kind, to))
        return [f"marked {command}"]


def test_cli_reads_a_recognised_folder_through_its_format(tmp_path, capsys):
    """A recognised folder goes to its format with convert's arguments as given; without the format the same
    folder is not a hetu checkpoint (one error line, exit 2); an unrecognised folder is read as hetu's."""
    (tmp_path / "MARK").write_text("")
    marked = _Marked()
    assert main(["inspect", str(tmp_path)], formats=(marked,)) == 0
    assert capsys.readouterr().out == "marked inspect\n"
    assert main(["convert", str(tmp_path), "out", "--kind", "exp_avg", "--to", "torch_dist"], formats=(marked,)) == 0
    assert marked.calls[-1] == ("convert", str(tmp_path), "out", "exp_avg", "torch_dist")
    assert main(["inspect", str(tmp_path)]) == 2
    assert "holds no committed hetu checkpoint" in capsys.readouterr().err
    (tmp_path / "MARK").unlink()
    assert main(["inspect", str(tmp_path)], formats=(marked,)) == 2 and len(marked.calls) == 2
    assert recognising((marked,), str(tmp_path)) is None


def test_entry_point_reads_deepspeed_folders_without_importing_hosts(tmp_path):
    """``python -m hetu_ext.checkpoint`` hands the CLI DeepSpeed's format, which recognises a ``save_checkpoint``
    folder (``latest``) and not a hetu one (its tracker) by file names alone: neither DeepSpeed nor Megatron is
    imported by the entry point or by recognising."""
    deepspeed, hetu = tmp_path / "ds", tmp_path / "hetu"
    for d in (deepspeed, hetu):
        d.mkdir()
        (d / "latest").write_text("global_step2")
    (hetu / "latest_checkpointed_iteration.txt").write_text("2")
    code = (
        "import sys\n"
        "from hetu_ext.checkpoint import __main__ as entry\n"
        "from hetu_ext.checkpoint.formats import recognising\n"
        "from hetu_ext.deepspeed.zero_checkpoint import ZERO_CHECKPOINTS\n"
        "assert ZERO_CHECKPOINTS in entry.FORMATS\n"
        f"assert recognising((ZERO_CHECKPOINTS,), {str(deepspeed)!r}) is ZERO_CHECKPOINTS\n"
        f"assert recognising((ZERO_CHECKPOINTS,), {str(hetu)!r}) is None\n"
        "print(sorted(m for m in ('deepspeed', 'megatron') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout
