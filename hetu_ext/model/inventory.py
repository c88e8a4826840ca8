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

Mixture of experts (``ModelSpec.num_experts``): an MoE layer's MLP is a router (``(E, h)``, every rank holds it)
and E experts, each an MLP of ``moe_ffn_hidden_size``; optional shared experts are a plain MLP beside them. An
expert tensor (:attr:`Param.experts` > 0) has a **global expert axis** after the layer's: its key and layer name E
tensors, indexed ``(layer, expert)``, as Megatron-core's sharded state dict numbers them. So a piece of it is
(expert range, rows, columns), and every parallelism is a layout of the same global tensors: expert parallelism
(EP) gives each EP rank a contiguous range of ``E / EP`` experts, expert tensor parallelism (ETP) splits each
expert's tensor by its ``split`` as TP splits a dense one (:func:`expert_box`), PP picks layers, DP and expert DP
replicate. Grouped GEMM (one ``(h, E_local F)`` weight per expert set) and per-expert weights store the same
global tensors (Megatron's grouped weights map to them transposed), so the inventory does not depend on it.

FLOPs count a multiply-add as 2. Attention counts the whole ``s x s`` square (what Megatron's local attention
and the cost models compute); backward is twice the forward.
"""

from __future__ import annotations

import dataclasses
import re
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
    """One tensor's shape (per layer, per expert)."""
    split: str
    init: str
    place: str
    experts: int = 0
    """> 0: an expert tensor, one per expert along a global expert axis of this length (after the layer axis);
    EP splits that axis, expert TP splits ``split``."""
    layers: str = "all"
    """For ``place == "layer"``: ``all`` (every layer: one stacked tensor, the global layer number its index), or a
    layer's number: a model whose layers differ (MoE and dense ones, ``moe_layer_freq``) keeps each layer's tensors
    apart, under keys with the layer's number (``decoder.layers.3.mlp.router.weight``), as Megatron-core does."""

    @property
    def numel(self) -> int:
        """Elements of one tensor (one layer, one expert)."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def index_axes(self) -> int:
        """Prepended axes of its key: the layer's (layer tensors), and the expert's (expert tensors)."""
        return (self.place == "layer" and self.layers == "all") + (self.experts > 0)

    @property
    def split_axis(self) -> int | None:
        return {"replicated": None, "columns": 1, "gated_rows": 1}.get(self.split, 0)


def _norm(key: str, h: int, spec: ModelSpec, place: str = "layer") -> list[Param]:
    out = [Param(f"{key}weight", (h,), "replicated", "ones", place)]
    if spec.normalization == "LayerNorm":
        out.append(Param(f"{key}bias", (h,), "replicated", "zeros", place))
    return out


def _mlp(prefix: str, f: int, spec: ModelSpec, *, layers: str, experts: int = 0) -> list[Param]:
    """An MLP of width ``f`` (a dense layer's, each expert's, the shared experts')."""
    h, bias = spec.hidden_size, spec.add_bias_linear
    fc1 = ((2, f), "gated_rows") if spec.swiglu else ((f,), "rows")
    out = [Param(f"{prefix}linear_fc1.weight", (*fc1[0], h), fc1[1], "normal", "layer", experts, layers)]
    if bias:
        out.append(Param(f"{prefix}linear_fc1.bias", fc1[0], fc1[1], "zeros", "layer", experts, layers))
    out.append(Param(f"{prefix}linear_fc2.weight", (h, f), "columns", "normal_output", "layer", experts, layers))
    if bias:
        out.append(Param(f"{prefix}linear_fc2.bias", (h,), "replicated", "zeros", "layer", experts, layers))
    return out


def _moe(prefix: str, spec: ModelSpec, *, layers: str) -> list[Param]:
    """An MoE layer's MLP: the router (weight, bias with linear biases, the aux-loss-free expert bias buffer), the
    experts (Megatron-core's sharded keys, ``experts.experts.``: SequentialMLP and the grouped MLPs alike), the shared experts and their gate."""
    h, e = spec.hidden_size, spec.num_experts
    out = [Param(f"{prefix}router.weight", (e, h), "replicated", "normal", "layer", 0, layers)]
    if spec.add_bias_linear:
        out.append(Param(f"{prefix}router.bias", (e,), "replicated", "normal", "layer", 0, layers))
    if spec.moe_router_enable_expert_bias:
        out.append(Param(f"{prefix}router.expert_bias", (e,), "replicated", "zeros", "layer", 0, layers))
    out += _mlp(f"{prefix}experts.experts.", spec.moe_ffn_hidden_size, spec, layers=layers, experts=e)
    if spec.moe_shared_expert_intermediate_size is not None:
        out += _mlp(f"{prefix}shared_experts.", spec.moe_shared_expert_intermediate_size, spec, layers=layers)
        if spec.moe_shared_expert_gate:
            out.append(Param(f"{prefix}shared_experts.gate_weight", (1, h), "replicated", "normal", "layer", 0,
                             layers))
    return out


def _layer(prefix: str, spec: ModelSpec, *, moe: bool, layers: str) -> list[Param]:
    """One transformer layer's tensors (its attention, its norms, its dense MLP or MoE) under ``prefix``."""
    h, bias = spec.hidden_size, spec.add_bias_linear
    heads, groups, d = spec.num_attention_heads, spec.num_query_groups, spec.kv_channels
    qkv_rows = (heads + 2 * groups) * d

    def param(key: str, shape: tuple[int, ...], split: str, init: str) -> Param:
        return Param(f"{prefix}{key}", shape, split, init, "layer", 0, layers)

    out = [dataclasses.replace(p, layers=layers) for p in _norm(f"{prefix}self_attention.linear_qkv.layer_norm_",
                                                                h, spec)]
    out.append(param("self_attention.linear_qkv.weight", (qkv_rows, h), "grouped_rows", "normal"))
    if bias or spec.add_qkv_bias:
        out.append(param("self_attention.linear_qkv.bias", (qkv_rows,), "grouped_rows", "zeros"))
    if spec.qk_layernorm:
        out += [dataclasses.replace(p, layers=layers) for p in _norm(f"{prefix}self_attention.q_layernorm.", d, spec)
                + _norm(f"{prefix}self_attention.k_layernorm.", d, spec)]
    out.append(param("self_attention.linear_proj.weight", (h, heads * d), "columns", "normal_output"))
    if bias:
        out.append(param("self_attention.linear_proj.bias", (h,), "replicated", "zeros"))
    out += [dataclasses.replace(p, layers=layers) for p in _norm(f"{prefix}mlp.linear_fc1.layer_norm_", h, spec)]
    if moe:
        return out + _moe(f"{prefix}mlp.", spec, layers=layers)
    return out + _mlp(f"{prefix}mlp.", spec.ffn_hidden_size, spec, layers=layers)


def parameters(spec: ModelSpec) -> list[Param]:
    """Every parameter of the whole model (tied output layer: no separate entry), Megatron-core's keys."""
    h, v = spec.hidden_size, spec.padded_vocab_size
    out = [Param("embedding.word_embeddings.weight", (v, h), "vocab_rows", "normal", "embedding")]
    if spec.position_embedding_type == "learned_absolute":
        out.append(Param("embedding.position_embeddings.weight", (spec.max_position_embeddings, h), "replicated",
                         "normal", "embedding"))
    moe = spec.moe_layers
    if len(set(moe)) == 1:  # every layer alike: one stacked tensor per key, the layer its index
        out += _layer("decoder.layers.", spec, moe=moe[0], layers="all")
    else:  # Megatron-core keeps layers of different kinds apart: the layer's number in the key
        for i, is_moe in enumerate(moe):
            out += _layer(f"decoder.layers.{i}.", spec, moe=is_moe, layers=str(i))
    out += _norm("decoder.final_layernorm.", h, spec, place="final")
    if spec.untie_embeddings_and_output_weights:
        out.append(Param("output_layer.weight", (v, h), "vocab_rows", "normal", "output"))
    return out


def copies(spec: ModelSpec, p: Param) -> int:
    """How many tensors of ``p`` the whole model holds (one per layer that holds it, times its experts)."""
    layers = spec.num_layers if p.layers == "all" else 1
    return (layers if p.place == "layer" else 1) * max(p.experts, 1)


def param_count(spec: ModelSpec) -> int:
    """Elements of the whole model (each layer's tensors once per layer, expert tensors once per expert)."""
    return sum(p.numel * copies(spec, p) for p in parameters(spec))


def active_param_count(spec: ModelSpec) -> int:
    """Elements a token passes through: every tensor but the experts', of which ``moe_router_topk`` (the rest of
    an MoE model's parameters are idle for that token)."""
    return sum(p.numel * copies(spec, p) // max(p.experts, 1) * (spec.moe_router_topk if p.experts else 1)
               for p in parameters(spec))


def expert_box(p: Param, *, ep: int, ep_rank: int, etp: int = 1, etp_rank: int = 0
               ) -> tuple[tuple[int, int], tuple[tuple[int, int], ...]]:
    """What EP rank ``ep_rank`` of ``ep`` and expert-TP rank ``etp_rank`` of ``etp`` hold of the expert tensor
    ``p``: (its expert range, its box of each expert's tensor). EP splits the expert axis in ``ep`` contiguous
    ranges; ETP cuts ``p.split`` as TP cuts a dense tensor (rows, columns; gated rows: both halves' rows).
    ValueError unless ``p`` is an expert tensor and both degrees divide what they split."""
    if p.experts <= 0:
        raise ValueError(f"{p.key}: not an expert tensor (it has no expert axis)")
    if p.experts % ep:
        raise ValueError(f"expert parallelism {ep} must divide the {p.experts} experts; use an EP degree that "
                         "divides --num-experts")
    per = p.experts // ep
    box = [(0, n) for n in p.shape]
    axis = p.split_axis
    if axis is not None and etp > 1:
        if p.shape[axis] % etp:
            raise ValueError(f"{p.key}: expert tensor parallelism {etp} must divide its axis {axis} "
                             f"({p.shape[axis]}); use an --expert-tensor-parallel-size that divides "
                             "--moe-ffn-hidden-size")
        part = p.shape[axis] // etp
        box[axis] = (etp_rank * part, (etp_rank + 1) * part)
    return (ep_rank * per, (ep_rank + 1) * per), tuple(box)


def layer_params(spec: ModelSpec, *, tp: int = 1) -> float:
    """Elements of one layer a rank of a TP-``tp`` stage holds (split tensors divided by ``tp``)."""
    split, replicated = layer_params_by_split(spec)
    return split / tp + replicated


def layer_params_by_split(spec: ModelSpec) -> tuple[int, int]:
    """(elements TP splits, elements every TP rank holds whole) of one layer (a dense model's: an MoE model's
    layers differ, and EP splits its experts)."""
    dense_only(spec, "the per-layer parameter count")
    layer = [p for p in parameters(spec) if p.place == "layer"]
    replicated = sum(p.numel for p in layer if p.split == "replicated")
    return sum(p.numel for p in layer) - replicated, replicated


def dense_only(spec: ModelSpec, what: str) -> None:
    """ValueError (one line) for an MoE model where ``what`` is defined for dense models only (the planners'
    per-layer figures: every layer alike, split by TP only)."""
    if spec.is_moe:
        raise ValueError(f"{what} of an MoE model (--num-experts {spec.num_experts}): hetu_ext's planners and trainer "
                         "build dense models only; plan MoE runs with `hetu-plan predict` or train them on "
                         "Megatron-LM's grid (python -m hetu_ext.megatron_lm)")


def final_norm_params(spec: ModelSpec) -> int:
    return sum(p.numel for p in parameters(spec) if p.place == "final")


def embedding_params(spec: ModelSpec) -> int:
    """Elements of the word embedding (and the position table); the output layer has ``padded_vocab_size x h``."""
    return sum(p.numel for p in parameters(spec) if p.place == "embedding")


_EVERY_OPTION = (
    ModelSpec(num_layers=1, hidden_size=8, num_attention_heads=2, untie_embeddings_and_output_weights=True,
              swiglu=True, qk_layernorm=True),
    ModelSpec(num_layers=1, hidden_size=8, num_attention_heads=2, swiglu=True, num_experts=2,
              moe_router_enable_expert_bias=True),
    ModelSpec(num_layers=1, hidden_size=8, num_attention_heads=2, add_bias_linear=False, num_experts=2,
              moe_shared_expert_intermediate_size=8, moe_shared_expert_gate=True),
)
"""Settings under which every key the inventory knows appears (LayerNorm and biases, qk norms, learned positions,
untied output, gated MLP; an MoE layer with router biases and biased experts; gated shared experts, which have no
biases): the key -> rule tables below are read from them."""
_LAYER_NUMBER = re.compile(r"^decoder\.layers\.\d+\.")


def _every_param() -> list[Param]:
    return [p for spec in _EVERY_OPTION for p in parameters(spec)]


def _rule_key(key: str) -> str:
    """A key without a layer's number (a model whose layers differ names each layer's tensors with it)."""
    return _LAYER_NUMBER.sub("decoder.layers.", key)


def init_rule(key: str) -> str:
    """How the parameter ``key`` is initialised (:data:`INITS`); ValueError for a key the inventory does not list."""
    rules = {p.key: p.init for p in _every_param()}
    key = _rule_key(key)
    if key not in rules:
        raise ValueError(f"{key}: not a parameter of the model inventory; add it to hetu_ext.model.inventory")
    return rules[key]


def keys_split_as(split: str) -> tuple[str, ...]:
    """Every key the inventory knows that TP splits as ``split`` (e.g. the vocabulary's rows, gated rows)."""
    return tuple(dict.fromkeys(p.key for p in _every_param() if p.split == split))


def split_of(key: str) -> str:
    """How TP splits the parameter ``key`` (:data:`SPLITS`)."""
    splits = {p.key: p.split for p in _every_param()}
    key = _rule_key(key)
    if key not in splits:
        raise ValueError(f"{key}: not a parameter of the model inventory; add it to hetu_ext.model.inventory")
    return splits[key]


# ---------------------------------------------------------------------------------------------------- FLOPs


def _mlp_flops_per_token(spec: ModelSpec, f: int) -> float:
    return 2.0 * spec.hidden_size * ((2 * f if spec.swiglu else f) + f)


def layer_matmul_flops_per_token(spec: ModelSpec, *, moe: bool = False) -> float:
    """Forward FLOPs per token of one layer's linear layers (QKV, projection, fc1, fc2). ``moe``: an MoE layer's,
    whose MLP is the router (``2 h E``), the ``moe_router_topk`` experts the token is routed to (the active
    experts) and the shared experts (and their gate)."""
    h = spec.hidden_size
    heads, groups, d = spec.num_attention_heads, spec.num_query_groups, spec.kv_channels
    attention = 2.0 * h * ((heads + 2 * groups) * d + heads * d)
    if not moe:
        return attention + _mlp_flops_per_token(spec, spec.ffn_hidden_size)
    mlp = 2.0 * h * spec.num_experts + spec.moe_router_topk * _mlp_flops_per_token(spec, spec.moe_ffn_hidden_size)
    if spec.moe_shared_expert_intermediate_size is not None:
        mlp += _mlp_flops_per_token(spec, spec.moe_shared_expert_intermediate_size)
        mlp += 2.0 * h if spec.moe_shared_expert_gate else 0.0
    return attention + mlp


def layer_gemms(spec: ModelSpec) -> list[tuple[str, int, int, int]]:
    """One layer's linear layers as ``(name, n, k, split)``: each is a GEMM of ``m = tokens`` rows, ``n`` output
    and ``k`` input features; ``split`` is the axis TP divides (1: n, column-parallel; 2: k, row-parallel). Their
    ``2 n k`` per token sum to :func:`layer_matmul_flops_per_token`."""
    h, f = spec.hidden_size, spec.ffn_hidden_size
    heads, groups, d = spec.num_attention_heads, spec.num_query_groups, spec.kv_channels
    fc1_rows = 2 * f if spec.swiglu else f
    dense_only(spec, "the per-layer GEMMs")
    return [("linear_qkv", (heads + 2 * groups) * d, h, 1), ("linear_proj", h, heads * d, 2),
            ("linear_fc1", fc1_rows, h, 1), ("linear_fc2", h, f, 2)]


def attention_flops_per_square_token(spec: ModelSpec, *, causal: bool = False) -> float:
    """Forward FLOPs of one layer's attention per (query, key) pair of the ``s x s`` square: scores and the
    weighted values. ``causal``: a kernel that skips the masked half (FlashAttention) does half of them."""
    return (2.0 if causal else 4.0) * spec.num_attention_heads * spec.kv_channels


def layer_forward_flops(spec: ModelSpec, *, tokens: float, sum_sq: float, causal: bool = False,
                        moe: bool = False) -> float:
    """Forward FLOPs of one layer for a microbatch of ``tokens`` tokens whose documents' squared lengths sum to
    ``sum_sq`` (each document attends to itself; a plain microbatch of b sequences of s: ``b s`` and ``b s^2``);
    ``moe``: an MoE layer (its active experts)."""
    return (tokens * layer_matmul_flops_per_token(spec, moe=moe)
            + sum_sq * attention_flops_per_square_token(spec, causal=causal))


def output_flops_per_token(spec: ModelSpec) -> float:
    """Forward FLOPs per token of the output layer (logits over the padded vocabulary)."""
    return 2.0 * spec.hidden_size * spec.padded_vocab_size


def training_flops_per_token(spec: ModelSpec, *, seq_length: float, causal: bool = False) -> float:
    """Forward + backward FLOPs per token of the whole model on sequences of ``seq_length`` tokens (3 x the
    forward; the embedding lookup counts nothing). ``causal=True`` is the convention of MFU figures (the model's
    necessary work: half the attention square)."""
    forward = sum(layer_forward_flops(spec, tokens=1.0, sum_sq=seq_length, causal=causal, moe=moe)
                  for moe in spec.moe_layers)
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
