"""Context parallelism (CP) of a plan's stage: every sequence split over the stage's ``cp`` TP groups.

**Layout** (load-balanced for causal attention, as Megatron-core and Llama 3): a sequence of ``n`` tokens (``n`` a
multiple of ``2 cp``, padded where needed) is cut into ``2 cp`` chunks of ``L = n / (2 cp)`` tokens; CP rank ``r``
holds chunks ``r`` and ``2 cp - 1 - r``, so every CP rank has the same causal work (``(2 cp + 1) L`` keys per
query row of its two chunks together). A THD pack is split document by document: each document padded to a
multiple of ``2 cp`` and its chunks dealt the same way, so a rank's pack is its two chunks of every document in
document order, and the pack's ``cu_seqlens`` stay the global (padded) ones (Megatron-core's THD RoPE reads them
so, and rank ``r``'s part of document d starts at ``cu_seqlens[d] / cp``). Padding tokens come last in their
document (no real token attends to them) with loss mask 0 and position 0; every other token keeps its global
position, so learned position embeddings and RoPE (Megatron-core's own CP slicing, fed the CP group through
``pg_collection.cp``) see global positions.

**Attention** (:func:`context_parallel_attention`): the stage's keys and values are all-gathered over the CP group
(:class:`_GatherOverGroup`, whose backward reduce-scatters their gradients, as Llama 3 does), put in global order,
and each of the rank's two query chunks attends causally to the prefix of keys up to its own end, aligned at the
bottom right (``torch.nn.attention.bias.causal_lower_right``: flash or memory-efficient kernels on CUDA, never a
score matrix built here). Grouped-query keys are repeated per query head after the gather (torch's lower-right
flash path takes no ``enable_gqa``), so the wire carries the groups only.

**Data** (:func:`cp_batches`): each microbatch dict the step kinds make (``tokens``, ``labels``, ``loss_mask``,
``position_ids`` of shape ``[b, s]``, and for THD packs ``packed_seq_params``) is cut into this CP rank's part
before the stage model sees it; the per-token loss sums and token counts are then those of the rank's tokens, and
the step's sums over the plan's ranks (``train/step.py``, ``plan_runtime._finalize_func``) make them global.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def chunk_owner(k: int, cp: int) -> tuple[int, int]:
    """Global chunk ``k`` of ``2 cp``: (the CP rank holding it, 0 for its first chunk or 1 for its second)."""
    return (k, 0) if k < cp else (2 * cp - 1 - k, 1)


# ---------------------------------------------------------------- data: this CP rank's part of a microbatch


def _my_chunks(x: torch.Tensor, rank: int, cp: int) -> torch.Tensor:
    """``[b, n]`` (``n`` a multiple of ``2 cp``) -> ``[b, n / cp]``: chunks ``rank`` and ``2 cp - 1 - rank``."""
    b, n = x.shape
    chunks = x.view(b, 2 * cp, n // (2 * cp))
    return chunks[:, [rank, 2 * cp - 1 - rank]].reshape(b, n // cp)


def _padded(x: torch.Tensor, pad: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


def split_rows(batch: dict, rank: int, cp: int) -> dict:
    """``[b, s]`` sequences (no pack): padded to a multiple of ``2 cp`` (loss mask 0, position 0), this rank's two
    chunks of each."""
    pad = -batch["tokens"].size(1) % (2 * cp)
    out = dict(batch)
    for key in BATCH_KEYS:
        out[key] = _my_chunks(_padded(batch[key], pad), rank, cp)
    return out


def split_pack(batch: dict, rank: int, cp: int) -> dict:
    """A THD pack (``[1, t]``, documents at ``cu_seqlens``): each document padded to a multiple of ``2 cp`` and cut
    into its chunks; this rank's two chunks of every document, in document order; ``cu_seqlens`` the padded
    global ones."""
    from megatron.core.packed_seq_params import PackedSeqParams

    params = batch["packed_seq_params"]
    cu = params.cu_seqlens_q.tolist()
    parts: dict[str, list[torch.Tensor]] = {key: [] for key in BATCH_KEYS}
    padded = [0]
    for start, stop in zip(cu[:-1], cu[1:]):
        pad = -(stop - start) % (2 * cp)
        for key in BATCH_KEYS:
            parts[key].append(_my_chunks(_padded(batch[key][:, start:stop], pad), rank, cp))
        padded.append(padded[-1] + stop - start + pad)
    out = dict(batch)
    out.update({key: torch.cat(parts[key], dim=1) for key in BATCH_KEYS})
    longest = max(b - a for a, b in zip(padded[:-1], padded[1:]))
    cu_padded = torch.tensor(padded, dtype=params.cu_seqlens_q.dtype, device=params.cu_seqlens_q.device)
    out["packed_seq_params"] = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_padded, cu_seqlens_kv=cu_padded,
                                               max_seqlen_q=longest, max_seqlen_kv=longest)
    return out


def cp_part(batch: dict, rank: int, cp: int) -> dict:
    """This CP rank's part of a microbatch (the batch itself at ``cp`` 1)."""
    if cp == 1:
        return batch
    params = batch.get("packed_seq_params")
    if params is not None and params.qkv_format == "thd":
        return split_pack(batch, rank, cp)
    return split_rows(batch, rank, cp)


def cp_batches(microbatches: Iterator[dict], placement) -> Iterator[dict]:
    """The microbatches a placement's stage model takes: each cut to its CP rank's part (``placement.cp_size`` >
    1), lazily, so a schedule draws from ``microbatches`` only what it runs."""
    if placement.cp_size == 1:
        return microbatches
    return (cp_part(batch, placement.cp_rank, placement.cp_size) for batch in microbatches)


# ---------------------------------------------------------------- attention over the CP group


class _GatherOverGroup(torch.autograd.Function):
    """``[...]`` on each rank of ``group`` -> ``[size, ...]`` (rank order) on all; backward: the gradients summed
    over the group and scattered back (reduce-scatter), each rank getting its own part's."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty((group.size() * x.size(0), *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x, group=group)
        return out.view(group.size(), *x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        mine = torch.empty(grad.shape[1:], dtype=grad.dtype, device=grad.device)
        dist.reduce_scatter_tensor(mine, grad.view(-1, *grad.shape[2:]), group=ctx.group)
        return mine, None


def gather_over_group(x: torch.Tensor, group) -> torch.Tensor:
    """Differentiable all-gather of ``x`` over ``group``: ``[size, *x.shape]``."""
    return _GatherOverGroup.apply(x, group)


def _causal_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, dropout: float):
    """``q`` ``[b, n, L, hn]`` (the last L positions of a prefix) attending causally to the prefix ``k``, ``v``
    ``[b, n, S, hn]``: the causal mask aligned at the bottom right."""
    from torch.nn.attention.bias import causal_lower_right

    length, prefix = q.size(2), k.size(2)
    if length == prefix:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True,
                                                                scale=scale)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(length, prefix),
                                                            dropout_p=dropout, scale=scale)


def _repeat_groups(x: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """Grouped-query keys/values repeated to one per query head (head i reads group ``i // (heads / groups)``)."""
    return x if x.size(dim) == heads else x.repeat_interleave(heads // x.size(dim), dim=dim)


def _attend_sequence(q: torch.Tensor, kv: torch.Tensor, *, rank: int, cp: int, scale: float, dropout: float
                     ) -> torch.Tensor:
    """One sequence (or document): ``q`` ``[b, heads, 2L, hn]`` (this rank's two chunks), ``kv`` the gathered
    ``[cp, 2, b, groups, 2L, hn]`` keys and values of every rank's two chunks. Returns ``[b, heads, 2L, hn]``."""
    length = q.size(2) // 2
    ordered = [kv[owner, :, :, :, half * length:(half + 1) * length]
               for owner, half in (chunk_owner(k, cp) for k in range(2 * cp - rank))]
    keys, values = (_repeat_groups(x, q.size(1), dim=1) for x in torch.cat(ordered, dim=-2).unbind(0))
    out = []
    for half, chunk in enumerate((rank, 2 * cp - 1 - rank)):
        end = (chunk + 1) * length
        out.append(_causal_prefix(q[:, :, half * length:(half + 1) * length], keys[:, :, :end],
                                  values[:, :, :end], scale=scale, dropout=dropout))
    return torch.cat(out, dim=2)


def context_parallel_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group, *,
                               scale: float, dropout: float, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this CP rank's queries over the whole sequence's keys and values.

    ``[s, b, heads, hn]`` query (``s = 2 L``: this rank's two chunks) and ``[s, b, groups, hn]`` key/value ->
    ``[s, b, heads, hn]``; or THD (``cu_seqlens``: the global padded document bounds): ``[t, heads, hn]`` ->
    ``[t, heads, hn]``, each document attending to itself only."""
    rank, cp = group.rank(), group.size()
    kv = gather_over_group(torch.stack([key, value]), group)  # (cp, 2, s, b, g, hn) or (cp, 2, t, g, hn)
    if cu_seqlens is None:
        q = query.permute(1, 2, 0, 3)  # (s, b, n, hn) -> (b, n, s, hn)
        out = _attend_sequence(q, kv.permute(0, 1, 3, 4, 2, 5), rank=rank, cp=cp, scale=scale,
                               dropout=dropout)
        return out.permute(2, 0, 1, 3)  # (b, n, s, hn) -> (s, b, n, hn)
    bounds = [b // cp for b in cu_seqlens.tolist()]  # this rank's part of document d: [bounds[d], bounds[d+1])
    outputs = []
    for start, stop in zip(bounds[:-1], bounds[1:]):
        q = query[start:stop].transpose(0, 1).unsqueeze(0)  # (2L, n, hn) -> (1, n, 2L, hn)
        doc_kv = kv[:, :, start:stop].permute(0, 1, 3, 2, 4).unsqueeze(2)  # (cp, 2, 1, g, 2L, hn)
        out = _attend_sequence(q, doc_kv, rank=rank, cp=cp, scale=scale, dropout=dropout)
        outputs.append(out.squeeze(0).transpose(0, 1))
    return torch.cat(outputs, dim=0)
