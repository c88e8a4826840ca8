"""The model inventory (pure): every parameter a model's settings produce, and per-layer FLOPs and bytes.

One list, read by everything that needs the model's structure: the parameters under Megatron-core's keys (as
``hetu_ext.megatron.weights.local_shards`` names them) with their global shape, how tensor parallelism splits them
and how they are initialised; per layer, the forward FLOPs of a microbatch and the activation bytes per token;
the one rule for which TP degrees a model admits. Checked against the real thing in tests/test_inventory.py:
the parameter count equals the built Megatron-core model's, the FLOPs are within 2% of
``torch.utils.flop_counter.FlopCounterMode`` on a forward and backward.

Splits (how TP degree ``t`` cuts a tensor; the rank's box is contiguous in each case):

* ``replicated``: every rank holds all of it (norms, biases of row-parallel layers, position table);
* ``rows`` / ``columns``: axis 0 / 1 in ``t`` equal parts (column- / row-parallel linears);
* ``vocab_rows``: rows of the padded vocabulary (rows past the tokenizer's ids are padding);
* ``grouped_rows``: GQA's ``linear_qkv``, ``[groups x (q heads per group + 2) x head_dim]`` rows: TP splits whole
  groups, so ``t`` must divide the query groups;
* ``gated_rows``: a gated MLP's ``linear_fc1`` with a leading gate axis ``(2, F, ...)`` (gate, up): axis 1 is
  split (``hetu_ext.checkpoint.gated``).

FLOPs count a multiply-add as 2. Attention counts the whole ``s x s`` square (what Megatron's local attention
and the cost models compute); backward is twice the forward.
"""

from __future__ import annotations

from dataclasses import dataclass

from .spec import ModelSpec

SPLITS = ("replicated", "rows", "columns", "vocab_rows", "grouped_rows", "gated_rows")
INITS = ("ones", "zeros", "normal", "normal_output")
"""``normal``: N(0, std); ``normal_output``: N(0, std / sqrt(2 num_layers)) (output projections of each layer)."""
PLACES = ("embedding", "layer", "final", "output")


@dataclass(frozen=True)
class Param:
    """One global tensor (one per layer for ``place == "layer"``: the key is shared, the layer is its index)."""

    key: str
    shape: tuple[int, ...]
    split: str
    init: str
    place: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def split_axis(self) -> int | None:
        return {"replicated": None, "columns": 1, "gated_rows": 1}.get(self.split, 0)


def _norm(key: str, h: int, spec: ModelSpec, place: str = "layer") -> list[Param]:
    out = [Param(f"{key}weight", (h,), "replicated", "ones", place)]
    if spec.normalization == "LayerNorm":
        out.append(Param(f"{key}bias", (h,), "replicated", "zeros", place))
    return out


def parameters(spec: ModelSpec) -> list[Param]:
    """Every parameter of the whole model (tied output layer: no separate entry), Megatron-core's keys."""
    h, f, v = spec.hidden_size, spec.ffn_hidden_size, spec.padded_vocab_size
    heads, groups, d = spec.num_attention_heads, spec.num_query_groups, spec.kv_channels
    bias = spec.add_bias_linear
    qkv_rows = (heads + 2 * groups) * d
    out = [Param("embedding.word_embeddings.weight", (v, h), "vocab_rows", "normal", "embedding")]
    if spec.position_embedding_type == "learned_absolute":
        out.append(Param("embedding.position_embeddings.weight", (spec.max_position_embeddings, h), "replicated",
                         "normal", "embedding"))
    layer = "decoder.layers."
    out += _norm(f"{layer}self_attention.linear_qkv.layer_norm_", h, spec)
    out.append(Param(f"{layer}self_attention.linear_qkv.weight", (qkv_rows, h), "grouped_rows", "normal", "layer"))
    if bias or spec.add_qkv_bias:
        out.append(Param(f"{layer}self_attention.linear_qkv.bias", (qkv_rows,), "grouped_rows", "zeros", "layer"))
    if spec.qk_layernorm:
        out += _norm(f"{layer}self_attention.q_layernorm.", d, spec) + _norm(f"{layer}self_attention.k_layernorm.",
                                                                             d, spec)
    out.append(Param(f"{layer}self_attention.linear_proj.weight", (h, heads * d), "columns", "normal_output",
                     "layer"))
    if bias:
        out.append(Param(f"{layer}self_attention.linear_proj.bias", (h,), "replicated", "zeros", "layer"))
    out += _norm(f"{layer}mlp.linear_fc1.layer_norm_", h, spec)
    fc1 = ((2, f), "gated_rows") if spec.swiglu else ((f,), "rows")
    out.append(Param(f"{layer}mlp.linear_fc1.weight", (*fc1[0], h), fc1[1], "normal", "layer"))
    if bias:
        out.append(Param(f"{layer}mlp.linear_fc1.bias", fc1[0], fc1[1], "zeros", "layer"))
    out.append(Param(f"{layer}mlp.linear_fc2.weight", (h, f), "columns", "normal_output", "layer"))
    if bias:
        out.append(Param(f"{layer}mlp.linear_fc2.bias", (h,), "replicated", "zeros", "layer"))
    out += _norm("decoder.final_layernorm.", h, spec, place="final")
    if spec.untie_embeddings_and_output_weights:
        out.append(Param("output_layer.weight", (v, h), "vocab_rows", "normal", "output"))
    return out


def param_count(spec: ModelSpec) -> int:
    """Elements of the whole model (each layer's tensors once per layer)."""
    return sum(p.numel * (spec.num_layers if p.place == "layer" else 1) for p in parameters(spec))


def layer_params(spec: ModelSpec, *, tp: int = 1) -> float:
    """Elements of one layer a rank of a TP-``tp`` stage holds (split tensors divided by ``tp``)."""
    split, replicated = layer_params_by_split(spec)
    return split / tp + replicated


def layer_params_by_split(spec: ModelSpec) -> tuple[int, int]:
    """(elements TP splits, elements every TP rank holds whole) of one layer."""
    layer = [p for p in parameters(spec) if p.place == "layer"]
    replicated = sum(p.numel for p in layer if p.split == "replicated")
    return sum(p.numel for p in layer) - replicated, replicated


def final_norm_params(spec: ModelSpec) -> int:
    return sum(p.numel for p in parameters(spec) if p.place == "final")


def embedding_params(spec: ModelSpec) -> int:
    """Elements of the word embedding (and the position table); the output layer has ``padded_vocab_size x h``."""
    return sum(p.numel for p in parameters(spec) if p.place == "embedding")


_EVERY_OPTION = ModelSpec(num_layers=1, hidden_size=8, num_attention_heads=2, untie_embeddings_and_output_weights=True,
                          swiglu=True, qk_layernorm=True)
"""Settings under which every key the inventory knows appears (LayerNorm and biases, qk norms, learned positions,
untied output, gated MLP): the key -> rule tables below are read from it."""


def init_rule(key: str) -> str:
    """How the parameter ``key`` is initialised (:data:`INITS`); ValueError for a key the inventory does not list."""
    rules = {p.key: p.init for p in parameters(_EVERY_OPTION)}
    if key not in rules:
        raise ValueError(f"{key}: not a parameter of the model inventory; add it to hetu_ext.model.inventory")
    return rules[key]


def keys_split_as(split: str) -> tuple[str, ...]:
    """Every key the inventory knows that TP splits as ``split`` (e.g. the vocabulary's rows, gated rows)."""
    return tuple(p.key for p in parameters(_EVERY_OPTION) if p.split == split)


def split_of(key: str) -> str:
    """How TP splits the parameter ``key`` (:data:`SPLITS`)."""
    splits = {p.key: p.split for p in parameters(_EVERY_OPTION)}
    if key not in splits:
        raise ValueError(f"{key}: not a parameter of the model inventory; add it to hetu_ext.model.inventory")
    return splits[key]


# ---------------------------------------------------------------------------------------------------- FLOPs


def layer_matmul_flops_per_token(spec: ModelSpec) -> float:
    """Forward FLOPs per token of one layer's linear layers (QKV, projection, fc1, fc2)."""
    h, f = spec.hidden_size, spec.ffn_hidden_size
    heads, groups, d = spec.num_attention_heads, spec.num_query_groups, spec.kv_channels
    fc1_rows = 2 * f if spec.swiglu else f
    return 2.0 * h * ((heads + 2 * groups) * d + heads * d + fc1_rows + f)


def layer_gemms(spec: ModelSpec) -> list[tuple[str, int, int, int]]:
    """One layer's linear layers as ``(name, n, k, split)``: each is a GEMM of ``m = tokens`` rows, ``n`` output
    and ``k`` input features; ``split`` is the axis TP divides (1: n, column-parallel; 2: k, row-parallel). Their
    ``2 n k`` per token sum to :func:`layer_matmul_flops_per_token`."""
    h, f = spec.hidden_size, spec.ffn_hidden_size
    heads, groups, d = spec.num_attention_heads, spec.num_query_groups, spec.kv_channels
    fc1_rows = 2 * f if spec.swiglu else f
    return [("linear_qkv", (heads + 2 * groups) * d, h, 1), ("linear_proj", h, heads * d, 2),
            ("linear_fc1", fc1_rows, h, 1), ("linear_fc2", h, f, 2)]


def attention_flops_per_square_token(spec: ModelSpec, *, causal: bool = False) -> float:
    """Forward FLOPs of one layer's attention per (query, key) pair of the ``s x s`` square: scores and the
    weighted values. ``causal``: a kernel that skips the masked half (FlashAttention) does half of them."""
    return (2.0 if causal else 4.0) * spec.num_attention_heads * spec.kv_channels


def layer_forward_flops(spec: ModelSpec, *, tokens: float, sum_sq: float, causal: bool = False) -> float:
    """Forward FLOPs of one layer for a microbatch of ``tokens`` tokens whose documents' squared lengths sum to
    ``sum_sq`` (each document attends to itself; a plain microbatch of b sequences of s: ``b s`` and ``b s^2``)."""
    return (tokens * layer_matmul_flops_per_token(spec)
            + sum_sq * attention_flops_per_square_token(spec, causal=causal))


def output_flops_per_token(spec: ModelSpec) -> float:
    """Forward FLOPs per token of the output layer (logits over the padded vocabulary)."""
    return 2.0 * spec.hidden_size * spec.padded_vocab_size


def training_flops_per_token(spec: ModelSpec, *, seq_length: float, causal: bool = False) -> float:
    """Forward + backward FLOPs per token of the whole model on sequences of ``seq_length`` tokens (3 x the
    forward; the embedding lookup counts nothing). ``causal=True`` is the convention of MFU figures (the model's
    necessary work: half the attention square)."""
    forward = spec.num_layers * layer_forward_flops(spec, tokens=1.0, sum_sq=seq_length, causal=causal)
    return 3.0 * (forward + output_flops_per_token(spec))


# ---------------------------------------------------------------------------------------------------- memory


def activation_bytes_per_token(spec: ModelSpec, *, tp: int = 1, seq_length: float = 0.0,
                               attention_scores: bool = True, sequence_parallel: bool = False,
                               recompute: str = "none") -> float:
    """Bytes one layer keeps per token for its backward at 2-byte activations (Korthikanti et al., 2022, section 4,
    generalised to GQA and gated MLPs): inputs of the norms, linears and activation, dropout masks (1 byte), and
    with ``attention_scores`` the softmax's ``5 a s`` (scores, mask, dropout output: an attention that materialises
    them; a fused one does not). Tensors TP splits count ``1 / tp``. For GPT (f = 4h, a = g) this is
    ``h (10 + 24 / tp) + 5 a s / tp``.

    ``sequence_parallel``: the ``10 h`` TP does not split (norms, dropouts, the inputs of QKV and fc1) is split
    along the sequence too: everything counts ``1 / tp``. ``recompute`` (:data:`RECOMPUTE`): ``"selective"``
    recomputes the attention core, so the ``5 a s`` term is not kept; ``"full"`` keeps only the layer's input,
    ``2 h`` (``2 h / tp`` under sequence parallelism), and recomputes the rest in the backward."""
    check_recompute(recompute)
    sp = tp if sequence_parallel else 1
    if recompute == "full":
        return 2.0 * spec.hidden_size / sp
    h, f = spec.hidden_size, spec.ffn_hidden_size
    heads, groups, d = spec.num_attention_heads, spec.num_query_groups, spec.kv_channels
    fc1_rows = 2 * f if spec.swiglu else f
    replicated = 2 * h + 2 * h + 2 * h + 2 * h + h + h  # two norms' inputs, qkv and fc1 inputs, two dropout masks
    split = 2 * heads * d + 2 * 2 * groups * d + 2 * heads * d + 2 * fc1_rows + 2 * f  # Q, K, V, proj, fc1, act
    scores = 5.0 * heads * seq_length if attention_scores and recompute == "none" else 0.0
    return replicated / sp + (split + scores) / tp


RECOMPUTE = ("none", "selective", "full")
"""Activation recomputation (Megatron-LM's ``--recompute-granularity``; ``none``: not given)."""


def check_recompute(recompute: str) -> None:
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")


def layer_recompute_flops(spec: ModelSpec, *, tokens: float, sum_sq: float, recompute: str,
                          causal: bool = False) -> float:
    """FLOPs one layer's backward spends recomputing its forward for a microbatch (``tokens``, ``sum_sq`` as in
    :func:`layer_forward_flops`): ``full`` the whole forward again, ``selective`` the attention core (scores and
    weighted values), ``none`` nothing."""
    check_recompute(recompute)
    if recompute == "full":
        return layer_forward_flops(spec, tokens=tokens, sum_sq=sum_sq, causal=causal)
    if recompute == "selective":
        return sum_sq * attention_flops_per_square_token(spec, causal=causal)
    return 0.0


# ---------------------------------------------------------------------------------------------------- rules


def tp_problems(spec: ModelSpec, tp: int) -> list[tuple[str, int]]:
    """The model's dimensions that tensor parallelism of degree ``tp`` cannot split, as (name, size); empty: it
    can. The one rule: each split dimension divisible by ``tp`` (the query groups for GQA: whole groups per rank)."""
    sizes = (("num_attention_heads", spec.num_attention_heads), ("num_query_groups", spec.num_query_groups),
             ("ffn_hidden_size", spec.ffn_hidden_size), ("padded vocab size", spec.padded_vocab_size))
    return [(name, size) for name, size in sizes if size % tp]


def check_tp(spec: ModelSpec, tp: int, *, where: str = "") -> None:
    """Raise ValueError (one line) unless ``tp`` splits the model."""
    problems = tp_problems(spec, tp)
    if problems:
        what = ", ".join(f"{name} ({size})" for name, size in problems)
        raise ValueError(f"{where}TP degree {tp} must divide {what}; use a TP degree that divides each")
