"""Document lengths (in tokens): reading them, splitting long documents, forming global batches (pure: numpy).

Sources:

* a length file: one positive integer a line, plain text or gzip (``*.gz``), e.g. ``wikipedia.txt.gz``;
* Megatron's varlen mock-data JSON forms, as a JSON string or a dict::

      {"mode": "file", "path": "lengths.txt.gz"}
      {"mode": "distribution", "type": "lognormal", "min_seq_len": 64, "max_seq_len": 8192,
       "mean_seq_len": 1024, "lognormal_sigma": 1.2}

  The log-normal's ``mu`` is ``ln(mean_seq_len) - sigma^2 / 2`` so that the untruncated mean is
  ``mean_seq_len``; samples are rounded and clipped into ``[min_seq_len, max_seq_len]`` (so the realised mean is
  close to, not exactly, ``mean_seq_len``). Sampling is a pure function of the seed.

Splitting (:func:`split_long`): a document of ``L`` tokens longer than ``max_len`` becomes ``ceil(L / max_len)``
consecutive pieces of ``max_len`` tokens each, the last one ``L - (ceil(L / max_len) - 1) max_len`` tokens; each
piece is then a document of its own (it attends only to itself). :func:`concat_split` is Megatron's way instead:
concatenate all documents and cut every ``max_len`` tokens, so pieces straddle pack boundaries.

Global batches (:func:`batch_bounds`): consecutive documents of the stream, either a fixed count or as many as fit
in a token budget (at least one). Every document is in exactly one batch, in order: none skipped or repeated.
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hetu_ext.keys import check_keys


class LengthFileError(ValueError):
    """A length file that is missing, empty or malformed; the message names the file, the line and the fix."""


def read_lengths(path: str | Path) -> np.ndarray:
    """Token counts of a length file (one integer >= 1 a line; ``.gz`` is gunzipped) as an int64 array.

    Raises LengthFileError naming the file (and the line number and text of a bad line). A final newline is
    allowed; a blank line elsewhere is an error.
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError as exc:
        raise LengthFileError(f"length file {str(path)!r} does not exist; check the path (a text file with one "
                              "token count per line, optionally gzipped)") from exc
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise LengthFileError(f"length file {str(path)!r} cannot be read: {exc}; expected UTF-8 text or gzip "
                              "with one token count per line") from exc
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if not lines:
        raise LengthFileError(f"length file {str(path)!r} is empty; it needs one token count (an integer >= 1) "
                              "per line, one line per document")
    try:
        values = np.array([int(x) for x in lines], dtype=np.int64)
    except ValueError:
        values = None
    if values is None or values.min() < 1:
        for number, line in enumerate(lines, start=1):
            try:
                ok = int(line) >= 1
            except ValueError:
                ok = False
            if not ok:
                raise LengthFileError(f"length file {str(path)!r} line {number}: {line!r} is not an integer >= 1; "
                                      "each line must hold one document's token count") from None
    return values


@dataclass(frozen=True, kw_only=True)
class LognormalLengths:
    """Megatron's ``{"mode": "distribution", "type": "lognormal", ...}`` mock-data form."""

    min_seq_len: int
    """Shortest document, tokens (>= 1)."""
    max_seq_len: int
    """Longest document, tokens (>= min_seq_len)."""
    mean_seq_len: float
    """Mean of the untruncated log-normal, tokens (between min and max)."""
    lognormal_sigma: float
    """Standard deviation of ln(length) (> 0)."""

    def __post_init__(self) -> None:
        for name in ("min_seq_len", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"length distribution: {name} must be an integer >= 1, got {value!r}")
        if self.max_seq_len < self.min_seq_len:
            raise ValueError(f"length distribution: max_seq_len ({self.max_seq_len}) < min_seq_len "
                             f"({self.min_seq_len}); swap them")
        if not self.min_seq_len <= self.mean_seq_len <= self.max_seq_len:
            raise ValueError(f"length distribution: mean_seq_len ({self.mean_seq_len}) must lie in [min_seq_len, "
                             f"max_seq_len] = [{self.min_seq_len}, {self.max_seq_len}]")
        if isinstance(self.lognormal_sigma, bool) or not isinstance(self.lognormal_sigma, (int, float)) \
                or not self.lognormal_sigma > 0:
            raise ValueError(f"length distribution: lognormal_sigma must be > 0, got {self.lognormal_sigma!r}")

    def sample(self, count: int, seed: int) -> np.ndarray:
        """``count`` token counts, a pure function of ``seed`` (int64)."""
        mu = math.log(self.mean_seq_len) - self.lognormal_sigma ** 2 / 2
        raw = np.random.default_rng(seed).lognormal(mu, self.lognormal_sigma, size=count)
        return np.clip(np.rint(raw), self.min_seq_len, self.max_seq_len).astype(np.int64)


@dataclass(frozen=True, kw_only=True)
class FileLengths:
    """Megatron's ``{"mode": "file", "path": ...}`` mock-data form."""

    path: str
    """A length file (see :func:`read_lengths`)."""

    def sample(self, count: int | None = None, seed: int = 0) -> np.ndarray:
        """The file's lengths in file order (``count`` first ones if given; the seed is unused)."""
        values = read_lengths(self.path)
        return values if count is None else values[:count]


_FORMS = {"file": {"mode", "path"},
          "distribution": {"mode", "type", "min_seq_len", "max_seq_len", "mean_seq_len", "lognormal_sigma"}}


def parse_length_spec(spec: str | Mapping[str, Any]) -> FileLengths | LognormalLengths:
    """Parse a mock-data JSON form (string or mapping); unknown or missing keys are errors naming the allowed."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"length spec {spec!r} is not valid JSON: {exc}; expected e.g. "
                             '{"mode": "file", "path": "lengths.txt"}') from exc
    if not isinstance(spec, Mapping):
        raise TypeError(f"length spec: expected a JSON object, got {type(spec).__name__}")
    mode = spec.get("mode")
    if mode not in _FORMS:
        raise ValueError(f"length spec: 'mode' must be one of {sorted(_FORMS)}, got {mode!r}")
    allowed = _FORMS[mode]
    check_keys(spec, allowed, f"the length spec (mode {mode!r})", required=allowed)
    if mode == "file":
        return FileLengths(path=str(spec["path"]))
    if spec["type"] != "lognormal":
        raise ValueError(f"length spec: distribution type {spec['type']!r} is not supported; use 'lognormal'")
    return LognormalLengths(**{k: spec[k] for k in allowed - {"mode", "type"}})


@dataclass(frozen=True, eq=False)
class Pieces:
    """Documents after splitting: piece k is tokens ``[offset[k], offset[k] + length[k])`` of document doc[k]."""

    length: np.ndarray
    """(K,) int64 tokens of each piece, 1..max_len."""
    doc: np.ndarray
    """(K,) int64 index of the source document."""
    offset: np.ndarray
    """(K,) int64 first token of the piece within its document."""


def split_long(lengths: np.ndarray, max_len: int) -> Pieces:
    """Split every document longer than ``max_len`` into ``ceil(L / max_len)`` pieces (module docstring)."""
    s = _check_lengths(lengths, max_len)
    count = -(-s // max_len)
    doc = np.repeat(np.arange(s.size, dtype=np.int64), count)
    first = np.cumsum(count) - count
    offset = (np.arange(doc.size, dtype=np.int64) - first[doc]) * max_len
    return Pieces(length=np.minimum(s[doc] - offset, max_len), doc=doc, offset=offset)


def concat_split(lengths: np.ndarray, max_len: int) -> Pieces:
    """Megatron's packing: concatenate the documents and cut every ``max_len`` tokens; a document crossing a cut
    becomes two (or more) pieces. Consecutive pieces fill packs of exactly ``max_len`` tokens (the last may be
    short)."""
    s = _check_lengths(lengths, max_len)
    ends = np.cumsum(s)
    total = int(ends[-1]) if s.size else 0
    cuts = np.arange(max_len, total, max_len, dtype=np.int64)
    bounds = np.union1d(np.concatenate(([0], ends)), cuts)  # every document start/end and every cut
    starts, stops = bounds[:-1], bounds[1:]
    doc = np.searchsorted(ends, starts, side="right")
    doc_start = ends[doc] - s[doc]
    return Pieces(length=stops - starts, doc=doc.astype(np.int64), offset=starts - doc_start)


def _check_lengths(lengths: np.ndarray, max_len: int) -> np.ndarray:
    if isinstance(max_len, bool) or not isinstance(max_len, (int, np.integer)) or max_len < 1:
        raise ValueError(f"max_len must be an integer >= 1 token, got {max_len!r}")
    s = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if s.size and s.min() < 1:
        raise ValueError(f"document lengths must be >= 1 token, got {int(s.min())} at index {int(s.argmin())}")
    return s


def batch_bounds(lengths: np.ndarray, *, tokens: int | None = None, samples: int | None = None,
                 drop_last: bool = False) -> np.ndarray:
    """Boundaries ``b`` (int64, ``b[0] = 0``): global batch g is documents ``[b[g], b[g + 1])``.

    Exactly one definition: ``samples`` documents per batch, or ``tokens``: consecutive documents while their sum
    stays within the budget (a document longer than the budget forms a batch alone). The final batch, if it
    holds fewer documents (tokens) than the batch size, is kept unless ``drop_last``. Deterministic; every
    document in exactly one batch (dropped ones excepted).
    """
    if (tokens is None) == (samples is None):
        raise ValueError("a global batch is defined by a token budget or by a sample count: give exactly one of "
                         f"tokens= and samples=, got tokens={tokens!r}, samples={samples!r}")
    size = tokens if tokens is not None else samples
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
        raise ValueError(f"the global batch size must be an integer >= 1, got {size!r}")
    s = _check_lengths(lengths, 1 << 62)
    if samples is not None:
        bounds = np.minimum(np.arange(0, s.size + samples, samples, dtype=np.int64), s.size)
    else:
        cum = np.concatenate([[0], np.cumsum(s)])
        out = [0]
        while out[-1] < s.size:
            out.append(budget_end(cum, out[-1], tokens))
        bounds = np.array(out, dtype=np.int64)
    bounds = np.unique(bounds)
    if drop_last and bounds.size > 1:
        last = s[bounds[-2]:bounds[-1]]
        if (last.size if samples is not None else int(last.sum())) < size:
            bounds = bounds[:-1]
    return bounds


def budget_end(cum: np.ndarray, begin: int, tokens: int) -> int:
    """The token-budget rule of a global batch: it starts at item ``begin`` and takes the next items while their
    token sum stays within ``tokens``, at least one (an item longer than the budget is a batch alone). ``cum[i]``:
    tokens before item i (``cum[0] = 0``). Returns the end (exclusive); ``len(cum) - 1`` may mean that the budget
    is not used up by the items ``cum`` knows."""
    return max(begin + 1, int(np.searchsorted(cum, cum[begin] + tokens, side="right")) - 1)


def global_batch(lengths: np.ndarray, g: int, *, tokens: int | None = None, samples: int | None = None) -> range:
    """Document indices of global batch ``g`` (see :func:`batch_bounds`); IndexError past the last batch."""
    bounds = batch_bounds(lengths, tokens=tokens, samples=samples)
    if not 0 <= g < bounds.size - 1:
        raise IndexError(f"global batch {g} does not exist: the {len(lengths)} documents make {bounds.size - 1} "
                         "batches; use more documents or a smaller batch")
    return range(int(bounds[g]), int(bounds[g + 1]))
