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
