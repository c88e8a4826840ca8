"""Packs under ZeRO-2 and ZeRO-3: every rank runs the same number of microbatches.

ZeRO-2 reduce-scatters gradients on every backward and ZeRO-3 gathers parameters on every forward and backward, so
a rank that ran fewer microbatches than another would leave it waiting in a collective it never joins. The packer
(hetu_ext/megatron/packed_data.py) gives each rank a token share that follows the measured speeds, in as many
packs as those tokens need: a slow rank's smaller share is fewer packs. :func:`even_packs` tops every rank up to
the largest pack count of the step with one-token microbatches whose loss counts nothing (loss mask 0): they join
the collectives at the cost of one token's compute, and add exactly zero to every gradient, so the update is the
packer's (the single-process one on the same global batch).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist


def filler(batch: dict[str, Any]) -> dict[str, Any]:
    """A one-token microbatch of ``batch``'s first token and label, with loss mask 0, in ``batch``'s form (a THD
    pack of one document when ``batch`` is one: ZeRO-3 prefetches parameters in the order of the modules a pass
    ran, so every rank's passes must run the same modules)."""
    out = {key: batch[key][:, :1].clone() for key in ("tokens", "labels", "position_ids")}
    out["position_ids"].zero_()
    out["loss_mask"] = torch.zeros_like(batch["loss_mask"][:, :1])
    packed = batch.get("packed_seq_params")
    if packed is not None:
        cu = torch.tensor([0, 1], dtype=packed.cu_seqlens_q.dtype, device=packed.cu_seqlens_q.device)
        out["packed_seq_params"] = dataclasses.replace(packed, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=1,
                                                       max_seqlen_kv=1)
    return out


def even_packs(batches: list[dict[str, Any]], group=None) -> list[dict[str, Any]]:
    """``batches`` topped up with :func:`filler` microbatches to the largest count over the ranks of ``group``
    (collective: one all-reduce of a count)."""
    count = torch.tensor([len(batches)], dtype=torch.int64)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    if not batches and int(count) > 0:
        raise ValueError("a rank got no pack of the global batch; raise --hetu-global-batch-tokens")
    return batches + [filler(batches[0]) for _ in range(int(count) - len(batches))]
