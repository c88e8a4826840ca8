"""An offline tokenizer: UTF-8 bytes (ids 0-255) plus an end-of-document token (id 256).

Why bytes: it needs no vocabulary file and nothing downloaded, round-trips any text exactly, and its 257-entry
vocabulary keeps test and demo models small. The price is ~4x more tokens per text than a BPE vocabulary; for
real runs use a BPE tokenizer whose files are on local disk.
"""

from __future__ import annotations

import numpy as np


class ByteLevelTokenizer:
    """``--tokenizer-type ByteLevelTokenizer``."""

    name = "ByteLevelTokenizer"
    vocab_size = 257
    eod = 256
    pad = 256

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids) -> str:
        return bytes(int(i) for i in np.asarray(ids).ravel() if 0 <= int(i) < 256).decode("utf-8", errors="replace")


TOKENIZER_TYPES = ("ByteLevelTokenizer", "NullTokenizer")
"""``--tokenizer-type`` choices: both work offline."""
FILE_TOKENIZER_TYPES = ("HuggingFaceTokenizer", "GPT2BPETokenizer", "Llama2Tokenizer")
"""Tokenizers read from local files (hetu_ext.megatron.tokenizers); their vocabulary size is the one the launcher
read from the files (``--vocab-size`` after the launcher's check)."""
TOKENIZER_FILES: dict[str, tuple[str, ...]] = {"tokenizer_model": ("HuggingFaceTokenizer", "Llama2Tokenizer"),
                                               "vocab_file": ("GPT2BPETokenizer",),
                                               "merge_file": ("GPT2BPETokenizer",)}
"""Each tokenizer file setting and the ``--tokenizer-type`` values that read it (as Megatron-LM's)."""


def check_tokenizer_files(tokenizer_type: str, files: dict[str, str | None]) -> None:
    """ValueError (one line) for a file given to a tokenizer that does not read it (``files``: setting name ->
    path or None, the keys of :data:`TOKENIZER_FILES`); a missing file is the tokenizer's own check."""
    for name, path in files.items():
        readers = TOKENIZER_FILES[name]
        if path is not None and tokenizer_type not in readers:
            raise ValueError(f"--{name.replace('_', '-')} is read by --tokenizer-type {' or '.join(readers)}, not "
                             f"{tokenizer_type}; give --tokenizer-type {readers[0]} or drop it")


def tokenizer_vocab_size(tokenizer_type: str, vocab_size: int | None = None) -> int:
    """The vocabulary size (before padding) the tokenizer gives the model, in token ids: 257 for
    ByteLevelTokenizer; ``vocab_size + 1`` for NullTokenizer (Megatron-LM's: ids 0..vocab_size-1, EOD = vocab_size)."""
    if tokenizer_type == "ByteLevelTokenizer":
        return ByteLevelTokenizer.vocab_size
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None or vocab_size < 1:
            raise ValueError(f"--tokenizer-type NullTokenizer needs --vocab-size >= 1, got {vocab_size!r}")
        return vocab_size + 1
    if tokenizer_type in FILE_TOKENIZER_TYPES:
        if vocab_size is None or vocab_size < 1:
            raise ValueError(f"--tokenizer-type {tokenizer_type}: the vocabulary size read from its files is "
                             f"unknown here (got {vocab_size!r}); the launcher sets --vocab-size from them")
        return vocab_size
    raise ValueError(f"--tokenizer-type must be one of {list(TOKENIZER_TYPES)}, got {tokenizer_type!r}")
