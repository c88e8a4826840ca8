"""FlexAttention over THD packs on CUDA: compiled once per shape class, the block mask built once per pack layout.

A pack of ``t`` tokens holds documents laid end to end (``cu_seqlens``, ``(n + 1,)``); each token attends causally
to the tokens of its own document. Eager ``flex_attention`` is torch's reference path and materialises the
``[heads, t, t]`` scores; ``torch.compile(flex_attention)`` generates the kernel that visits only the blocks the mask
keeps. Two caches keep the compiler and the mask off the step's critical path:

* **Shape class.** The pack is padded to ``shape_class(t)``: a power of two of at least ``MIN_CLASS`` tokens. A run
  with packs up to 32K tokens therefore compiles at most 6 shapes (1K, 2K, ..., 32K), under dynamo's default
  recompile limit of 8, whatever its packs' lengths; the padding (at most ``t`` tokens, its own document) costs
  only the copies of q, k and v: its blocks are outside every real token's mask, so the kernel skips them.
* **Pack layout.** The block mask of one layout (``cu_seqlens`` and the class) is built from the documents'
  boundaries at block granularity (:func:`document_block_mask`: ``O((T / 128)^2)`` integers, never the ``T x T``
  mask ``create_block_mask`` evaluates) and kept in a small LRU cache: every layer of the stage, the recomputed
  forward and the backward of one microbatch reuse it.

Each document's output equals its own causal attention (tests/test_attention.py checks the block mask against
``create_block_mask`` and the result against SDPA per document, on CPU through eager flex; the compiled kernel
runs on CUDA only, benchmarks/gpu_check.sh).
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict

import torch

try:  # torch >= 2.5
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover - older torch
    BlockMask = flex_attention = None

logger = logging.getLogger(__name__)

BLOCK = 128
"""FlexAttention's default block size (tokens per q and kv block)."""
MIN_CLASS = 1024
"""The smallest shape class (tokens): shorter packs are padded to it."""
MASK_CACHE = 16
"""Pack layouts whose block masks are kept (a microbatch's layers and its backward share one)."""

_compiled = None
_masks: OrderedDict = OrderedDict()


def available() -> bool:
    """Whether this torch has FlexAttention."""
    return flex_attention is not None


def shape_class(tokens: int) -> int:
    """The padded length of a pack of ``tokens``: the next power of two, at least ``MIN_CLASS``."""
    return max(MIN_CLASS, 1 << math.ceil(math.log2(max(tokens, 1))))


def padded_document_ids(cu_seqlens: torch.Tensor, padded: int) -> torch.Tensor:
    """``(padded,)`` document index of each token; the padding after the last document is document ``n``."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    total = int(cu_seqlens[-1])
    lengths = torch.cat([lengths, lengths.new_tensor([padded - total])])
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths,
                                   output_size=padded)


def _kv_lists(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``[1, 1, nq]`` counts, ``[1, 1, nq, nk]`` indices, the kept kv blocks of each q block first, ascending)."""
    counts = keep.sum(-1, dtype=torch.int32)
    order = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts[None, None], order[None, None]


def document_block_mask(docs: torch.Tensor, block: int = BLOCK):
    """The document-causal BlockMask of a pack whose tokens belong to documents ``docs`` (``(T,)``, non-decreasing,
    ``T`` a multiple of ``block``), from the documents' boundaries at block granularity.

    Documents are contiguous, so a q block ``i`` and an earlier kv block ``j < i`` share a document only when the
    last document of ``j`` is the first of ``i`` (partial or full), and all their pairs attend only when both
    blocks lie inside that one document (full: the kernel applies no mask there). A diagonal block is partial
    (causal within it); a later block is empty."""
    total = docs.numel()
    assert total % block == 0, (total, block)
    nb = total // block
    first, last = docs.view(nb, block)[:, 0], docs.view(nb, block)[:, -1]
    i = torch.arange(nb, device=docs.device)[:, None]
    j = torch.arange(nb, device=docs.device)[None, :]
    earlier = j < i
    shares = (j == i) | (earlier & (last[None, :] == first[:, None]))
    whole = (first == last)
    full = earlier & whole[:, None] & whole[None, :] & (first[:, None] == first[None, :])
    partial = shares & ~full

    def document_causal(b, h, q_idx, kv_idx):
        return (docs[q_idx] == docs[kv_idx]) & (q_idx >= kv_idx)

    counts, indices = _kv_lists(partial)
    full_counts, full_indices = _kv_lists(full)
    return BlockMask.from_kv_blocks(counts, indices, full_counts, full_indices, BLOCK_SIZE=block,
                                    mask_mod=document_causal, seq_lengths=(total, total))


def cached_block_mask(cu_seqlens: torch.Tensor, padded: int):
    """The block mask of this pack layout, built once and reused while it stays among the last MASK_CACHE."""
    key = (tuple(cu_seqlens.tolist()), padded, str(cu_seqlens.device))
    mask = _masks.get(key)
    if mask is None:
        mask = document_block_mask(padded_document_ids(cu_seqlens, padded))
        _masks[key] = mask
        if len(_masks) > MASK_CACHE:
            _masks.popitem(last=False)
    else:
        _masks.move_to_end(key)
    return mask


def _compiled_flex():
    global _compiled
    if _compiled is None:
        # static shapes: one graph per shape class (see the module docstring)
        _compiled = torch.compile(flex_attention, dynamic=False)
    return _compiled


def packed_flex_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                          *, scale: float, compiled: bool = True) -> torch.Tensor:
    """Document-causal attention of a THD pack: query ``(t, np, hn)``, key/value ``(t, ng, hn)`` (``ng`` divides
    ``np``: grouped-query attention) -> ``(t, np, hn)``. ``compiled`` False runs eager flex (the reference path
    the tests use on CPU; it materialises the scores)."""
    total = query.size(0)
    padded = shape_class(total)
    mask = cached_block_mask(cu_seqlens, padded)

    def batch_heads(x: torch.Tensor) -> torch.Tensor:  # (t, n, hn) -> (1, n, padded, hn)
        x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, padded - total))
        return x.transpose(0, 1).unsqueeze(0)

    q, k, v = batch_heads(query), batch_heads(key), batch_heads(value)
    fn = _compiled_flex() if compiled else flex_attention
    out = fn(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.size(1) != k.size(1))
    return out.squeeze(0).transpose(0, 1)[:total]  # (t, np, hn)
