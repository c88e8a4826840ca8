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
        if self.seq_length > self.max_position_embeddings:
            raise ValueError(f"model: seq_length ({self.seq_length}) exceeds max_position_embeddings "
                             f"({self.max_position_embeddings}); raise --max-position-embeddings")

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
