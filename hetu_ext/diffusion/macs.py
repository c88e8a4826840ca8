"""Multiply-accumulates of a forward pass: torch's FLOP counter for convolutions and matmuls, plus attention counted
analytically (torch's counter has no formula for CPU scaled-dot-product attention and counts it as 0)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode


def _sdpa_flops(query_shape: tuple[int, ...], key_shape: tuple[int, ...], value_shape: tuple[int, ...]) -> int:
    """QK^T and PV: 2 matmuls of (B, H, Lq, d) x (B, H, d, Lk) -> 2 * 2 * B * H * Lq * Lk * d FLOPs."""
    *batch, lq, dim = query_shape
    lk, dv = key_shape[-2], value_shape[-1]
    heads = 1
    for size in batch:
        heads *= size
    return 2 * heads * lq * lk * dim + 2 * heads * lq * lk * dv


def _cpu_sdpa_formula(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, **kwargs: Any) -> int:
    """The counter passes tensor arguments as their shapes."""
    return _sdpa_flops(tuple(query_shape), tuple(key_shape), tuple(value_shape))


def count_macs(fn: Callable[[], Any]) -> int:
    """MACs (= FLOPs / 2) of everything `fn` runs: convolutions, linear layers, matmuls and attention."""
    mapping = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_formula}
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        fn()
    return counter.get_total_flops() // 2
