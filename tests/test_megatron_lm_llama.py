"""Megatron-LM's own ``pretrain_gpt.py`` (the shared core_v0.16.1 checkout) with hetu checkpoints, on the models
users train: a Llama-style model (SwiGLU, RMSNorm, RoPE, GQA with 2 groups, no biases, untied output) and GPT
models whose vocabulary Megatron-LM pads differently under each TP degree.

What these catch (each failed on the code before the fix):

* the gated ``linear_fc1`` was in no checkpoint: a resume restarted it from its initialisation (iteration 4 off by
  ~6e-3 under the same TP);
* RoPE crashed on CPU inside Megatron-core's rotary embedding (``torch.cuda.current_device()``);
* a checkpoint saved under DP 2 (1,025 ids padded to 1,152 rows) did not load under TP 2 (1,280 rows), and the
  reverse loaded silently with a different softmax (128 more padding classes: loss 0.1 lower).

Tolerances: same layout bit-exact (losses as printed, every saved tensor equal); another layout the uniform
equivalence test's (relative 1e-6 on losses; weights 2e-6), over the vocabulary's real rows (padding rows carry
nothing: their logits are masked, hetu_ext.megatron.vocab).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from test_megatron_lm import COMMON, SCRIPT, assert_close, needs_checkout, step_losses, torchrun
from helpers import megatron_lm, WEIGHT_ATOL

from hetu_ext.checkpoint import LocalStorage
from hetu_ext.checkpoint.reader import ShardReader, read_manifest
from hetu_ext.megatron.vocab import VOCAB_KEYS

pytestmark = needs_checkout


def with_flags(base: list[str], **values: str) -> list[str]:
    """``base`` with the values of some flags replaced (``vocab_size="1024"`` -> ``--vocab-size 1024``)."""
    out = list(base)
    for name, value in values.items():
        out[out.index("--" + name.replace("_", "-")) + 1] = value
    return out


LLAMA = [*with_flags(COMMON, vocab_size="1024"), "--swiglu", "--normalization", "RMSNorm",
         "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--ffn-hidden-size", "96", "--position-embedding-type", "rope"]


def final_state(directory: Path, iteration: int = 6) -> tuple[dict, int]:
    """Every tensor of a hetu checkpoint (full), and the vocabulary size it records."""
    storage = LocalStorage(directory)
    manifest = read_manifest(storage, iteration)
    return ShardReader(storage, manifest).read_full(), manifest.state["vocab_size"]


def assert_same_state(got: Path, want: Path, *, exact: bool) -> None:
    """Parameters and Adam moments of two final checkpoints; vocabulary tensors over their real rows."""
    a, vocab = final_state(got)
    b, vocab_b = final_state(want)
    assert vocab == vocab_b
    assert sorted(a) == sorted(b)
    for tid in b:
        x, y = a[tid], b[tid]
        if tid[0].split("/", 1)[1] in VOCAB_KEYS and x.shape != y.shape:
            x, y = x[:vocab], y[:vocab]
        if exact:
            assert torch.equal(x, y), tid
        else:
            assert x.shape == y.shape and float((x - y).abs().max()) <= WEIGHT_ATOL, (tid, (x - y).abs().max())


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The uninterrupted run: TP 2, checkpoints at iterations 3 and 6."""
    tmp = tmp_path_factory.mktemp("llama")
    proc = torchrun(tmp, *LLAMA, "--tensor-model-parallel-size", "2", "--save", str(tmp / "ref"),
                    "--save-interval", "3", "--hetu-ckpt-format", "hetu")
    out = proc.stdout + proc.stderr
    notice = next((line for line in out.splitlines() if "CPU rehearsal (no CUDA device)" in line), "")
    assert "added" in notice and "--no-rope-fusion" in notice.split("added", 1)[1], out[-3000:]
    return tmp, step_losses(out)


def test_llama_resume_same_tp_is_bit_exact(llama):
    tmp, losses = llama
    proc = torchrun(tmp, *LLAMA, "--tensor-model-parallel-size", "2", "--load", str(tmp / "ref"), "--ckpt-step",
                    "3", "--save", str(tmp / "tp2"), "--save-interval", "3", "--hetu-ckpt-format", "hetu")
    resumed = step_losses(proc.stdout + proc.stderr)
    assert sorted(resumed) == [4, 5, 6]
    assert [resumed[i] for i in (4, 6)] == [losses[i] for i in (4, 6)]  # as printed (5: derived from two lines)
    assert_close(resumed, losses, [5])
    assert_same_state(tmp / "tp2", tmp / "ref", exact=True)


STRAGGLER = ("--hetu-straggler-interval", "1", "--hetu-straggler-window", "2", "--hetu-straggler-threshold", "2.0",
             "--hetu-emulate-slowdown", "step=4:rank=1:x=4", "--hetu-emulate-layer-ms", "10")
"""Rank 1 emulated 4x slower from step 4: the weighting moves microbatches off it (test_megatron_lm's launch C)."""


@pytest.mark.parametrize("nproc", [2, 1], ids=["dp2_straggler_weighted", "single_rank"])
def test_llama_resume_other_layout(llama, nproc):
    """TP 2 -> DP 2 and -> one rank: another vocabulary padding (1,280 -> 1,152 rows) and the gated fc1's
    halves regrouped. On DP 2 an emulated straggler is weighted too: the slow rank runs fewer microbatches and
    the losses and state stay the uninterrupted run's."""
    tmp, losses = llama
    out_dir = tmp / f"n{nproc}"
    proc = torchrun(tmp, *LLAMA, "--load", str(tmp / "ref"), "--ckpt-step", "3", "--save", str(out_dir),
                    "--save-interval", "3", "--hetu-ckpt-format", "hetu", *(STRAGGLER if nproc == 2 else ()),
                    nproc=nproc)
    out = proc.stdout + proc.stderr
    resumed = step_losses(out)
    assert sorted(resumed) == [4, 5, 6]
    assert_close(resumed, losses, [4, 5, 6])
    assert_same_state(out_dir, tmp / "ref", exact=False)
    if nproc == 2:
        counts = [tuple(map(int, m.split(", "))) for m in
                  re.findall(r"microbatches per data-parallel rank: ([0-9, ]+) \(were", out)]
        assert counts and counts[0][1] < counts[0][0], out[-3000:]


@pytest.fixture(scope="module")
def gpt_vocab(tmp_path_factory):
    """A GPT run on DP 2 with GPT-2's --vocab-size 50257 (NullTokenizer: 50,258 ids), checkpoints at 3 and 6. (One
    vocabulary: a second one, 1,025 ids, ran the same padding code at 3 more launches; the suite's time bound.)"""
    tmp = tmp_path_factory.mktemp("vocab50257")
    flags = with_flags(COMMON, vocab_size="50257")
    proc = torchrun(tmp, *flags, "--save", str(tmp / "ref"), "--save-interval", "3", "--hetu-ckpt-format", "hetu")
    return tmp, flags, step_losses(proc.stdout + proc.stderr)


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_padding_differs_by_tp(gpt_vocab, tp):
    """DP 2 -> TP 2 and TP 4: 50,258 ids pad to 50,304 / 50,432 / 50,688 rows."""
    tmp, flags, losses = gpt_vocab
    out_dir = tmp / f"tp{tp}"
    proc = torchrun(tmp, *flags, "--tensor-model-parallel-size", str(tp), "--load", str(tmp / "ref"),
                    "--ckpt-step", "3", "--save", str(out_dir), "--save-interval", "3", "--hetu-ckpt-format", "hetu",
                    nproc=tp)
    resumed = step_losses(proc.stdout + proc.stderr)
    assert sorted(resumed) == [4, 5, 6]
    assert_close(resumed, losses, [4, 5, 6])
    assert_same_state(out_dir, tmp / "ref", exact=False)


def test_changed_vocabulary_refused_in_one_line(llama, tmp_path):
    """A checkpoint of 1,025 ids loaded with --vocab-size 1031 (the same padded rows, 1,152): refused on rank 0 in
    one line naming both sizes, no traceback from the ranks."""
    tmp, _ = llama
    flags = LLAMA
    other = str(int(flags[flags.index("--vocab-size") + 1]) + 7)
    proc = megatron_lm(tmp_path, SCRIPT, *with_flags(flags, vocab_size=other), "--load", str(tmp / "ref"),
                       "--hetu-ckpt-format", "hetu", check=False)
    assert proc.returncode != 0
    errors = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "hetu_ext.megatron_lm: error:" in ln]
    saved = int(flags[flags.index("--vocab-size") + 1]) + 1
    assert len(errors) == 1 and f"vocabulary of {saved} ids, this run has {int(other) + 1}" in errors[0], errors
    ranks_tracebacks = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("[rank")
                        and "Traceback" in ln]  # torchrun's own report of the exit code may follow
    assert not ranks_tracebacks, (proc.stdout + proc.stderr)[-3000:]


def test_llama_packing_on_megatron_lm_equals_unpacked(tmp_path):
    """Hydraulis' packs on Megatron-LM's own loop (DP 2) with RoPE: Megatron-core's THD rotary path restarts
    positions at each document of a pack once pretrain_gpt.py's (1, n) cu_seqlens are flattened (the
    packing:get_thd_batch_on_this_cp_rank hook; without it the run crashes in _apply_rotary_pos_emb_thd), and the
    packed run equals one sequence per microbatch on one rank."""
    from test_megatron_lm import LENGTHS

    flags = [*with_flags(LLAMA, global_batch_size="16", train_iters="3"), "--hetu-varlen-mock", LENGTHS,
             "--hetu-mock-documents", "2000"]
    ref = torchrun(tmp_path, *flags, "--hetu-packing", "unpacked", nproc=1)
    packed = torchrun(tmp_path, *flags, "--hetu-packing", "balanced")
    assert_close(step_losses(packed.stdout + packed.stderr), step_losses(ref.stdout + ref.stderr), [1, 2, 3])


def test_llama_hetero_plan_handed_to_hetu_trainer(tmp_path):
    """--hetu-plan with the Llama flags: the same command line runs in hetu_ext's trainer (the hand-off takes
    --swiglu, --normalization, --position-embedding-type rope, GQA, --disable-bias-linear; --no-rope-fusion is
    implied) and trains. ``--sequence-parallel`` goes along; every stage of this plan has TP 1, so it is turned
    off with one notice, as Megatron-LM does, and the run goes on."""
    from test_megatron_lm import HETERO

    plan = tmp_path / "hetero.yaml"
    plan.write_text(HETERO)
    proc = torchrun(tmp_path, *with_flags(LLAMA, train_iters="4"), "--sequence-parallel", "--hetu-plan", str(plan))
    out = proc.stdout + proc.stderr
    assert "2 pipeline(s), 8 microbatches per global batch" in out, out[-3000:]
    assert out.count("--sequence-parallel has no effect at TP 1") == 1, out[-3000:]
    losses = step_losses(out)
    assert sorted(losses) == [1, 2, 3, 4] and losses[4] < losses[1], out[-3000:]
