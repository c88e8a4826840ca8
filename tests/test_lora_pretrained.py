"""LobRA over a pretrained base: ``--pretrained-checkpoint DIR`` fills the frozen base from a pretraining run.

A tiny GPT is pretrained for 2 steps on 2 ranks (TP 2) by the plain trainer with ``--save``; then 3 tenants are
fine-tuned on the 3-rank heterogeneous plan of test_lobra_training (a TP 1 pipeline and a TP 2 pipeline: another
layout than the pretraining's, so the base is resharded) with ``--pretrained-checkpoint``. The base after
loading equals the pretrained checkpoint's weights bit for bit (gathered), stays so through the fine-tuning
steps, and differs from the seed-initialised base (the pretraining run's initial weights: the same seed, and
hetu_ext's initialisation is layout-independent), so the test fails if the flag did nothing. The adapters
checkpoint records its base; resuming it on another base, giving a folder without a checkpoint, or a checkpoint
of another model shape is one error line, exit 2.
"""

from __future__ import annotations

import pytest
import torch
from test_lobra_training import HETERO, MOVED, TENANTS, _argv, _tenants_file
from helpers import assert_one_error_line, run

from hetu_ext.testing.multiproc import run_ranks

PRETRAIN = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
            "--seq-length", "64", "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "2",
            "--lr", "1e-2", "--lr-decay-style", "constant", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--seed", "11", "--mock-data", "--tensor-model-parallel-size", "2"]
"""The tenants' model (test_lobra_training's _argv: same shape and seed) pretrained with Megatron's mock data."""


def pretrain_body(rank: int, world_size: int, argv: list[str]) -> dict | None:
    from hetu_ext.cli.args import parse_run_config
    from hetu_ext.cli.train import build_run
    from hetu_ext.megatron.weights import gather_weights

    trainer = build_run(parse_run_config(argv))
    initial = gather_weights(trainer.model, **trainer.placement.shard_kwargs)
    trainer.train(log=lambda line: None)
    return {"initial": initial} if rank == 0 else None


def finetune_body(rank: int, world_size: int, argv: list[str]) -> dict | None:
    """The base (gathered) right after building, and after training; the keys of this rank's base shards."""
    from hetu_ext.cli.args import parse_run_config
    from hetu_ext.cli.train import build_run
    from hetu_ext.megatron.weights import gather_weights, local_shards

    trainer = build_run(parse_run_config(argv))
    kwargs = trainer.placement.shard_kwargs
    loaded = gather_weights(trainer.model, **kwargs)
    keys = sorted({s.key for s in local_shards(trainer.model, **kwargs)})
    trainer.train(log=lambda line: None)
    after = gather_weights(trainer.model, **kwargs)
    everyone = [None] * world_size
    torch.distributed.all_gather_object(everyone, keys)
    if rank != trainer.log_rank:
        return None
    return {"loaded": loaded, "after": after, "keys": everyone, "base": trainer.plugin.base,
            "losses": list(trainer.losses)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lobra_pretrained")
    pre = tmp / "pretrained"
    pretrained = next(r for r in run_ranks(pretrain_body, 2, PRETRAIN + ["--save", str(pre)], timeout=300)
                      if r is not None)
    (tmp / "hetero.yaml").write_text(HETERO)
    tenants = _tenants_file(tmp / "tenants.yaml", TENANTS)
    argv = _argv(tenants, "--hetu-plan", str(tmp / "hetero.yaml"), "--train-iters", "2",
                 "--pretrained-checkpoint", str(pre), "--save", str(tmp / "adapters"))
    tuned = next(r for r in run_ranks(finetune_body, 3, argv, timeout=300) if r is not None)
    return {"pretrained": pretrained, "tuned": tuned, "pre": str(pre), "tenants": tenants, "tmp": tmp,
            "adapters": str(tmp / "adapters")}


def test_pretrained_base_moves_in_a_bf16_sharded_migration(runs):
    """--bf16 --use-distributed-optimizer with a scheduled migration after step 1: the optimizer keeps no master
    of the frozen base, so its bf16 weights themselves must move (from every holder) with the adapters' owned
    state; the base after training equals the base right after loading, bit for bit (a base left behind would be
    the seed's initialisation, which differs from the pretrained one: test_base_is_the_pretrained_..._bit)."""
    tmp = runs["tmp"]
    (tmp / "moved.yaml").write_text(MOVED)
    argv = _argv(runs["tenants"], "--hetu-plan", str(tmp / "hetero.yaml"), "--train-iters", "2", "--bf16",
                 "--use-distributed-optimizer", "--pretrained-checkpoint", runs["pre"],
                 "--hetu-migrate", f"step=1:plan={tmp / 'moved.yaml'}")
    moved = next(r for r in run_ranks(finetune_body, 3, argv, timeout=300) if r is not None)
    assert moved["loaded"].keys() == moved["after"].keys()
    for key, value in moved["loaded"].items():
        assert torch.equal(value, value.bfloat16().float()), key  # the run's base really is bf16
        assert torch.equal(moved["after"][key], value), key


def test_base_is_the_pretrained_checkpoint_bit_for_bit(runs):
    from hetu_ext.checkpoint import LocalStorage
    from hetu_ext.checkpoint.reader import read_manifest

    manifest = read_manifest(LocalStorage(runs["pre"]), 2)
    stored = _stored_base(runs["pre"])
    tuned, initial = runs["tuned"], runs["pretrained"]["initial"]
    assert tuned["loaded"].keys() == initial.keys() == stored.keys()
    assert all(".lora_" not in k for rank_keys in tuned["keys"] for k in rank_keys), "adapters in the base's shards"
    for key, want in stored.items():
        assert torch.equal(tuned["loaded"][key], want), key
        assert torch.equal(tuned["after"][key], want), f"{key} moved during fine-tuning"
    moved = [k for k in initial if not torch.equal(initial[k], tuned["loaded"][k])]
    assert sorted(moved) == sorted(initial), f"equal to the seed-initialised base: {sorted(set(initial) - set(moved))}"
    base = tuned["base"]
    assert (base["kind"], base["run_id"], base["iteration"]) == ("pretrained", manifest.run_id, 2), base
    assert all(loss == loss for loss in tuned["losses"])


def _stored_base(directory: str) -> dict[str, torch.Tensor]:
    """The pretrained checkpoint's model weights, full tensors by key (layers stacked), read in this process."""
    from hetu_ext.checkpoint import LocalStorage
    from hetu_ext.checkpoint.reader import ShardReader, read_manifest

    manifest = read_manifest(LocalStorage(directory), 2)
    full = ShardReader(LocalStorage(directory), manifest).read_full(
        [t.name for t in manifest.tensors if t.name.startswith("param/")])
    parts: dict[str, list] = {}
    for (name, index), value in full.items():
        parts.setdefault(name.split("/", 1)[1], []).append((index, value))
    return {k: v[0][1] if v[0][0] == () else torch.stack([t for _, t in sorted(v, key=lambda p: p[0])])
            for k, v in parts.items()}


def test_resume_on_the_same_base(runs):
    """--load (the adapters, resharded into 2 ranks) with the same --pretrained-checkpoint: the base is the
    pretrained one again, the adapters' run goes on from iteration 2."""
    argv = _argv(runs["tenants"], "--train-iters", "3", "--load", runs["adapters"],
                 "--pretrained-checkpoint", runs["pre"])
    resumed = next(r for r in run_ranks(finetune_body, 2, argv, timeout=300) if r is not None)
    want = _stored_base(runs["pre"])
    assert resumed["loaded"].keys() == want.keys()
    assert all(torch.equal(resumed["loaded"][k], v) and torch.equal(resumed["after"][k], v) for k, v in want.items())
    assert resumed["base"]["run_id"] == runs["tuned"]["base"]["run_id"] is not None
    assert len(resumed["losses"]) == 3 and resumed["losses"][:2] == runs["tuned"]["losses"]


def test_resume_on_another_base_refused_exit_2(runs):
    """The adapters were trained on the pretrained base: resuming them on the seed's base is one line, exit 2,
    before any rank starts; on the same base the check passes."""
    from hetu_ext.cli.args import parse_run_config

    argv = _argv(runs["tenants"], "--train-iters", "4", "--load", runs["adapters"])
    proc = run(argv + ["--nproc-per-node", "3"])
    assert_one_error_line(proc, f"--load {runs['adapters']} (iteration 2) holds adapters trained on the pretrained "
                                f"checkpoint")
    assert "this run's base is the base initialised from seed 11" in proc.stderr
    parse_run_config(argv + ["--pretrained-checkpoint", runs["pre"]])  # the same base: accepted


def test_other_vocabulary_refused_in_the_rank_exit_2(runs):
    """A mismatch only the built model shows (the padded vocabulary: 128 here, 384 in the checkpoint), raised
    inside load_pieces (where all ranks agree on it): one error line through the launcher (1 rank, to keep the
    test short; 2 ranks checked by hand), exit 2."""
    proc = run(_argv(runs["tenants"], "--train-iters", "1", "--pretrained-checkpoint", runs["pre"],
                     "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"))
    assert_one_error_line(proc, f"--pretrained-checkpoint {runs['pre']} (iteration 2): "
                                "param/embedding.word_embeddings.weight is [384, 32] there, [128, 32] in this model")


@pytest.mark.parametrize("case", ["empty", "shape", "adapters", "no_tenants"])
def test_bad_pretrained_checkpoint_is_one_line(runs, tmp_path, case):
    """A folder without a committed checkpoint, a checkpoint of another model shape, an adapters checkpoint, or
    the flag without tenants: one-line ValueError (what the launcher prints as its one error line, exit 2)."""
    from hetu_ext.cli.args import parse_run_config

    argv, needle = {
        "empty": (_argv(runs["tenants"], "--pretrained-checkpoint", str(tmp_path)),
                  f"--pretrained-checkpoint {tmp_path}: holds no committed checkpoint"),
        "shape": (_argv(runs["tenants"], "--pretrained-checkpoint", runs["pre"], "--ffn-hidden-size", "96"),
                  "holds a model with --ffn-hidden-size 64, this run has 96"),
        "adapters": (_argv(runs["tenants"], "--pretrained-checkpoint", runs["adapters"]),
                     "is a LoRA adapters checkpoint (no base weights)"),
        "no_tenants": (PRETRAIN + ["--pretrained-checkpoint", runs["pre"]],
                       "--pretrained-checkpoint is supported with --hetu-lora-tenants; use --load to resume a run"),
    }[case]
    with pytest.raises(ValueError) as info:
        parse_run_config(argv)
    assert needle in str(info.value) and "\n" not in str(info.value), str(info.value)
