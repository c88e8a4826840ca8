"""Core attention that understands packed (THD) input, for Megatron-core's local layer spec.

Megatron's ``DotProductAttention`` (the local spec's core attention) asserts ``packed_seq_params is None``; packed
attention is only in Transformer Engine. This subclass keeps Megatron's path for ordinary ``[s, b, np, hn]`` input
and, for a THD pack (``packed_seq_params.qkv_format == "thd"``, query/key/value ``[t, np, hn]`` with ``t`` the
pack's tokens), lets each document attend causally to itself only:

- on CUDA with torch's FlexAttention, one kernel over the pack with a document-causal block mask;
- otherwise (CPU), torch's scaled_dot_product_attention per document: each document costs ``O(s_i^2)``, the pack
  ``sum s_i^2``, never ``t^2``.

Both compute exactly the attention of each document run on its own, which is what makes packing invisible to the
loss (tests/test_packed_training.py).
"""

from __future__ import annotations

import itertools

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention

try:  # torch >= 2.5
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # pragma: no cover - older torch
    create_block_mask = flex_attention = None


def _document_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``(t,)`` index of the document each token of the pack belongs to."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths, output_size=total)


class PackedDotProductAttention(DotProductAttention):
    """Megatron's DotProductAttention plus THD packs (each document attends causally to itself only)."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        if attention_bias is not None:
            raise ValueError("packed (THD) attention takes no attention_bias; drop it or disable --hetu-packing")
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1:  # grouped-query attention: repeat keys/values to match the query heads
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        dropout = self.attention_dropout.p if self.training else 0.0
        cu = packed_seq_params.cu_seqlens_q
        # Megatron divides softmax_scale by the layer number under query-key layer scaling and its softmax
        # multiplies it back; here the softmax takes the net scale directly
        self._net_scale = self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling else 1)
        if query.is_cuda and flex_attention is not None and dropout == 0.0:
            context = self._flex(query, key, value, cu)
        else:
            context = self._per_document(query, key, value, cu, dropout)
        return context.reshape(context.size(0), self.hidden_size_per_partition)  # (t, np*hn)

    def _per_document(self, query, key, value, cu_seqlens, dropout: float) -> torch.Tensor:
        # (t, np, hn) -> per document (1, np, s_i, hn) -> causal SDPA -> (s_i, np, hn)
        bounds = cu_seqlens.tolist()
        outputs = []
        for start, end in itertools.pairwise(bounds):
            q, k, v = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout, is_causal=True, scale=self._net_scale)
            outputs.append(out.squeeze(0).transpose(0, 1))
        return torch.cat(outputs, dim=0)

    def _flex(self, query, key, value, cu_seqlens) -> torch.Tensor:
        total = query.size(0)
        docs = _document_ids(cu_seqlens, total)

        def document_causal(b, h, q_idx, kv_idx):
            return (docs[q_idx] == docs[kv_idx]) & (q_idx >= kv_idx)

        mask = create_block_mask(document_causal, B=None, H=None, Q_LEN=total, KV_LEN=total,
                                 device=query.device)
        q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query, key, value))  # (1, np, t, hn)
        out = flex_attention(q, k, v, block_mask=mask, scale=self._net_scale)
        return out.squeeze(0).transpose(0, 1)
