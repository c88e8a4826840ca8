"""The language-model loss over token chunks, so the ``[tokens, vocab / TP]`` fp32 logits are never held whole.

Megatron-core's GPTModel runs its output layer over the whole microbatch and hands the logits to the
vocab-parallel cross entropy, which keeps an fp32 ``[s, b, vocab / TP]`` softmax for backward: at 8K tokens and a
128K vocabulary that is 4 GiB per rank beside logits of the same size, more than a layer's every other activation.
``--hetu-loss-chunk-tokens C`` (:class:`ChunkedLossGPTModel`) computes the output layer and the cross entropy of
``C`` tokens of the rank's sequence at a time, each chunk under ``torch.utils.checkpoint``: the forward keeps only
the chunk's input and its per-token loss, the backward recomputes one chunk's logits and softmax at a time. Peak
memory of the loss: one chunk's ``C x b x vocab / TP`` fp32 tensors instead of the microbatch's; cost: the output
GEMM once more in backward (2 of the output layer's 6 FLOPs per weight and token).

Every chunk runs Megatron's own modules (``output_layer``, ``compute_language_model_loss``), so tensor
parallelism is unchanged: the output layer's input copy (all-reduce of its gradient over TP) or, under sequence
parallelism, its all-gather (reduce-scatter in backward), and the cross entropy's max / sum / target all-reduces,
each per chunk, on every TP rank in the same order. Under sequence parallelism rank ``r`` holds tokens
``[r s/TP, (r+1) s/TP)``; chunk ``[a, e)`` of every rank's slice gathers to the positions
``r s/TP + [a, e)`` (:func:`chunk_positions`), whose labels it takes and whose losses it returns in place.

``--hetu-loss-chunk-tokens auto`` (the default) chunks only where it pays: a microbatch whose fp32 logits
(``tokens x b x vocab / TP x 4`` bytes on the rank) exceed :data:`AUTO_LOGITS_BYTES` (1 GiB) runs chunks of that
size (:func:`resolve_chunk`); smaller ones (every CPU test, TinyLlama's 32K vocabulary at 4K tokens: 0.5 GiB) take
Megatron's path unchanged. At Llama 3's vocabulary (128,256) and 8K tokens, TP 1, that is 4 GiB of logits and as
much softmax in Megatron's path, one GiB of each in chunks of 2,048 tokens.

The loss of each token and every gradient equal the unchunked path's up to fp32 summation order (the output
weight's gradient is a sum over chunks; tests/test_chunked_loss.py: within 1e-6, TP 1 and TP 2 with and without
sequence parallelism).
"""

from __future__ import annotations

import functools

import torch
from megatron.core.models.gpt import GPTModel
from torch.utils.checkpoint import checkpoint


AUTO_LOGITS_BYTES = 2**30
"""``auto``: the most fp32 logits bytes a microbatch computes at once on a rank (one chunk's)."""


def parse_loss_chunk(setting: int | str) -> int | str:
    """``--hetu-loss-chunk-tokens``: ``auto`` or a token count >= 0 (0: no chunking); ValueError (one line)."""
    if setting == "auto":
        return "auto"
    try:
        tokens = int(setting)
    except (TypeError, ValueError):
        tokens = -1
    if tokens < 0:
        raise ValueError(f"--hetu-loss-chunk-tokens must be auto or a token count >= 0 (0: the whole microbatch), "
                         f"got {setting!r}")
    return tokens


def resolve_chunk(setting: int | str, tokens: int, batch: int, vocab_local: int, *, gathered: int = 1) -> int:
    """Tokens per chunk of a microbatch of ``tokens`` (the rank's sequence) x ``batch`` over ``vocab_local``
    vocabulary rows (``gathered``: TP under sequence parallelism, whose output layer gathers every rank's chunk);
    0 when it runs whole (``setting`` 0 or at least ``tokens``, or ``auto`` and its fp32 logits fit
    :data:`AUTO_LOGITS_BYTES`)."""
    if setting != "auto":
        return 0 if setting >= tokens else setting
    per_token = batch * vocab_local * 4 * gathered
    if tokens * per_token <= AUTO_LOGITS_BYTES:
        return 0
    return max(1, AUTO_LOGITS_BYTES // per_token)


def chunk_positions(start: int, end: int, local_tokens: int, tp: int, *, sequence_parallel: bool) -> list[int]:
    """Positions in the microbatch's sequence of chunk ``[start, end)`` of a rank's ``local_tokens`` tokens, as
    the output layer sees them: the chunk itself, or under sequence parallelism the chunk of each TP rank's
    slice, in rank order (the all-gather's)."""
    if not sequence_parallel or tp == 1:
        return list(range(start, end))
    return [r * local_tokens + i for r in range(tp) for i in range(start, end)]


def _chunk_loss(model: GPTModel, weight, labels: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    # hidden (c, b, h) -> logits (c[*tp], b, v/tp) -> loss (b, c[*tp])
    logits, _ = model.output_layer(hidden, weight=weight)
    return model.compute_language_model_loss(labels, logits)


def chunked_language_model_loss(model: GPTModel, hidden: torch.Tensor, labels: torch.Tensor,
                                chunk_tokens: int) -> torch.Tensor:
    """The per-token loss ``(b, s)`` of the microbatch whose last hidden states this rank holds (``hidden``:
    ``(s / TP under sequence parallelism, b, h)``; ``labels``: ``(b, s)``), ``chunk_tokens`` of the rank's tokens
    at a time, each chunk's logits recomputed in backward."""
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    layer = model.output_layer
    sequence_parallel = bool(layer.sequence_parallel)
    tp = layer.tp_group.size() if sequence_parallel else 1
    local = hidden.size(0)
    recompute = torch.is_grad_enabled()
    pieces, order = [], []
    for start in range(0, local, chunk_tokens):
        end = min(start + chunk_tokens, local)
        positions = chunk_positions(start, end, local, tp, sequence_parallel=sequence_parallel)
        chunk_labels = labels[:, start:end] if len(positions) == end - start else labels[:, positions]
        run = functools.partial(_chunk_loss, model, weight, chunk_labels)
        piece = checkpoint(run, hidden[start:end], use_reentrant=False, preserve_rng_state=False) if recompute \
            else run(hidden[start:end])
        pieces.append(piece)
        order += positions
    loss = torch.cat(pieces, dim=1)  # (b, s) in chunk order
    if order != sorted(order):  # sequence parallelism: put each token's loss back at its position
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[torch.tensor(order)] = torch.arange(len(order))
        loss = loss.index_select(1, inverse.to(loss.device))
    return loss


class ChunkedLossGPTModel(GPTModel):
    """Megatron-core's GPTModel whose training and evaluation loss (``labels`` given) runs over token chunks
    (:func:`chunked_language_model_loss`, the chunk of :func:`resolve_chunk`); a microbatch that runs whole,
    logits (no labels), multi-token prediction and inference take GPTModel's own path."""

    loss_chunk_tokens: int | str = "auto"

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, *args, **kwargs):
        chunk = 0
        if (labels is not None and self.post_process and not kwargs.get("mtp_in_postprocess")
                and self.config.mtp_num_layers is None and kwargs.get("inference_context") is None):
            layer = self.output_layer
            weight = layer.weight if layer.weight is not None else self.shared_embedding_or_output_weight()
            chunk = resolve_chunk(self.loss_chunk_tokens, hidden_states.size(0), hidden_states.size(1),
                                  weight.size(0), gathered=layer.tp_group.size() if layer.sequence_parallel else 1)
        if not chunk:
            return super()._postprocess(hidden_states, input_ids, position_ids, labels, *args, **kwargs)
        return chunked_language_model_loss(self, hidden_states, labels, chunk)


def gpt_model_class(loss_chunk_tokens: int | str) -> type:
    """GPTModel itself (0: the whole microbatch at once), or :class:`ChunkedLossGPTModel` (N or ``auto``; the
    builder sets its ``loss_chunk_tokens``)."""
    return ChunkedLossGPTModel if parse_loss_chunk(loss_chunk_tokens) else GPTModel
