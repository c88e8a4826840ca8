"""Training sequences of a corpus of documents, and which of them each global batch holds (pure: numpy only).

A document of ``n`` tokens gives ``n - 1`` training positions (input token i predicts token i + 1). A document
with more positions than the maximum pack length ``max_len`` is split into consecutive *sequences* of ``max_len``
positions, the last one shorter; each sequence restarts its position ids and attends only to itself. Splitting
keeps every (input, label) pair exactly once; what a later piece loses is the attention to the earlier pieces.

Global batch ``g`` takes the next sequences of a stream: the sequences in a seeded random order, a new order each
epoch (as Megatron's GPTDataset shuffles documents). A batch is either a fixed count of sequences
(``--global-batch-size``) or as many sequences as fit in a token budget (``--hetu-global-batch-tokens``; at least
one). Batches are a pure function of (table, seed, definition, g): a resumed or re-planned run reads the same
sequences, none skipped or repeated.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .lengths import budget_end, split_long


@dataclass(frozen=True, eq=False)
class SequenceTable:
    """Every training sequence of a corpus: its document, first position in the document, and positions."""

    doc: np.ndarray
    """(N,) int64: the document each sequence comes from."""
    start: np.ndarray
    """(N,) int64: its first position (token offset) in the document."""
    length: np.ndarray
    """(N,) int64: its training positions (tokens of input), 1..max_len."""

    @classmethod
    def from_documents(cls, token_counts: np.ndarray, max_len: int) -> SequenceTable:
        """Cut documents of ``token_counts`` tokens into sequences of at most ``max_len`` positions; documents of
        fewer than 2 tokens have no training position and give none."""
        positions = np.asarray(token_counts, dtype=np.int64) - 1
        kept = np.flatnonzero(positions > 0)
        pieces = split_long(positions[kept], max_len)
        return cls(doc=kept[pieces.doc], start=pieces.offset, length=pieces.length)

    def __len__(self) -> int:
        return int(self.doc.size)


class GlobalBatches:
    """Global batch ``g`` -> the sequence ids it holds (``batches[g]``), by sequence count or token budget."""

    def __init__(self, table: SequenceTable, *, seed: int, samples: int | None = None,
                 tokens: int | None = None) -> None:
        if (samples is None) == (tokens is None):
            raise ValueError("define a global batch by a sequence count (--global-batch-size) or by a token "
                             "budget (--hetu-global-batch-tokens), exactly one of them")
        if len(table) == 0:
            raise ValueError("the corpus has no training sequence (every document has fewer than 2 tokens)")
        if samples is not None and samples < 1 or tokens is not None and tokens < 1:
            raise ValueError(f"a global batch needs >= 1 sequence or token, got samples={samples} tokens={tokens}")
        self.table, self.seed, self.samples, self.tokens = table, seed, samples, tokens
        self._order = np.zeros(0, dtype=np.int64)  # the stream: concatenated per-epoch permutations
        self._cum = np.zeros(1, dtype=np.int64)  # tokens before each stream position
        self._bounds = [0]  # stream position where each batch starts

    def __getitem__(self, g: int) -> np.ndarray:
        while len(self._bounds) <= g + 1:
            self._bounds.append(self._next_end(self._bounds[-1]))
        return self._order[self._bounds[g]:self._bounds[g + 1]]

    def consumed(self, g: int) -> int:
        """Sequences in batches ``0..g-1``."""
        self[max(g - 1, 0)]
        return self._bounds[g]

    def _next_end(self, begin: int) -> int:
        if self.samples is not None:
            self._ensure(begin + self.samples)
            return begin + self.samples
        while True:
            self._ensure(begin + 1)
            end = budget_end(self._cum, begin, self.tokens)
            if end < self._order.size:  # the budget ends inside the stream known so far
                return end
            self._ensure(self._order.size + 1)

    def _ensure(self, size: int) -> None:
        while self._order.size < size:
            epoch = self._order.size // len(self.table)
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.table))
            self._order = np.concatenate([self._order, order])
            self._cum = np.concatenate([self._cum, self._cum[-1] + np.cumsum(self.table.length[order])])
