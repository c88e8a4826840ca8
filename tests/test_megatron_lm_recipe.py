"""Megatron-LM's own Llama 3 8B example (``examples/llama/train_llama3_8b_h100_fp8.sh`` at core_v0.16.1), every
flag kept and only the sizes changed (tests/megatron_lm_examples.py), run on 4 CPU ranks through
``torchrun -m hetu_ext.megatron_lm`` with nothing added for the CPU: the entry point rewrites the CUDA-only flags
itself (one notice), FP8 trains in the recipe's bf16, ``--sequence-parallel`` at TP 1 gets Megatron-LM's own notice,
``--apply-layernorm-1p`` runs on the local spec's norms (hetu_ext.megatron.norms).

Two launches:

* **R**, the recipe as it is: 12 iterations with the distributed optimizer, overlapped gradient reduce and parameter
  gather; evaluation every 4 iterations (Megatron-LM's validation lines), Megatron-LM's own torch_dist save at
  iteration 6 and 12 (its saver spawns a process: that child runs too);
* **W**, the same with straggler weighting (``--hetu-straggler-interval 1``, rank 1 emulated 6x slow): the slow
  rank gets fewer microbatches, and every training and validation loss equals R's. The recipe computes in bf16 and
  reduces gradients in bf16 (``--grad-reduce-in-bf16``), so another split of a global batch over the ranks sums the
  same gradients in another order: tolerance 2e-3 relative on the loss after a few steps (the bf16 gold tests'
  scale, tests/helpers.py), and the first step's loss, computed before any update, to Megatron-LM's 7 printed
  digits.

And pure checks of the rewrite and of the zero-centred norms.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hetu_ext.megatron.norms import ZeroCenteredLayerNorm, ZeroCenteredRMSNorm, local_norm
from hetu_ext.megatron_lm.rehearsal import CPU_SWITCHES, cpu_rewrite

sys.path.insert(0, str(Path(__file__).parent))
from megatron_lm_examples import LLAMA3_8B_FP8, LLAMA_CPU_SIZES, resized  # noqa: E402
from megatron_lm_examples import EXAMPLES  # noqa: E402
from helpers import run_block_ranks, run_script  # noqa: E402
from test_megatron_lm import needs_checkout, step_losses  # noqa: E402

from hetu_ext.megatron_lm.table import UNCLASSIFIED, flag_rows, markdown_table

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "megatron-lm.md"
BLOCK_START = "# Megatron-LM's own Llama 3 8B example"
VALID = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.E+-]+) \|")
BF16_RTOL = 2e-3


def recipe_block() -> str:
    """The recipe's command block of docs/megatron-lm.md, with the checkout of this machine."""
    blocks = re.findall(r"^```bash\n(.*?)^```", DOC.read_text(), flags=re.S | re.M)
    block = next(b for b in blocks if b.startswith(BLOCK_START))
    return block.replace("../shared/", f"{ROOT.parent}/shared/")


def block_argv(block: str, cwd: Path) -> list[str]:
    """The flags the block gives pretrain_gpt.py, as bash expands them."""
    head, launch = block.split("\ntorchrun", 1)
    arrays = re.findall(r"\$\{(\w+)\[@\]\}", launch)
    proc = subprocess.run(["bash", "-c", head + "\nprintf '%s\\n' " + " ".join(f"${{{a}[@]}}" for a in arrays)],
                          capture_output=True, text=True, cwd=cwd, check=True)
    return proc.stdout.splitlines()


def run_recipe(cwd: Path, *extra: str, nproc: int = 4, torchrun: bool = False) -> str:
    """The docs' block, run as written (with ``extra`` flags after the recipe's, on ``nproc`` ranks); its output.
    ``torchrun``: exactly as a user runs it (the plain run), else its ranks forked from the zygote
    (helpers.run_block_ranks: the same words, without each rank's imports)."""
    script = recipe_block().replace("--nproc-per-node 4", f"--nproc-per-node {nproc}").rstrip()
    script += "".join(f" {flag}" for flag in extra) + "\n"
    return run_script(script, cwd) if torchrun else run_block_ranks(script, cwd)


def validation_losses(log: str) -> dict[int, float]:
    return {int(it): float(v) for it, v in VALID.findall(log)}


TABLE_BEGIN, TABLE_END = "<!-- flag table: begin -->", "<!-- flag table: end -->"


def test_cpu_rewrite_of_the_llama_recipe():
    argv = resized(LLAMA3_8B_FP8, LLAMA_CPU_SIZES, {})
    rw = cpu_rewrite(argv)
    gone = ("--fp8-format", "--fp8-amax-history-len", "--fp8-amax-compute-algo", "--fp8-param-gather",
            "--attention-backend", "--cross-entropy-loss-fusion", "--profile", "--profile-step-start",
            "--profile-step-end")
    assert not [t for t in rw.argv if t in gone], rw.argv
    for value in ("hybrid", "1024", "max", "fused"):  # the dropped flags' values went with them
        assert value not in rw.argv, value
    for flag, value in CPU_SWITCHES.items():
        assert flag in rw.argv, flag
        if value:
            assert rw.argv[rw.argv.index(flag) + 1] == value
    kept = [t for t in argv if t not in gone and t not in ("hybrid", "1024", "max", "fused", "4", "2", "3")]
    assert all(t in rw.argv for t in kept)
    notice = rw.notice()
    assert notice.count("\n") == 0 and "--fp8-format hybrid" in notice and "--profile" in notice
    # a GPU-only value is replaced and said; a run already set up for CPU gets nothing added
    rw = cpu_rewrite(["--transformer-impl", "transformer_engine"])
    assert rw.argv[:2] == ["--transformer-impl", "local"] and "transformer_engine" in rw.notice()
    assert cpu_rewrite(cpu_rewrite(argv).argv).notice() is None
    assert cpu_rewrite(["--profile", "--use-pytorch-profiler"]).argv[:2] == ["--profile", "--use-pytorch-profiler"]


class _Config:
    def __init__(self, normalization, zero, sp=False):
        self.normalization, self.layernorm_zero_centered_gamma, self.sequence_parallel = normalization, zero, sp


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_zero_centered_norm_is_the_norm_with_gamma_plus_one(normalization):
    torch.manual_seed(0)
    norm = local_norm(_Config(normalization, True, sp=True), 8, eps=1e-6)
    assert isinstance(norm, ZeroCenteredLayerNorm if normalization == "LayerNorm" else ZeroCenteredRMSNorm)
    assert torch.equal(norm.weight, torch.zeros(8))  # stored as gamma - 1, Megatron's layout
    assert all(p.sequence_parallel for p in norm.parameters())
    plain = local_norm(_Config(normalization, False), 8, eps=1e-6)
    assert type(plain) in (torch.nn.LayerNorm, torch.nn.RMSNorm) and not hasattr(plain.weight, "sequence_parallel")
    assert norm.state_dict().keys() == plain.state_dict().keys()
    with torch.no_grad():
        norm.weight.normal_()
        plain.weight.copy_(norm.weight + 1)
        if normalization == "LayerNorm":
            norm.bias.normal_()
            plain.bias.copy_(norm.bias)
    x = torch.randn(3, 8)
    torch.testing.assert_close(norm(x), plain(x), rtol=0, atol=1e-6)


def test_docs_block_is_the_example_unchanged_but_for_sizes(tmp_path):
    want = resized(LLAMA3_8B_FP8, LLAMA_CPU_SIZES, {"CKPT": "checkpoints/llama3_8b_fp8",
                                                    "TB": "tensorboard_logs/llama3_8b_fp8",
                                                    "CACHE": f"{tmp_path}/benchmark_cache_llama3_8b_fp8"})
    assert block_argv(recipe_block(), tmp_path) == want


def example_flag_table() -> str:
    return markdown_table(flag_rows([t for argv in EXAMPLES.values() for t in argv]))


def test_every_flag_of_the_examples_is_classified_on_each_path():
    """Acceptance 2: every flag of the three example scripts has a rule on Megatron-LM's loop and in hetu_ext's
    trainer, and docs/megatron-lm.md shows the generated table (``python tests/megatron_lm_examples.py``
    rewrites it)."""
    for script, argv in EXAMPLES.items():
        rows = flag_rows(argv)
        assert [r[0] for r in rows if r[2] == UNCLASSIFIED] == [], script
        assert all(r[1].startswith("Megatron-LM") for r in rows)
    text = DOC.read_text()
    table = text.split(TABLE_BEGIN, 1)[1].split(TABLE_END, 1)[0].strip("\n") + "\n"
    assert table == example_flag_table(), "docs/megatron-lm.md's flag table is stale: python tests/megatron_lm_examples.py"


@pytest.fixture(scope="module")
def plain_recipe(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("recipe")
    return tmp, run_recipe(tmp, torchrun=True)


@needs_checkout
def test_llama3_recipe_unchanged_but_sizes_trains_evaluates_and_saves_on_cpu(plain_recipe):
    tmp, log = plain_recipe
    losses = step_losses(log)
    assert sorted(losses) == list(range(1, 13)), log[-3000:]
    assert losses[12] < losses[1] - 0.1, losses
    assert sorted(validation_losses(log)) == [4, 8, 12], log[-3000:]
    notices = [line for line in log.splitlines() if "CPU rehearsal (no CUDA device)" in line]
    assert len(notices) == 1 and "--fp8-format hybrid" in notices[0], notices
    # --sequence-parallel at TP 1: Megatron-LM turns it off (its warning) and goes on
    assert re.search(r"sequence_parallel \.+ False", log), log[:3000]
    for it in (6, 12):  # Megatron-LM's own torch_dist checkpoints (its saver spawns a helper process)
        assert (tmp / "checkpoints" / "llama3_8b_fp8" / f"iter_{it:07d}" / "metadata.json").is_file(), log[-3000:]


@needs_checkout
def test_llama3_recipe_with_straggler_weighting_equals_the_plain_run(plain_recipe):
    tmp, log = plain_recipe
    run = tmp / "weighted"
    run.mkdir()
    out = run_recipe(run, "--hetu-straggler-interval", "1", "--hetu-straggler-window", "2",
                     "--hetu-straggler-threshold", "2.0", "--hetu-emulate-slowdown", "step=1:rank=1:x=6",
                     "--hetu-emulate-layer-ms", "25", "--save-interval", "1000")
    moved = re.findall(r"microbatches per data-parallel rank: (\d+), (\d+), (\d+), (\d+)", out)
    assert any(int(r1) < 2 for _, r1, _, _ in moved), out[-3000:]  # rank 1's share of 8 fell below 8/4
    want, got = step_losses(log), step_losses(out)
    assert sorted(got) == list(range(1, 13)), out[-3000:]
    assert abs(got[1] - want[1]) <= 1e-6 * abs(want[1]), (got, want)
    for step in range(2, 13):
        assert abs(got[step] - want[step]) <= BF16_RTOL * abs(want[step]), (step, got, want)
    want_v, got_v = validation_losses(log), validation_losses(out)
    assert sorted(got_v) == [4, 8, 12]
    for it in got_v:
        assert abs(got_v[it] - want_v[it]) <= BF16_RTOL * abs(want_v[it]), (it, got_v, want_v)


HETERO_PLAN = """
pipelines:
  - num_microbatches: 5
    stages:
      - {ranks: [0, 1], layers: [0, 4]}
  - num_microbatches: 3
    stages:
      - {ranks: [2], layers: [0, 1]}
      - {ranks: [3], layers: [1, 4]}
"""
"""Two pipelines of different shapes over 4 ranks: TP 2 (with the recipe's --sequence-parallel) holding 5 of the 8
samples of a step, and PP 2 with uneven stages (1 and 3 layers) holding 3."""


@needs_checkout
def test_llama3_recipe_handed_to_a_heterogeneous_plan_equals_one_process(tmp_path):
    """Acceptance 1(c): the same block with ``--hetu-plan FILE`` runs in hetu_ext's trainer (every flag of the
    recipe implemented or accepted), trains and evaluates, and equals the same command on one process (hand-off
    with ``--hetu-runtime plan``, --nproc-per-node 1). Tolerance: bf16 weights and activations, TP 2 and another
    split of the batch round differently (bf16 has 8 bits of mantissa): 2e-3 relative on training and validation
    losses over 12 steps."""
    plan = tmp_path / "hetero.yaml"
    plan.write_text(HETERO_PLAN)
    (tmp_path / "plan").mkdir()
    (tmp_path / "one").mkdir()
    out = run_recipe(tmp_path / "plan", "--hetu-plan", str(plan))
    assert "hetu_ext's trainer" in out or "Megatron-LM flags that do not change the numbers" in out, out[-3000:]
    one = run_recipe(tmp_path / "one", "--hetu-runtime", "plan", nproc=1)
    got, want = step_losses(out), step_losses(one)
    assert sorted(got) == sorted(want) == list(range(1, 13)), (out[-3000:], one[-3000:])
    for step in got:
        assert abs(got[step] - want[step]) <= BF16_RTOL * abs(want[step]), (step, got, want)
    got_v, want_v = validation_losses(out), validation_losses(one)
    assert sorted(got_v) == sorted(want_v) == [4, 8, 12], (out[-3000:], one[-3000:])
    for it in got_v:
        assert abs(got_v[it] - want_v[it]) <= BF16_RTOL * abs(want_v[it]), (it, got_v, want_v)
