"""Megatron-LM's file tokenizers from local files (issue 45): Llama2Tokenizer (a SentencePiece model, the Mixtral
example's ``--tokenizer-type Llama2Tokenizer --tokenizer-model PATH``) gives the ids of Megatron-LM's own class, the
launcher, the hand-off, preprocess_data, the DeepSpeed path and LoRA read the files, and bad input is one line.

Nothing is downloaded: a tiny SentencePiece model (200 pieces, BPE, Llama's special ids unk 0 / bos 1 / eos 2 and
no pad) is trained here once per session on generated text; GPT-2's vocab.json / merges.txt are made with the
tokenizers library.
"""

from __future__ import annotations

import ast
import json
import os
import random
import subprocess
import sys

import pytest
from helpers import LAUNCH, megatron_lm, ROOT

CHECKOUT = ROOT.parent / "shared" / "thirdparty" / "Megatron-LM-core_v0.16.1"
TOKENIZER_PY = CHECKOUT / "megatron" / "training" / "tokenizer" / "tokenizer.py"
UNSEEN = ["", "Zürich ß 東京 \n\n  spaces", "123 456, tab\tend!"]
"""Texts with pieces the model never saw (unknown characters, digits, whitespace runs) and the empty text."""


def _corpus(seed: int = 0, lines: int = 400) -> list[str]:
    """Sentences of made-up words from a few syllables, so that BPE finds merges of several lengths."""
    rng = random.Random(seed)
    syllables = ["ka", "to", "ri", "mu", "sen", "te", "pi", "ece", "lo", "gra", "ma", "tron", "qu", "ick", "bro", "wn"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(120)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 40))) + rng.choice(".,!?") for _ in range(lines)]


def _train_sentencepiece(directory, name: str, **options) -> str:
    import sentencepiece

    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(_corpus()), model_prefix=str(directory / name),
                                             vocab_size=200, model_type="bpe", minloglevel=2, **options)
    return str(directory / f"{name}.model")


@pytest.fixture(scope="session")
def llama2_model(tmp_path_factory) -> str:
    """A SentencePiece model with Llama's special ids (SentencePiece's defaults: unk 0, bos 1, eos 2, pad -1)."""
    return _train_sentencepiece(tmp_path_factory.mktemp("sentencepiece"), "tokenizer")


@pytest.fixture(scope="session")
def gpt2_files(tmp_path_factory) -> dict[str, str]:
    """GPT-2-style vocab.json + merges.txt (300 ids, <|endoftext|> among them)."""
    from tokenizers import ByteLevelBPETokenizer

    out = tmp_path_factory.mktemp("gpt2_bpe")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(_corpus(), vocab_size=300, min_frequency=1, special_tokens=["<|endoftext|>"])
    bpe.save_model(str(out))
    return {"vocab_file": str(out / "vocab.json"), "merge_file": str(out / "merges.txt")}


def _megatron_llama2_tokenizer(model_file: str):
    """Megatron-LM's own ``_Llama2Tokenizer`` (and its base ``_SentencePieceTokenizer``), the class definitions
    taken from the checkout's tokenizer.py as they are and run here (importing the module would pull in
    megatron.training): the reference of Llama2Tokenizer."""
    from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer

    if not TOKENIZER_PY.is_file():
        pytest.skip(f"no Megatron-LM checkout at {CHECKOUT}")
    tree = ast.parse(TOKENIZER_PY.read_text())
    classes = [node for node in tree.body
               if isinstance(node, ast.ClassDef) and node.name in ("_SentencePieceTokenizer", "_Llama2Tokenizer")]
    assert len(classes) == 2, "Megatron-LM's tokenizer.py changed: no _SentencePieceTokenizer/_Llama2Tokenizer"
    namespace = {"MegatronLegacyTokenizer": MegatronLegacyTokenizer, "__name__": "megatron_lm_tokenizer"}
    exec(compile(ast.Module(body=classes, type_ignores=[]), str(TOKENIZER_PY), "exec"), namespace)  # noqa: S102
    return namespace["_Llama2Tokenizer"](model_file)


# --- the ids -----------------------------------------------------------------------------------------------------


def test_llama2_tokenizer_is_megatron_lms(llama2_model):
    """The same ids as Megatron-LM's class (BOS first, no EOS: its ``tokenize(bos=True, eos=False)``), the same
    text back, vocabulary (the piece count) and end of document (EOS); through make_tokenizer, the object
    Megatron-core's datasets are given, too. Catches a missing or doubled BOS, an EOS appended by the tokenizer
    (then --append-eod would give two) and a vocabulary counted with added special tokens."""
    from hetu_ext.megatron.data import make_tokenizer
    from hetu_ext.megatron.tokenizers import open_file_tokenizer

    ours = open_file_tokenizer("Llama2Tokenizer", tokenizer_model=llama2_model)
    theirs = _megatron_llama2_tokenizer(llama2_model)
    megatron_side = make_tokenizer("Llama2Tokenizer", files={"tokenizer_model": llama2_model})
    for text in [*_corpus(seed=1, lines=5), *UNSEEN]:
        ids = theirs.tokenize(text)
        assert ours.encode(text) == ids and list(megatron_side.tokenize(text)) == ids, text
        assert ours.decode(ids) == theirs.detokenize(ids) == megatron_side.detokenize(ids)
    sample = _corpus(seed=1, lines=1)[0]
    assert ours.decode(ours.encode(sample)) == sample
    assert ours.vocab_size == theirs.vocab_size == megatron_side.vocab_size == 200
    assert ours.eod == theirs.eod == megatron_side.eod == theirs.eos_id == 2
    assert ours.encode("")[0] == theirs.bos_id == 1


@pytest.mark.parametrize("missing", ["bos", "eos"])
def test_llama2_model_without_bos_or_eos_is_refused(tmp_path, missing):
    """Megatron-LM's class would write -1 into every document; ours names the missing piece in one line."""
    from hetu_ext.megatron.tokenizers import open_file_tokenizer

    model = _train_sentencepiece(tmp_path, missing, **{f"{missing}_id": -1})
    with pytest.raises(ValueError) as err:
        open_file_tokenizer("Llama2Tokenizer", tokenizer_model=model)
    assert f"no {missing.upper()} piece" in str(err.value) and "\n" not in str(err.value)


# --- the launcher and the hand-off ---------------------------------------------------------------------------------
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
         "--log-interval", "1", "--hidden-dropout", "0", "--attention-dropout", "0"]


def _config(*flags: str):
    from hetu_ext.cli.args import parse_run_config

    return parse_run_config([*MODEL, "--train-iters", "1", "--mock-data", *flags])


def test_launcher_reads_the_vocabulary_of_the_model(llama2_model):
    config = _config("--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", llama2_model)
    assert config.data.vocab_size == 200 and config.data.tokenizer_model == llama2_model


@pytest.mark.parametrize("flags, needle", [
    (["--tokenizer-type", "Llama2Tokenizer"], "needs --tokenizer-model FILE"),
    (["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", "/no/such/tokenizer.model"], "nothing is downloaded"),
    (["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", str(LAUNCH)], "not a SentencePiece model"),
    (["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", "M", "--vocab-file", "v.json"],
     "--vocab-file is read by --tokenizer-type GPT2BPETokenizer, not Llama2Tokenizer"),
    (["--tokenizer-type", "GPT2BPETokenizer", "--tokenizer-model", "M"],
     "read by --tokenizer-type HuggingFaceTokenizer or Llama2Tokenizer"),
])
def test_llama2_bad_input_is_one_line(flags, needle):
    with pytest.raises(ValueError) as err:
        _config(*flags)
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_vocab_size_other_than_the_model_is_refused(llama2_model):
    with pytest.raises(ValueError, match="differs from the 200 ids"):
        _config("--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", llama2_model, "--vocab-size", "256")


def test_handoff_passes_the_mixtral_tokenizer_flags_on(llama2_model, tmp_path):
    """``python -m hetu_ext.megatron_lm pretrain_gpt.py <flags> --hetu-plan`` with the Mixtral example's tokenizer
    flags: nothing refused, and the trainer's settings read the model (a refusal here was the old behaviour)."""
    from hetu_ext.cli.args import parse_run_config
    from hetu_ext.megatron_lm.flags import parse_invocation
    from hetu_ext.megatron_lm.handoff import translate

    script = tmp_path / "pretrain_gpt.py"
    script.write_text("")
    plan = tmp_path / "plan.yaml"
    plan.write_text("pipelines:\n  - num_microbatches: 2\n    stages:\n      - {ranks: [0], layers: [0, 2]}\n")
    flags = [*MODEL, "--train-iters", "1", "--mock-data", "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model",
             llama2_model]
    argv = translate(parse_invocation([str(script), *flags, "--hetu-plan", str(plan)]))
    config = parse_run_config(argv)
    assert config.data.tokenizer_type == "Llama2Tokenizer" and config.data.vocab_size == 200


# --- preprocess_data ---------------------------------------------------------------------------------------------


def _jsonl(path, texts: list[str]) -> str:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


def _documents(prefix: str) -> list[list[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    return [[int(i) for i in dataset[k]] for k in range(len(dataset))]


def _preprocess(tmp_path, flags: list[str], texts: list[str]) -> str:
    from hetu_ext.megatron.preprocess_data import main

    source = _jsonl(tmp_path / "docs.jsonl", texts)
    assert main(["--input", source, "--output-prefix", str(tmp_path / "out" / "docs"), "--append-eod", *flags]) == 0
    return str(tmp_path / "out" / "docs_text_document")


def test_preprocess_data_writes_megatron_lms_llama2_documents(llama2_model, tmp_path):
    """Each document is what Megatron-LM's tools/preprocess_data.py writes with --append-eod: its tokenizer's
    ``tokenize`` (BOS + pieces), then ``eod`` (EOS)."""
    texts = _corpus(seed=2, lines=6)
    prefix = _preprocess(tmp_path, ["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", llama2_model], texts)
    theirs = _megatron_llama2_tokenizer(llama2_model)
    assert _documents(prefix) == [theirs.tokenize(t) + [theirs.eod] for t in texts]


def test_preprocess_data_takes_gpt2_vocab_and_merges(gpt2_files, tmp_path):
    from hetu_ext.megatron.tokenizers import open_file_tokenizer

    texts = _corpus(seed=3, lines=4)
    prefix = _preprocess(tmp_path, ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", gpt2_files["vocab_file"],
                                    "--merge-file", gpt2_files["merge_file"]], texts)
    bpe = open_file_tokenizer("GPT2BPETokenizer", **gpt2_files)  # its ids are checked in test_recipe_flags
    assert _documents(prefix) == [bpe.encode(t) + [bpe.eod] for t in texts]


@pytest.mark.parametrize("flags, needle", [
    (["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", "/no/tokenizer.model"], "--tokenizer-model FILE"),
    (["--tokenizer-type", "Llama2Tokenizer", "--vocab-file", "v.json"], "--vocab-file is read by"),
    (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "/no/vocab.json"], "--vocab-file"),
])
def test_preprocess_data_bad_tokenizer_is_one_line(tmp_path, capsys, flags, needle):
    from hetu_ext.megatron.preprocess_data import main

    source = _jsonl(tmp_path / "docs.jsonl", ["a text"])
    assert main(["--input", source, "--output-prefix", str(tmp_path / "docs"), *flags]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 1 and errors[0].startswith("error:") and needle in errors[0], errors


# --- training: the launcher (e2e), the DeepSpeed path and LoRA ---------------------------------------------------


@pytest.fixture(scope="module")
def llama2_dataset(llama2_model, tmp_path_factory) -> str:
    """400 documents tokenized with the model (preprocess_data), the prefix for --data-path."""
    return _preprocess(tmp_path_factory.mktemp("llama2_data"),
                       ["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", llama2_model], _corpus())


def test_mixtral_tokenizer_flags_train_through_the_launcher(llama2_model, llama2_dataset):
    """The Mixtral example's ``--tokenizer-type Llama2Tokenizer --tokenizer-model PATH --data-path`` (MoE and
    sizes dropped, its split made 90,8,2 so that the 400 documents leave its validation split a few: 99990,8,2
    leaves none) train 3 steps on 2 ranks through launch/pretrain_gpt.py; the model's vocabulary is the
    tokenizer's 200 ids (a first loss near ln 200 = 5.3, not ln 257 of the byte tokenizer)."""
    import re

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(LAUNCH), "--nproc-per-node", "2", *MODEL, "--train-iters", "3",
                           "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", llama2_model,
                           "--data-path", llama2_dataset, "--split", "90,8,2", "--eval-interval", "1000",
                           "--eval-iters", "1"], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    losses = [float(x) for x in re.findall(r"iteration\s+\d+/\s*3 \|.*?lm loss: ([0-9.E+-]+) \|", out)]
    assert len(losses) == 3 and abs(losses[0] - 5.3) < 0.3, out[-3000:]


def test_mixtral_tokenizer_flags_train_on_megatron_lms_loop(llama2_model, llama2_dataset, tmp_path):
    """The same flags on Megatron-LM's own loop (``torchrun -m hetu_ext.megatron_lm pretrain_gpt.py``, 1 rank): its
    own _Llama2Tokenizer reads the model (sentencepiece, from the megatron-lm extra) and pads its 200 ids to 256,
    and it trains on the data preprocess_data wrote."""
    import re

    script = CHECKOUT / "pretrain_gpt.py"
    if not script.is_file():
        pytest.skip(f"no Megatron-LM checkout at {CHECKOUT}")
    proc = megatron_lm(tmp_path, script, *MODEL, "--train-iters", "2", "--eval-iters", "0", "--eval-interval", "1000",
                       "--transformer-impl", "local", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
                       "--distributed-backend", "gloo", "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model",
                       llama2_model, "--data-path", llama2_dataset, "--split", "90,8,2", nproc=1)
    out = proc.stdout + proc.stderr
    assert "padded vocab (size: 200) with 56 dummy tokens (new size: 256)" in out, out[-3000:]
    assert len(re.findall(r"iteration\s+\d+/\s*2 \|.*?lm loss: ([0-9.E+-]+) \|", out)) == 2, out[-3000:]


def deepspeed_body(rank: int, world: int, argv: list[str]) -> dict:
    """The DeepSpeed path (hetu_ext.deepspeed.engine.build) from the flags: its embedding rows and losses."""
    from hetu_ext.cli.args import build_parser, validate_args
    from hetu_ext.config import from_namespace
    from hetu_ext.deepspeed.engine import ZeroConfig, add_deepspeed_args, build

    args = add_deepspeed_args(build_parser()).parse_args(argv)
    validate_args(args)
    run = build(from_namespace(args), ZeroConfig(stage=1))
    rows = next(p.shape[0] for n, p in run.engine.module.named_parameters() if "word_embeddings" in n)
    return {"losses": run.train(), "rows": rows}


def test_deepspeed_path_reads_the_tokenizer_files(llama2_model, llama2_dataset):
    """The DeepSpeed path built its tokenizer without the files (a run with a file tokenizer stopped with 'needs
    --tokenizer-model', the flag it had been given): now it trains on the model's vocabulary."""
    from hetu_ext.testing.multiproc import run_ranks

    argv = [*MODEL, "--train-iters", "2", "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", llama2_model,
            "--data-path", llama2_dataset, "--split", "100,0,0", "--eval-iters", "0"]
    out = run_ranks(deepspeed_body, 1, argv, timeout=240)[0]
    assert out["rows"] == 256 and len(out["losses"]) == 2  # 200 ids padded to a multiple of 128


def test_lora_tenants_read_the_tokenizer_files(llama2_model, llama2_dataset, tmp_path):
    """LoRA's trainer built its tokenizer without the files (the same stop as the DeepSpeed path): now a tenant
    whose data was tokenized with the model trains on its vocabulary."""
    from hetu_ext.cli.runs import train
    from hetu_ext.testing.multiproc import run_ranks

    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(f"tenants:\n  - name: chat\n    data_path: {llama2_dataset}\n    samples: 2\n"
                       "    lora: {rank: 4, alpha: 8, targets: [qkv]}\n")
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--tokenizer-type", "Llama2Tokenizer",
            "--tokenizer-model", llama2_model, "--hetu-lora-tenants", str(tenants)]
    out = run_ranks(train, 1, argv, timeout=240)[0]
    assert out["weights"]["embedding.word_embeddings.weight"].shape[0] == 256 and len(out["losses"]) == 1
