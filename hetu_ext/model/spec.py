"""A decoder-only model's settings, in Megatron-LM's terms (pure: no torch); the inventory (.inventory) derives
every parameter, FLOP and byte from them."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer, in Megatron-LM's terms."""

    num_layers: int
    """Transformer layers (``--num-layers``)."""
    hidden_size: int
    """Model width (``--hidden-size``)."""
    num_attention_heads: int
    """Attention heads (``--num-attention-heads``); every TP degree must divide it."""
    ffn_hidden_size: int | None = None
    """MLP width (``--ffn-hidden-size``); defaults to 4 x hidden_size, as in Megatron-LM."""
    vocab_size: int = 256
    """Vocabulary size before padding, in tokens."""
    seq_length: int = 128
    """Tokens per sample (``--seq-length``)."""
    max_position_embeddings: int | None = None
    """Learned position table size; defaults to seq_length."""
    untie_embeddings_and_output_weights: bool = False
    """Megatron-LM's ``--untie-embeddings-and-output-weights``: separate output layer weights."""
    normalization: str = "LayerNorm"
    """``--normalization``: LayerNorm (weight and bias) or RMSNorm (weight only)."""
    swiglu: bool = False
    """``--swiglu``: a gated MLP (``linear_fc1`` holds the gate and up projections, ``2 x ffn_hidden_size`` rows)."""
    position_embedding_type: str = "learned_absolute"
    """``--position-embedding-type``: learned_absolute (a position table), rope or none (no parameters)."""
    num_query_groups: int | None = None
    """``--num-query-groups`` (grouped-query attention); None: one per head (multi-head attention)."""
    kv_channels: int | None = None
    """``--kv-channels``: the head dimension; None: hidden_size / num_attention_heads."""
    add_bias_linear: bool = True
    """Biases on every linear layer (``--disable-bias-linear`` turns them off)."""
    add_qkv_bias: bool = False
    """``--add-qkv-bias``: a bias on linear_qkv even without the other biases (Qwen2)."""
    qk_layernorm: bool = False
    """``--qk-layernorm``: a norm over each query and key head."""
    norm_epsilon: float = 1e-5
    """``--norm-epsilon``."""
    rotary_base: int = 10000
    """``--rotary-base`` (RoPE only)."""
    rotary_percent: float = 1.0
    """``--rotary-percent`` (RoPE only)."""
    rope_scaling: bool = False
    """``--use-rope-scaling``: Llama 3.1's frequency scaling (Megatron-core's: low/high frequency factors 1 and 4
    over an original context of 8,192 tokens)."""
    rope_scaling_factor: float = 8.0
    """``--rope-scaling-factor``."""
    num_experts: int | None = None
    """``--num-experts``: experts of each MoE layer's MLP (None: a dense model)."""
    moe_router_topk: int = 2
    """``--moe-router-topk``: experts each token is routed to."""
    moe_ffn_hidden_size: int | None = None
    """``--moe-ffn-hidden-size``: each expert's MLP width; defaults to ffn_hidden_size, as in Megatron-LM."""
    moe_layer_freq: int | tuple[int, ...] = 1
    """``--moe-layer-freq``: every N-th layer is an MoE layer (layer i when ``i % N == 0``), or a pattern of 1s (MoE)
    and 0s (dense), one per layer."""
    moe_shared_expert_intermediate_size: int | None = None
    """``--moe-shared-expert-intermediate-size``: the shared experts' MLP width, all of them together (None: none)."""
    moe_shared_expert_gate: bool = False
    """``--moe-shared-expert-gate``: a sigmoid gate ``(1, h)`` on the shared experts' output (Qwen2-MoE)."""
    moe_router_enable_expert_bias: bool = False
    """``--moe-router-enable-expert-bias``: the router's per-expert bias buffer (aux-loss-free balancing)."""
    moe_router_pre_softmax: bool = False
    """``--moe-router-pre-softmax``: the top-k of a softmax over every expert, not renormalised (Qwen2-MoE's
    ``norm_topk_prob: false``); default: a softmax over the top-k logits (Mixtral's). Routing only: no state."""
    moe_grouped_gemm: bool = False
    """``--moe-grouped-gemm``: one weight per expert set instead of one per expert. Storage only: both are the same
    global expert tensors (the inventory's keys and shapes do not change)."""

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        if self.max_position_embeddings is None:
            object.__setattr__(self, "max_position_embeddings", self.seq_length)
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size",
                     "seq_length", "max_position_embeddings", "make_vocab_size_divisible_by"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model: {name} must be a positive integer, got {value!r}; "
                                 f"set --{name.replace('_', '-')} to a value >= 1")
        if self.num_query_groups is None:
            object.__setattr__(self, "num_query_groups", self.num_attention_heads)
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads == 0:
            object.__setattr__(self, "kv_channels", self.hidden_size // self.num_attention_heads)
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"model: normalization must be LayerNorm or RMSNorm, got {self.normalization!r}")
        if self.position_embedding_type not in ("learned_absolute", "rope", "none"):
            raise ValueError(f"model: position_embedding_type must be learned_absolute, rope or none, got "
                             f"{self.position_embedding_type!r}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"model: num_query_groups ({self.num_query_groups}) must divide num_attention_heads "
                             f"({self.num_attention_heads}); set --num-query-groups to a divisor")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"model: num_attention_heads must divide hidden_size, got hidden_size="
                             f"{self.hidden_size}, num_attention_heads={self.num_attention_heads}; choose a head "
                             "count that divides the hidden size")
        self._check_moe()
        if self.seq_length > self.max_position_embeddings:
            raise ValueError(f"model: seq_length ({self.seq_length}) exceeds max_position_embeddings "
                             f"({self.max_position_embeddings}); raise --max-position-embeddings")

    def _check_moe(self) -> None:
        if self.num_experts is None:
            return
        if self.moe_ffn_hidden_size is None:
            object.__setattr__(self, "moe_ffn_hidden_size", self.ffn_hidden_size)
        for name in ("num_experts", "moe_router_topk", "moe_ffn_hidden_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model: {name} must be a positive integer, got {value!r}; "
                                 f"set --{name.replace('_', '-')} to a value >= 1")
        if self.moe_router_topk > self.num_experts:
            raise ValueError(f"model: moe_router_topk ({self.moe_router_topk}) exceeds num_experts "
                             f"({self.num_experts}); route each token to at most --num-experts experts")
        if self.moe_shared_expert_intermediate_size is not None and self.add_bias_linear:
            raise ValueError("model: shared experts (--moe-shared-expert-intermediate-size) have no biases in "
                             "Megatron-core; add --disable-bias-linear")
        freq = self.moe_layer_freq
        if isinstance(freq, list):
            object.__setattr__(self, "moe_layer_freq", freq := tuple(freq))
        if isinstance(freq, tuple):
            if len(freq) != self.num_layers or set(freq) - {0, 1}:
                raise ValueError(f"model: moe_layer_freq {list(freq)} must hold one 0 (dense) or 1 (MoE) per layer "
                                 f"({self.num_layers}); give --moe-layer-freq as a pattern of {self.num_layers}")
        elif not isinstance(freq, int) or isinstance(freq, bool) or freq < 1:
            raise ValueError(f"model: moe_layer_freq must be a positive integer or a 0/1 pattern, got {freq!r}")

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """Per layer (global number), whether it is an MoE layer (Megatron-core's ``moe_layer_freq`` rule)."""
        if self.num_experts is None:
            return (False,) * self.num_layers
        freq = self.moe_layer_freq
        if isinstance(freq, tuple):
            return tuple(bool(x) for x in freq)
        return tuple(i % freq == 0 for i in range(self.num_layers))

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this (Megatron-LM's flag of the same name)."""

    @property
    def padded_vocab_size(self) -> int:
        """Vocabulary padded to ``make_vocab_size_divisible_by``.

        Megatron-LM pads to a multiple of divisible_by x TP, so the embedding's shape changes with the layout. Here
        it does not: one padded shape for every plan, so weights move between any two layouts unchanged; a plan's
        TP degrees must divide it instead (checked by Plan.validate).
        """
        multiple = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // multiple) * multiple

    def to_dict(self) -> dict:
        return asdict(self)
