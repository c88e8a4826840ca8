"""jsonl -> Megatron indexed dataset (.bin/.idx), like Megatron-LM's tools/preprocess_data.py, offline.

    python -m hetu_ext.megatron.preprocess_data --input docs.jsonl --output-prefix data/docs \\
        --tokenizer-type ByteLevelTokenizer --append-eod

writes ``data/docs_text_document.bin`` and ``.idx`` (one document per jsonl line), the prefix to pass as
``--data-path data/docs_text_document``. Files are written under temporary names and renamed only when complete.
A user's own tokenizer is read from local files with Megatron-LM's flags: ``--tokenizer-type Llama2Tokenizer
--tokenizer-model tokenizer.model`` (each document is BOS, its pieces, then EOS with --append-eod, as Megatron-LM's
tools/preprocess_data.py writes it), ``--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR``,
``--tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt``; train with the same flags.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from hetu_ext.data.tokenizer import FILE_TOKENIZER_TYPES, TOKENIZER_FILES, TOKENIZER_TYPES, check_tokenizer_files
from hetu_ext.hostlog import quiet_host_frameworks

from .data import make_tokenizer


def preprocess(input_path: str, output_prefix: str, *, tokenizer_type: str = "ByteLevelTokenizer",
               json_key: str = "text", append_eod: bool = True, vocab_size: int | None = None,
               files: dict[str, str | None] | None = None) -> tuple[str, int]:
    """Tokenize every line's ``json_key`` into one document; return (dataset prefix, document count). ``files``:
    a file tokenizer's ``tokenizer_model`` / ``vocab_file`` / ``merge_file``."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path

    tokenizer = make_tokenizer(tokenizer_type, vocab_size, files)
    prefix = f"{output_prefix}_{json_key}_document"
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{prefix}.tmp{os.getpid()}"
    dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.int32
    builder = IndexedDatasetBuilder(get_bin_path(tmp), dtype=dtype)
    count = 0
    try:
        with open(input_path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)[json_key]
                except (json.JSONDecodeError, KeyError, TypeError) as exc:
                    raise ValueError(f"{input_path}:{lineno}: each line must be a JSON object with a string "
                                     f"{json_key!r} (--json-keys); {type(exc).__name__}: {exc}") from exc
                ids = list(tokenizer.tokenize(text)) + ([tokenizer.eod] if append_eod else [])
                if ids:
                    builder.add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)])
                    count += 1
        if count == 0:
            raise ValueError(f"{input_path}: no documents found; the file needs one JSON object per line")
        builder.finalize(get_idx_path(tmp))
        os.replace(get_bin_path(tmp), get_bin_path(prefix))
        os.replace(get_idx_path(tmp), get_idx_path(prefix))
    finally:
        for path in (get_bin_path(tmp), get_idx_path(tmp)):
            if os.path.exists(path):
                os.remove(path)
    return prefix, count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hetu_ext.megatron.preprocess_data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="jsonl file, one document per line")
    parser.add_argument("--output-prefix", required=True)
    parser.add_argument("--tokenizer-type", default="ByteLevelTokenizer",
                        choices=TOKENIZER_TYPES + FILE_TOKENIZER_TYPES)
    parser.add_argument("--vocab-size", type=int, default=None, help="for NullTokenizer")
    parser.add_argument("--tokenizer-model", default=None,
                        help="Llama2Tokenizer: a SentencePiece model file; HuggingFaceTokenizer: a local directory")
    parser.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json")
    parser.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
    parser.add_argument("--json-keys", nargs="+", default=["text"])
    parser.add_argument("--append-eod", action="store_true")
    parser.add_argument("--workers", type=int, default=1, help="accepted for Megatron-LM compatibility")
    args = parser.parse_args(argv)
    quiet_host_frameworks()
    if not Path(args.input).is_file():
        parser.error(f"--input {args.input!r} does not exist; give a jsonl file")
    files = {name: getattr(args, name) for name in TOKENIZER_FILES}
    try:
        check_tokenizer_files(args.tokenizer_type, files)
        for key in args.json_keys:
            prefix, count = preprocess(args.input, args.output_prefix, tokenizer_type=args.tokenizer_type,
                                       json_key=key, append_eod=args.append_eod, vocab_size=args.vocab_size,
                                       files=files)
            print(f"wrote {count} documents to {prefix}.bin/.idx (use --data-path {prefix})")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
