"""Vocabulary padding is not a layout: the embedding and output rows past the tokenizer's ids carry nothing.

Megatron-LM pads the vocabulary to a multiple of ``make_vocab_size_divisible_by x TP`` (1,025 NullTokenizer ids
are 1,152 rows at TP 1 and 1,280 at TP 2), so the same model has another embedding shape under another TP degree.
Two rules make a checkpoint load into any padding exactly:

* **The padding rows take no part in the loss** (:func:`padding_logit_mask`): their logits are set to the
  dtype's lowest value before Megatron's cross-entropy, so their softmax weight is 0 and they receive no gradient.
  Megatron itself leaves them in the softmax: there a model's loss depends on how much padding its TP degree added
  (a DP 2 run's checkpoint resumed under TP 2 started 0.1 higher: 128 more competing classes, log(1280/1152)).
* **A load reads the real rows only** (:func:`narrow_to_vocab`) where the checkpoint's padding differs from the
  model's: padding rows keep their initial values (as Megatron initialised them) and zero optimizer moments.

A checkpoint of another vocabulary (another tokenizer or ``--vocab-size``) is refused in one line naming both
sizes (:func:`check_vocab`).
"""

from __future__ import annotations

import torch

from hetu_ext.checkpoint import CheckpointError
from hetu_ext.model import inventory
from hetu_ext.runtime.reshard import Piece

VOCAB_KEYS = inventory.keys_split_as("vocab_rows")
"""The tensors whose rows are the vocabulary (axis 0), as the model inventory splits them."""


def check_vocab(saved: int | None, current: int, *, where: str) -> None:
    """Raise unless a checkpoint of ``saved`` real ids (None: not recorded) may load into ``current`` ones."""
    if saved is not None and saved != current:
        raise CheckpointError(f"{where} was saved with a vocabulary of {saved} ids, this run has {current}; the "
                              "tokenizer or --vocab-size differs: load it with the tokenizer it was trained with")


def narrow_to_vocab(pieces: list[Piece], *, vocab_size: int, moments: tuple[str, ...]) -> list[Piece]:
    """``pieces`` with every vocabulary tensor's box cut to its first ``vocab_size`` rows (pieces wholly in the
    padding dropped). The padding rows of optimizer moments (``moments``: kinds before ``/``) are zeroed, since
    nothing will fill them; parameters and fp32 masters keep their initial values there."""
    out = []
    for p in pieces:
        kind, key = p.key.split("/", 1)
        (r0, r1), *rest = p.box if key in VOCAB_KEYS else ((0, 0),)
        if key not in VOCAB_KEYS or r1 <= vocab_size:
            out.append(p)
            continue
        keep = max(0, vocab_size - r0)
        if kind in moments:
            p.tensor[keep:].zero_()
        if keep:
            out.append(Piece(p.key, p.index, ((r0, r0 + keep), *rest), p.tensor[:keep]))
    return out


def padding_logit_mask(logits: torch.Tensor, *, vocab_size: int, tp_rank: int) -> torch.Tensor:
    """``logits`` ``[s, b, V/tp]`` (this TP rank's columns of the padded vocabulary) with the columns of
    padding ids (>= ``vocab_size``) at the dtype's lowest value: softmax weight 0, no gradient."""
    part = logits.shape[-1]
    first_padding = vocab_size - tp_rank * part
    if first_padding >= part:
        return logits
    mask = torch.zeros(part, dtype=torch.bool, device=logits.device)
    mask[max(first_padding, 0):] = True
    return logits.masked_fill(mask, torch.finfo(logits.dtype).min)
