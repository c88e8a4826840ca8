"""Core attention for Megatron-core's local layer spec that never materialises the ``[b, heads, s, s]`` scores.

Megatron's ``DotProductAttention`` (the local spec's core attention) computes ``baddbmm`` scores, an fp32 softmax
and its dropout as whole ``[b, np, s, s]`` tensors and keeps them for backward: at 8K tokens and more that is more
memory than the layer's every other activation, and it asserts ``packed_seq_params is None``. Two classes, both
Megatron's ModuleSpec seam (``core_attention``):

* :class:`PackedDotProductAttention`: Megatron's path for ``[s, b, np, hn]`` input, plus THD packs
  (``packed_seq_params.qkv_format == "thd"``, query/key/value ``[t, np, hn]``): each document attends causally to
  itself only. What Megatron-LM's own loop installs under ``--hetu-packing`` (hetu_ext/megatron_lm/packing.py).
* :class:`ScoreFreeAttention` (hetu_ext's trainer's default, ``attention: sdpa``): the same, and ``[s, b]`` input
  through ``torch.nn.functional.scaled_dot_product_attention``: the flash kernel on CPU, flash / memory-efficient /
  cuDNN on CUDA. Grouped-query attention through SDPA's ``enable_gqa`` (no repeated keys), dropout through its
  ``dropout_p`` under Megatron's RNG tracker as Megatron draws it (the model-parallel stream, except under sequence
  parallelism), query-key layer scaling as one net scale, recomputation and sequence parallelism unaffected (they
  act around the core attention). Where a feature needs Megatron's function, :func:`megatron_path_reason` names it
  and the module runs Megatron's path (logged once per reason). Under context parallelism (a plan stage's
  ``cp`` > 1) the rank's two chunks of every sequence or document attend over the keys and values all-gathered
  from its CP group (:mod:`hetu_ext.megatron.context_parallel`).

THD packs: on CUDA with dropout 0, FlexAttention compiled once per shape class with the block mask cached per pack
layout (:mod:`hetu_ext.megatron.flex_packs`); otherwise SDPA per document (each document ``O(s_i)`` memory with the
flash kernel, the pack ``sum s_i^2`` work, never ``t^2``).

Limits of torch's kernels, not of this module: on CPU, SDPA with dropout > 0 runs torch's math path, which
materialises the scores (the CPU flash kernel has no dropout); on CUDA flash attention takes dropout.

Every path computes exactly the attention of Megatron's ``DotProductAttention`` (fp32 summation order aside:
tests/test_attention.py, 1e-6 on the gold tests' shapes), which is what keeps every gold test's reference valid.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import is_layer_window_attention

from . import flex_packs
from .context_parallel import context_parallel_attention

logger = logging.getLogger(__name__)

CORE_ATTENTIONS = ("sdpa", "megatron")
"""``--hetu-attention``: ``sdpa`` (:class:`ScoreFreeAttention`) or ``megatron`` (Megatron's DotProductAttention
for ``[s, b]`` input, :class:`PackedDotProductAttention`)."""

_REPORTED: set[str] = set()


def megatron_path_reason(config, layer_number: int, attn_mask_type) -> str | None:
    """The feature, by name, whose function SDPA does not compute and Megatron's ``DotProductAttention`` does; None
    when SDPA computes the same attention."""
    if config.softmax_type != "vanilla":
        return f"softmax_type {config.softmax_type} (a softmax offset term; SDPA's softmax has none)"
    if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
        return f"window_size {config.window_size} (sliding-window attention)"
    if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask, AttnMaskType.padding):
        return f"attn_mask_type {attn_mask_type.name}"
    return None


def _report_once(reason: str) -> None:
    if reason not in _REPORTED:
        _REPORTED.add(reason)
        logger.info("core attention: Megatron's DotProductAttention (materialised scores) for %s", reason)


class PackedDotProductAttention(DotProductAttention):
    """Megatron's DotProductAttention plus THD packs (each document attends causally to itself only)."""

    @property
    def net_scale(self) -> float:
        """The softmax's scale: Megatron divides ``softmax_scale`` by the layer number under query-key layer
        scaling and its softmax multiplies it back; SDPA and flex take the product directly."""
        return self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling else 1)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        if attention_bias is not None:
            raise ValueError("packed (THD) attention takes no attention_bias; drop it or disable --hetu-packing")
        dropout = self.attention_dropout.p if self.training else 0.0
        cu = packed_seq_params.cu_seqlens_q
        if query.is_cuda and flex_packs.available() and dropout == 0.0:
            context = flex_packs.packed_flex_attention(query, key, value, cu, scale=self.net_scale)
        else:
            with self._rng():
                context = self._per_document(query, key, value, cu, dropout)
        return context.reshape(context.size(0), self.hidden_size_per_partition)  # (t, np*hn)

    def _rng(self):
        """Megatron's RNG for the attention dropout: the model-parallel tracker, except under sequence
        parallelism (``DotProductAttention.forward`` draws the same way)."""
        if self.config.sequence_parallel:
            return contextlib.nullcontext()
        return tensor_parallel.get_cuda_rng_tracker().fork()

    def _per_document(self, query, key, value, cu_seqlens, dropout: float) -> torch.Tensor:
        # (t, np, hn) -> per document (1, np, s_i, hn) -> causal SDPA -> (s_i, np, hn)
        gqa = query.size(1) != key.size(1)
        outputs = []
        for start, end in itertools.pairwise(cu_seqlens.tolist()):
            q, k, v = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout, is_causal=True, scale=self.net_scale, enable_gqa=gqa)
            outputs.append(out.squeeze(0).transpose(0, 1))
        return torch.cat(outputs, dim=0)


class ScoreFreeAttention(PackedDotProductAttention):
    """Core attention through SDPA for ``[s, b, np, hn]`` input (and :class:`PackedDotProductAttention`'s THD
    packs); Megatron's path only where :func:`megatron_path_reason` names a feature."""

    def __init__(self, config, layer_number: int, attn_mask_type, *args, **kwargs) -> None:
        cp = config.context_parallel_size
        if cp > 1:  # Megatron's DotProductAttention refuses CP; this class computes it (context_parallel.py)
            config = copy.copy(config)
            config.context_parallel_size = 1
        super().__init__(config, layer_number, attn_mask_type, *args, **kwargs)
        self.megatron_reason = megatron_path_reason(config, layer_number, attn_mask_type)
        self.cp_group = self.pg_collection.cp if cp > 1 else None
        """The stage's CP group at this rank's TP rank (context parallelism), else None."""
        if self.cp_group is not None and (self.megatron_reason is not None or attn_mask_type != AttnMaskType.causal):
            raise ValueError(f"context parallelism (cp {cp}) runs causal SDPA attention only; this layer needs "
                             f"{self.megatron_reason or f'attn_mask_type {attn_mask_type.name}'}: use cp 1")
        if self.megatron_reason is not None:
            _report_once(self.megatron_reason)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if self.cp_group is not None:
            return self._context_parallel(query, key, value, attention_mask, attention_bias,
                                          packed_seq_params.cu_seqlens_q if thd else None)
        if thd or self.megatron_reason is not None or attention_bias is not None:
            if attention_bias is not None and not thd:
                _report_once("attention_bias")
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        assert packed_seq_params is None, "sbhd PackedSeqParams: Megatron's DotProductAttention refuses them too"
        # Megatron's softmax masks where attention_mask is True; SDPA keeps where its mask is True. Without a
        # mask, a causal layer masks the future (Megatron's default causal mask)
        mask = None if attention_mask is None else ~attention_mask
        causal = attention_mask is None and self.attn_mask_type == AttnMaskType.causal
        dropout = self.attention_dropout.p if self.training else 0.0
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # (s, b, n, hn) -> (b, n, s, hn)
        with self._rng():
            context = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=self.net_scale,
                enable_gqa=q.size(1) != k.size(1))
        s, b = query.size(0), query.size(1)
        return context.permute(2, 0, 1, 3).reshape(s, b, self.hidden_size_per_partition)  # (s, b, np*hn)


    def _context_parallel(self, query, key, value, attention_mask, attention_bias, cu_seqlens):
        """This CP rank's chunks attending over the CP group's keys and values (context_parallel.py)."""
        if attention_mask is not None or attention_bias is not None:
            raise ValueError("context parallelism takes no attention mask or bias (causal attention, packs by "
                             "cu_seqlens); use cp 1")
        dropout = self.attention_dropout.p if self.training else 0.0
        with self._rng():
            context = context_parallel_attention(query, key, value, self.cp_group, scale=self.net_scale,
                                                 dropout=dropout, cu_seqlens=cu_seqlens)
        return context.reshape(*context.shape[:-2], self.hidden_size_per_partition)  # (s, b, np*hn) / (t, np*hn)


def core_attention(kind: str) -> type:
    """The core-attention class of ``--hetu-attention`` ``kind`` (:data:`CORE_ATTENTIONS`)."""
    if kind not in CORE_ATTENTIONS:
        raise ValueError(f"--hetu-attention {kind}: the core attentions are {', '.join(CORE_ATTENTIONS)}; "
                         f"give one of them")
    return ScoreFreeAttention if kind == "sdpa" else PackedDotProductAttention
