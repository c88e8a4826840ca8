"""Every command block of the README runs as written (issue 12, acceptance 4), with small sizes.

The ```bash blocks are read from README.md in order and run by bash in one scratch folder that links the
repository's launch/, configs/ and hetu_ext/ (so the blocks' relative paths hold, and what one block saves the
next can load), with this environment's python, torchrun and deepspeed first on PATH. Sizes are made small by
one table (``SMALL``): step counts and save intervals shrink, in proportion, nothing else changes. ``DIR`` (the
FISEdit model folder, which no release ships yet) is the tiny random-weight pipeline of test_fisedit_pipeline.
A block this file does not know fails the test, so a new README command gets run, or a reason here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_fisedit_pipeline import model_dir  # noqa: F401 - the fixture, re-used

ROOT = Path(__file__).resolve().parents[1]
SMALL = [(r"--train-iters (\d+)", lambda m: f"--train-iters {max(2, int(m.group(1)) // 5)}"),
         (r"--lr-decay-iters (\d+)", lambda m: f"--lr-decay-iters {max(2, int(m.group(1)) // 5)}"),
         (r"--save-interval (\d+)", lambda m: "--save-interval 1"),
         (r"--exit-interval (\d+)", lambda m: f"--exit-interval {max(2, int(m.group(1)) // 5)}"),
         (r"--hetu-global-batch-tokens 16384", lambda m: "--hetu-global-batch-tokens 4096")]
"""Fewer steps (20 -> 4, 10 -> 2: a resume keeps its proportions) and a smaller token budget."""
SKIPPED = {"make demo": "make demo (launch/demo.sh) runs in tests/test_demo.py, its metrics read back",
           "make test": "make test is this suite"}


def readme_blocks() -> list[str]:
    """The README's ```bash blocks, each as one script (continuation lines joined, indentation removed)."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"^( *)```bash\n(.*?)^\1```", text, flags=re.S | re.M)
    return ["\n".join(line[len(indent):] for line in body.splitlines()) for indent, body in blocks]


def _name(block: str) -> str:
    first = block.strip().splitlines()[0]
    return re.sub(r"[^a-z0-9]+", "_", first.split("#")[0].lower())[:60].strip("_")


BLOCKS = readme_blocks()


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("readme")
    for name in ("launch", "configs", "hetu_ext"):
        (folder / name).symlink_to(ROOT / name)
    return folder


def test_readme_has_the_blocks_this_file_runs():
    assert len(BLOCKS) >= 10, [_name(b) for b in BLOCKS]
    assert any("--nproc-per-node 4" in b and "launch/pretrain_gpt.py" in b for b in BLOCKS)


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[_name(b) for b in BLOCKS])
def test_readme_block_runs(index, scratch, model_dir):  # noqa: F811 - model_dir is the fixture
    block = BLOCKS[index]
    skipped = [reason for command, reason in SKIPPED.items() if block.lstrip().startswith(command)]
    if skipped:
        pytest.skip(skipped[0])
    script = block
    for pattern, small in SMALL:
        script = re.sub(pattern, small, script)
    script = re.sub(r"--model DIR\b", f"--model {model_dir}", script)
    if "../shared/" in script:  # the Megatron-LM checkout this machine keeps beside the repository
        shared = ROOT.parent / "shared"
        if not shared.is_dir():
            pytest.skip(f"the block uses {shared}, which this machine does not have")
        script = script.replace("../shared/", f"{shared}/")
    assert "<" not in script.replace("<<", ""), f"a placeholder is left in the README block:\n{block}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=scratch, capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, f"{script}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-5000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-5000:]
    if "launch/pretrain_gpt" in script:  # a training block: Megatron-LM's log lines, finite losses
        losses = [float(m) for m in re.findall(r"lm loss: ([0-9.E+-]+)", proc.stdout)]
        assert losses and all(0 < loss < 20 for loss in losses), proc.stdout[-3000:]
