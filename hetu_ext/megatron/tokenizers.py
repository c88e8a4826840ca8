"""Megatron-LM's file tokenizers, read from local files only (nothing is downloaded).

* ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR``: what Megatron-LM's ``_HuggingFaceTokenizer``
  builds, ``transformers.AutoTokenizer`` of a local directory (``tokenizer.json`` + ``tokenizer_config.json``);
  the vocabulary is ``len(tokenizer)`` (added tokens included), the end of document its EOS token, and a text's ids
  are the tokenizer's ``input_ids`` (its post-processor's special tokens included), as Megatron-LM's.
* ``--tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt``: GPT-2's byte-level BPE
  (Megatron-LM's ``_GPT2BPETokenizer``, its own port of OpenAI's encoder): the vocabulary is vocab.json's entries,
  the end of document ``<|endoftext|>``, no special token added to a text. Built here on the ``tokenizers``
  library's byte-level BPE (GPT-2's pre-tokenisation pattern and byte map); tests/test_recipe_flags.py checks its
  ids against Megatron-LM's own ``gpt2_tokenization.py`` from the checkout.
* ``--tokenizer-type Llama2Tokenizer --tokenizer-model FILE.model``: a SentencePiece model, as Megatron-LM's
  ``_Llama2Tokenizer``: the vocabulary is the model's piece count (no special token added to it), the end of
  document its EOS piece, and a text's ids are its pieces after the BOS id (Megatron-LM's ``tokenize`` for text
  completion: ``bos=True, eos=False``), so a document that ``preprocess_data --append-eod`` writes is
  ``[BOS] pieces [EOS]`` as Megatron-LM's tools/preprocess_data.py writes it. Its pad id is not used: Megatron-LM's
  has none and Megatron-core's datasets pad with -1 (the loss masked there). tests/test_tokenizers.py checks the
  ids against Megatron-LM's own class from the checkout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hetu_ext.data.tokenizer import FILE_TOKENIZER_TYPES as FILE_TOKENIZERS


@dataclass(frozen=True)
class FileTokenizer:
    """A tokenizer read from files: ``encode(text) -> ids``, ``decode(ids) -> text``, its vocabulary size (token
    ids, before padding) and its end-of-document id."""

    name: str
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    vocab_size: int
    eod: int


def tokenizer_files(data) -> dict:
    """The files of the run's tokenizer (``data``: the DataConfig), as :func:`open_file_tokenizer` takes them."""
    return {"tokenizer_model": data.tokenizer_model, "vocab_file": data.vocab_file, "merge_file": data.merge_file}


def open_file_tokenizer(tokenizer_type: str, *, tokenizer_model: str | None = None, vocab_file: str | None = None,
                        merge_file: str | None = None) -> FileTokenizer:
    """The tokenizer of ``--tokenizer-type`` from its files; ValueError (one line) naming a missing file or
    setting."""
    if tokenizer_type == "HuggingFaceTokenizer":
        return _huggingface(tokenizer_model)
    if tokenizer_type == "GPT2BPETokenizer":
        return _gpt2_bpe(vocab_file, merge_file)
    if tokenizer_type == "Llama2Tokenizer":
        return _llama2(tokenizer_model)
    raise ValueError(f"--tokenizer-type {tokenizer_type} is not read from files (file tokenizers: "
                     f"{', '.join(FILE_TOKENIZERS)})")


def _huggingface(path: str | None) -> FileTokenizer:
    if path is None or not Path(path).exists():
        raise ValueError(f"--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model DIR, a local directory "
                         f"with tokenizer.json and tokenizer_config.json (nothing is downloaded); got {path!r}")
    import transformers

    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--tokenizer-model {path}: not a Hugging Face tokenizer directory "
                         f"({str(exc).splitlines()[0]})") from exc
    if tok.eos_token_id is None:
        raise ValueError(f"--tokenizer-model {path}: the tokenizer has no EOS token, which Megatron-LM uses as the "
                         "end of document; set eos_token in its tokenizer_config.json")
    return FileTokenizer(name="HuggingFaceTokenizer", encode=lambda text: list(tok(text).input_ids),
                         decode=lambda ids: tok.decode(list(ids)), vocab_size=len(tok), eod=int(tok.eos_token_id))


def _gpt2_bpe(vocab_file: str | None, merge_file: str | None) -> FileTokenizer:
    for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
        if path is None or not Path(path).is_file():
            raise ValueError(f"--tokenizer-type GPT2BPETokenizer needs {flag} FILE (GPT-2's vocab.json and "
                             f"merges.txt, local files); got {flag} {path!r}")
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer.from_file(vocab_file, merge_file)
    vocab = bpe.get_vocab()
    if "<|endoftext|>" not in vocab:
        raise ValueError(f"--vocab-file {vocab_file} has no <|endoftext|>, GPT-2's end of document")
    return FileTokenizer(name="GPT2BPETokenizer", encode=lambda text: list(bpe.encode(text).ids),
                         decode=lambda ids: bpe.decode([int(i) for i in ids]), vocab_size=len(vocab),
                         eod=vocab["<|endoftext|>"])


def _llama2(model_file: str | None) -> FileTokenizer:
    if model_file is None or not Path(model_file).is_file():
        raise ValueError(f"--tokenizer-type Llama2Tokenizer needs --tokenizer-model FILE, a local SentencePiece "
                         f"model (tokenizer.model; nothing is downloaded); got {model_file!r}")
    try:
        import sentencepiece
    except ImportError:
        raise ValueError("--tokenizer-type Llama2Tokenizer reads its model with the sentencepiece package, which is "
                         "not installed: pip install sentencepiece (or hetu_ext[megatron])") from None
    try:
        sp = sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    except (OSError, RuntimeError) as exc:
        raise ValueError(f"--tokenizer-model {model_file}: not a SentencePiece model "
                         f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from exc
    bos, eos = sp.bos_id(), sp.eos_id()
    for name, value in (("BOS", bos), ("EOS", eos)):
        if value < 0:  # Megatron-LM's class would put -1 into every document
            raise ValueError(f"--tokenizer-model {model_file}: the SentencePiece model has no {name} piece "
                             f"({name.lower()}_id -1), which Megatron-LM's Llama2Tokenizer puts into every document; "
                             f"train it with {name.lower()}_id set")

    def encode(text: str) -> list[int]:
        return [bos, *sp.encode(text)]

    return FileTokenizer(name="Llama2Tokenizer", encode=encode, decode=lambda ids: sp.decode_ids([int(i) for i in ids]),
                         vocab_size=sp.get_piece_size(), eod=eos)
