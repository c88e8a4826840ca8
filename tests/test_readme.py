"""Every command block of README.md and of every docs/*.md page runs as written, with small sizes (issue 12,
acceptance 4; issue 31, acceptance 5), and the pages stay honest (links resolve, the README's gold tests exist, the
generated configuration page is up to date, the README stays short).

The ```bash blocks are read from each page in order and run by bash in one scratch folder per page that links the
repository's launch/, configs/, hetu_ext/ and benchmarks/ (so the blocks' relative paths hold, and what one block of a page
saves the next block of the same page can load), with this environment's python, torchrun and deepspeed first on
PATH. Sizes are made small by one table (``SMALL``): step counts and save intervals shrink, in proportion, nothing
else changes. ``DIR`` (the FISEdit model folder) is the tiny random-weight pipeline of test_fisedit_pipeline. A
block that equals an earlier block and writes nothing (no --save, -o, --out, >) runs once. A block this file does
not know fails the test, so a new command gets run, or a reason in ``SKIPPED``. Block ids are
``PAGE-first_words_of_the_block`` (``readme-...``, ``checkpoints-...``): ``pytest tests/test_readme.py -k
checkpoints`` runs one page's blocks.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_fisedit_pipeline import model_dir  # noqa: F401 - the fixture, re-used

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
README_MAX_LINES = 200
SMALL = [(r"--train-iters (\d+)", lambda m: f"--train-iters {max(2, int(m.group(1)) // 5)}"),
         (r"--lr-decay-iters (\d+)", lambda m: f"--lr-decay-iters {max(2, int(m.group(1)) // 5)}"),
         (r"--save-interval (\d+)", lambda m: "--save-interval 1"),
         (r"--exit-interval (\d+)", lambda m: f"--exit-interval {max(2, int(m.group(1)) // 5)}"),
         (r"--hetu-global-batch-tokens 16384", lambda m: "--hetu-global-batch-tokens 4096")]
"""Fewer steps (20 -> 4, 10 -> 2: a resume keeps its proportions) and a smaller token budget."""
SKIPPED = {"make test-fast": "make test-fast is a part of this suite",
           "make demo": "make demo (launch/demo.sh) runs in tests/test_demo.py, its metrics read back",
           "make test": "make test is this suite",
           "python -m venv": "the install commands are the Makefile's venv target, which make test runs first",
           "# Megatron-LM's own Llama 3 8B example": "tests/test_megatron_lm_recipe.py runs it and reads its log",
           "# Megatron-LM's own Mixtral 8x7B example": "tests/test_megatron_lm_moe.py runs it, resumes it under other "
                                                      "layouts and reads its log"}
"""First words of a block -> why this file does not run it."""


def page_id(page: Path) -> str:
    return page.stem.lower().replace("_", "-")


def page_blocks(page: Path) -> list[str]:
    """A page's ```bash blocks, each as one script (indentation of an indented block removed)."""
    blocks = re.findall(r"^( *)```bash\n(.*?)^\1```", page.read_text(), flags=re.S | re.M)
    return ["\n".join(line[len(indent):] for line in body.splitlines()) for indent, body in blocks]


def _name(block: str) -> str:
    first = block.strip().splitlines()[0]
    return re.sub(r"[^a-z0-9]+", "_", first.split("#")[0].lower())[:60].strip("_")


def all_blocks() -> list[tuple[str, Path, str]]:
    """(id, page, script) of every block of every page, ids unique (a repeated id gets -2, -3, ...)."""
    out, seen = [], {}
    for page in PAGES:
        for block in page_blocks(page):
            base = f"{page_id(page)}-{_name(block)}"
            seen[base] = seen.get(base, 0) + 1
            out.append((base if seen[base] == 1 else f"{base}-{seen[base]}", page, block))
    return out


BLOCKS = all_blocks()


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """One scratch folder per page, made on first use."""
    folders: dict[Path, Path] = {}

    def folder(page: Path) -> Path:
        if page not in folders:
            folders[page] = tmp_path_factory.mktemp(f"blocks_{page_id(page)}")
            for name in ("launch", "configs", "hetu_ext", "benchmarks"):
                (folders[page] / name).symlink_to(ROOT / name)
        return folders[page]
    return folder


def test_readme_has_the_blocks_this_file_runs():
    readme = [b for _, page, b in BLOCKS if page.name == "README.md"]
    assert any("--nproc-per-node 4" in b and "launch/pretrain_gpt.py" in b for b in readme), readme
    assert len(BLOCKS) >= 15, [i for i, _, _ in BLOCKS]
    assert len({i for i, _, _ in BLOCKS}) == len(BLOCKS)


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[i for i, _, _ in BLOCKS])
def test_docs_block_runs(index, scratch, model_dir):  # noqa: F811 - model_dir is the fixture
    block_id, page, block = BLOCKS[index]
    skipped = [reason for command, reason in SKIPPED.items() if block.lstrip().startswith(command)]
    if skipped:
        pytest.skip(skipped[0])
    earlier = [i for i, _, b in BLOCKS[:index] if b == block]
    if earlier and not re.search(r"--save|--out\b| -o |>", block):  # writes nothing a later block could read
        pytest.skip(f"the same commands run as {earlier[0]}")
    script = block
    for pattern, small in SMALL:
        script = re.sub(pattern, small, script)
    script = re.sub(r"--model DIR\b", f"--model {model_dir}", script)
    if "../shared/" in script:  # the Megatron-LM checkout this machine keeps beside the repository
        shared = ROOT.parent / "shared"
        if not shared.is_dir():
            pytest.skip(f"the block uses {shared}, which this machine does not have")
        script = script.replace("../shared/", f"{shared}/")
    assert "<" not in script.replace("<<", ""), f"a placeholder is left in {page.name}'s block:\n{block}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    proc = run_block(script, scratch(page), env)
    assert proc.returncode == 0, f"{script}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-5000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-5000:]
    if "launch/pretrain_gpt" in script:  # a training block: Megatron-LM's log lines, finite losses
        losses = [float(m) for m in re.findall(r"lm loss: ([0-9.E+-]+)", proc.stdout)]
        assert losses and all(0 < loss < 20 for loss in losses), proc.stdout[-3000:]


def run_block(script: str, cwd: Path, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    """bash -euo pipefail -c SCRIPT in its own session, output to files (a process the block leaves in the
    background cannot hold a pipe open and hang the test); whatever is left of the session afterwards is killed."""
    out, err = cwd / ".block_stdout", cwd / ".block_stderr"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, stdout=stdout, stderr=stderr,
                                env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    return subprocess.CompletedProcess(proc.args, code, out.read_text(), err.read_text())


def test_readme_is_short_and_links_resolve():
    """The README stays a front page (<= 200 lines); every relative link of it and of docs/ names a file that
    exists and, with ``#anchor``, a heading of that page (GitHub's anchors: lower case, punctuation dropped, spaces
    to hyphens)."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into a docs/ page"
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            path, _, anchor = target.partition("#")
            if re.match(r"[a-z]+:", path):
                continue
            linked = (page.parent / path) if path else page
            if not linked.exists() or anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)  # no headings inside code blocks
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", text, flags=re.M)}


def test_readme_gold_tests_exist():
    """Every ``tests/FILE.py::name`` the README names is a test function of that file."""
    named = re.findall(r"(tests/test_\w+\.py)::(test_\w+)", (ROOT / "README.md").read_text())
    assert len(named) >= 15, named
    missing = [f"{file}::{name}" for file, name in named
               if not (ROOT / file).is_file() or not re.search(rf"^def {name}\(", (ROOT / file).read_text(), re.M)]
    assert not missing, f"the README names tests that do not exist (renamed or moved?): {missing}"


def test_every_test_module_states_its_kind():
    """docs/testing.md's promise: each tests/test_*.py is named in tests/conftest.py, in MODULE_KINDS or TEST_KINDS
    (gold, e2e, faults) or in FAST_MODULES, so a new slow gold test does not slip into ``make test-fast``."""
    import conftest

    named = set(conftest.MODULE_KINDS) | {m for m, _, _ in conftest.TEST_KINDS} | conftest.FAST_MODULES
    modules = {p.stem for p in (ROOT / "tests").glob("test_*.py")}
    assert not modules - named, (f"add {sorted(modules - named)} to tests/conftest.py: MODULE_KINDS or TEST_KINDS "
                                 "for gold / e2e / faults tests, else FAST_MODULES")
    assert not named - modules, f"tests/conftest.py names modules that no longer exist: {sorted(named - modules)}"


def test_configuration_page_is_generated_from_the_schema():
    """docs/configuration.md equals what the schema generates; after changing hetu_ext/config/schema.py run
    ``python -m hetu_ext.config --markdown -o docs/configuration.md``."""
    from hetu_ext.config.markdown import render_markdown

    assert (ROOT / "docs" / "configuration.md").read_text() == render_markdown(), \
        "docs/configuration.md is out of date: python -m hetu_ext.config --markdown -o docs/configuration.md"
