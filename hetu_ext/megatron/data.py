"""Megatron-core datasets: tokenizers it accepts, GPTDataset / MockGPTDataset building, microbatch iterators."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from hetu_ext.plan.core.batches import microbatch_samples
from hetu_ext.data.tokenizer import ByteLevelTokenizer, tokenizer_vocab_size
from hetu_ext.plan import Plan

logger = logging.getLogger(__name__)

def make_tokenizer(tokenizer_type: str, vocab_size: int | None = None, files: dict | None = None):
    """A Megatron tokenizer object (``MegatronLegacyTokenizer``) that works offline.

    ``ByteLevelTokenizer``: UTF-8 bytes + EOD (hetu_ext.data.tokenizer). ``NullTokenizer``: Megatron-LM's, text is
    space-separated token ids, needs ``--vocab-size`` (EOD is vocab_size). ``HuggingFaceTokenizer`` and
    ``GPT2BPETokenizer`` read ``files`` (``tokenizer_model``, ``vocab_file``, ``merge_file``:
    hetu_ext.megatron.tokenizers).
    """
    from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer

    from .tokenizers import FILE_TOKENIZERS, open_file_tokenizer

    if tokenizer_type in FILE_TOKENIZERS:
        inner = open_file_tokenizer(tokenizer_type, **(files or {}))
        size, eod, encode, decode = inner.vocab_size, inner.eod, inner.encode, inner.decode
    elif tokenizer_type == "ByteLevelTokenizer":
        size, inner = tokenizer_vocab_size(tokenizer_type, vocab_size), ByteLevelTokenizer()
        eod, encode, decode = inner.eod, inner.tokenize, inner.detokenize
    else:  # NullTokenizer
        size = tokenizer_vocab_size(tokenizer_type, vocab_size)  # ValueError for a bad type or size
        eod = vocab_size
        encode = lambda text: [int(t) for t in text.split()]  # noqa: E731
        decode = lambda ids: " ".join(str(int(i)) for i in ids)  # noqa: E731

    class _Tokenizer(MegatronLegacyTokenizer):
        def __init__(self) -> None:
            super().__init__(tokenizer_type=tokenizer_type)

        def tokenize(self, text: str) -> np.ndarray:
            return np.asarray(encode(text), dtype=np.int64)

        def detokenize(self, ids) -> str:
            return decode(ids)

        @property
        def vocab(self):
            return {i: i for i in range(size)}

        @property
        def inv_vocab(self):
            return self.vocab

        @property
        def vocab_size(self) -> int:
            return size

        @property
        def eod(self) -> int:
            return eod

        @property
        def pad(self) -> int:
            return eod

    _Tokenizer.__name__ = tokenizer_type
    return _Tokenizer()


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    """Where samples come from (Megatron-LM flag names)."""

    mock: bool
    """``--mock-data``: Megatron's MockGPTDataset."""
    data_path: tuple[str, ...] = ()
    """``--data-path``: prefixes of .bin/.idx files, optionally weighted (``0.3 A 0.7 B``)."""
    split: str = "969,30,1"
    """``--split``: train/valid/test proportions of the documents."""
    seq_length: int = 128
    seed: int = 1234
    cache_path: str | None = None
    """``--data-cache-path``: where index caches go (next to the data if unset)."""


def build_train_dataset(spec: DataSpec, tokenizer, num_samples: int):
    """Megatron-core's GPTDataset (or MockGPTDataset) with at least ``num_samples`` training samples.

    Collective: call on every rank. Megatron's builder builds the index caches on rank 0, barriers, then the
    other ranks read them.
    """
    return build_datasets(spec, tokenizer, (num_samples, 0, 0))[0]


def build_datasets(spec: DataSpec, tokenizer, num_samples: tuple[int, int, int]) -> tuple:
    """The train, validation and test datasets of ``--split`` (Megatron-LM's three parts of the documents), each
    with at least its ``num_samples`` entry of samples; a part the split gives no share is None. Each part's
    samples depend only on its own documents, size and the seed, so asking for validation samples leaves the
    training samples unchanged.

    Collective: call on every rank (see :func:`build_train_dataset`).
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.core.datasets.utils import get_blend_from_list

    config = GPTDatasetConfig(
        random_seed=spec.seed, sequence_length=spec.seq_length,
        blend=None if spec.mock else get_blend_from_list(list(spec.data_path)),
        split=spec.split, tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, create_attention_mask=False, path_to_cache=spec.cache_path,
        mid_level_dataset_surplus=0.005)
    cls = MockGPTDataset if spec.mock else GPTDataset
    if not spec.mock:
        _check_split_parts(config, num_samples)
    train, valid, test = BlendedMegatronDatasetBuilder(cls, list(num_samples), lambda: True, config).build()
    return train, valid, test


def _check_split_parts(config, num_samples: tuple[int, int, int]) -> None:
    """Refuse a part of ``--split`` that is asked for samples but holds no document of a dataset (Megatron-core's
    builder would loop forever counting its epochs): Megatron's own rule, ``round(bound * documents)``, per
    prefix."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    for prefix in config.blend[0]:
        documents = len(IndexedDataset(prefix, mmap=True))
        for name, want, bounds in zip(("training", "validation", "test"), num_samples, config.split_matrix):
            if want and bounds is not None and round(bounds[1] * documents) <= round(bounds[0] * documents):
                raise ValueError(f"--split {config.split}: the {name} part of {prefix} ({documents} documents) "
                                 f"holds no document, and {want} {name} samples are asked of it; give it a larger "
                                 "share (e.g. --split 98,1,1), more documents, or ask for no such samples "
                                 "(--eval-iters 0)")


def microbatch_iterator(dataset, plan: Plan, pipeline: int, micro_batch_size: int, *, start_iteration: int,
                        num_iterations: int, device: torch.device, ramp=None) -> Iterator[dict[str, torch.Tensor]]:
    """Yield this pipeline's microbatches, iteration after iteration, each a dict of [b, s] tensors (``ramp``: a
    :class:`~hetu_ext.plan.core.batches.BatchRamp`, --rampup-batch-size's global batches)."""
    for iteration in range(start_iteration, start_iteration + num_iterations):
        for ids in microbatch_samples(plan, pipeline, iteration, micro_batch_size, ramp):
            samples = [dataset[i] for i in ids]
            yield {key: torch.stack([s[key] for s in samples]).to(device)
                   for key in ("tokens", "labels", "loss_mask", "position_ids")}
