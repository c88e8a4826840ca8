"""Gated MLP weights (SwiGLU, GeGLU) in hetu checkpoints: stored with a leading gate axis, ``(2, F, ...)``.

Megatron-core's gated ``linear_fc1`` holds ``[gate_r; up_r]`` on each TP rank: the rank's rows are two boxes of
Megatron's global ``[gate; up]`` (``2F`` rows), not one, so hetu checkpoints give the tensor a leading axis of two,
gate then up (``hetu_ext.megatron.weights``: each rank holds the box ``(0:2, rF/tp:(r+1)F/tp, ...)``, a view of
its whole parameter). The bytes are those of ``[gate; up]`` in row-major order; converting to Megatron's and
Hugging Face's layouts is a reshape (:func:`to_megatron`, :func:`from_megatron`). The rule is by key and rank: a
``linear_fc1`` weight (bias) stored with three axes (two) is gated; a plain one has two (one).
"""

from __future__ import annotations

import torch

from hetu_ext.model.inventory import keys_split_as

GATED_SUFFIXES = tuple(key.removeprefix("decoder.layers.") for key in keys_split_as("gated_rows"))
"""The keys the model inventory splits as gated rows (under --swiglu)."""


def is_gated(key: str, shape: tuple[int, ...]) -> bool:
    """Whether a per-layer tensor (shape without the layer index) of ``key`` holds the gate axis."""
    key = key.split("/", 1)[-1]
    if not key.endswith(GATED_SUFFIXES):
        return False
    plain = 2 if key.endswith("weight") else 1
    return len(shape) == plain + 1 and shape[0] == 2


def to_megatron(t: torch.Tensor) -> torch.Tensor:
    """``(2, F, ...)`` -> Megatron's ``[gate; up]`` ``(2F, ...)`` (a view)."""
    return t.reshape(2 * t.shape[1], *t.shape[2:])


def from_megatron(t: torch.Tensor) -> torch.Tensor:
    """Megatron's ``[gate; up]`` ``(2F, ...)`` -> ``(2, F, ...)`` (a view)."""
    return t.reshape(2, t.shape[0] // 2, *t.shape[1:])
