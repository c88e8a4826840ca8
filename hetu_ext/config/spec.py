"""The model a run's settings describe, as the inventory reads it (:class:`hetu_ext.model.ModelSpec`): from the
typed settings of a launch, or from the flags a checkpoint's manifest recorded (pure)."""

from __future__ import annotations

import dataclasses
from typing import Any

from hetu_ext.data.tokenizer import tokenizer_vocab_size
from hetu_ext.model.spec import ModelSpec

from .schema import DataConfig, ModelConfig, dest_of


def model_spec(model: ModelConfig, vocab_size: int) -> ModelSpec:
    """The model's settings as the inventory, the planners and the stage builder read them (built once per
    launch). Megatron-LM's defaults: with --swiglu and no --ffn-hidden-size each half is 8h/3 rounded down to a
    multiple of 64; --num-query-groups counts only with --group-query-attention."""
    ffn = model.ffn_hidden_size
    if ffn is None and model.swiglu:
        ffn = int(4 * model.hidden_size * 2 / 3 / 64) * 64
    return ModelSpec(num_layers=model.num_layers, hidden_size=model.hidden_size,
                     num_attention_heads=model.num_attention_heads, ffn_hidden_size=ffn,
                     vocab_size=vocab_size, seq_length=model.seq_length,
                     max_position_embeddings=model.max_position_embeddings,
                     untie_embeddings_and_output_weights=model.untie_embeddings_and_output_weights,
                     make_vocab_size_divisible_by=model.make_vocab_size_divisible_by,
                     normalization=model.normalization, swiglu=model.swiglu,
                     position_embedding_type=model.position_embedding_type,
                     num_query_groups=model.num_query_groups if model.group_query_attention else None,
                     kv_channels=model.kv_channels, add_bias_linear=not model.disable_bias_linear,
                     add_qkv_bias=model.add_qkv_bias, qk_layernorm=model.qk_layernorm,
                     norm_epsilon=model.norm_epsilon, rotary_base=model.rotary_base,
                     rotary_percent=model.rotary_percent, rope_scaling=model.use_rope_scaling,
                     rope_scaling_factor=model.rope_scaling_factor)


def _section_of(cls: type, flat: dict[str, Any], where: str):
    values = {}
    for f in dataclasses.fields(cls):
        if dest_of(f) in flat:
            value = flat[dest_of(f)]
            values[f.name] = tuple(value) if isinstance(value, list) else value
        elif f.metadata.get("required"):
            raise ValueError(f"{where} records no {dest_of(f)}; it was not saved by hetu_ext's trainer")
    return cls(**values)


def recorded_model_spec(flat: dict[str, Any], where: str) -> ModelSpec:
    """The model of a checkpoint from the flags its manifest recorded (``config``: flag destination -> value);
    settings it does not record take their defaults (a checkpoint older than the setting)."""
    model, data = _section_of(ModelConfig, flat, where), _section_of(DataConfig, flat, where)
    return model_spec(model, tokenizer_vocab_size(data.tokenizer_type, data.vocab_size))
