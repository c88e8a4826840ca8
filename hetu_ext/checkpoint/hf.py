"""Export to a Hugging Face GPT-2 model directory (``config.json`` + ``model.safetensors``), from full tensors.

Megatron-core's GPT built by hetu_ext (learned absolute positions, LayerNorm, GeLU, biases, tied embeddings) is
GPT-2's architecture; only names and layouts differ:

* ``linear_qkv`` stores, per head, its query, key and value rows together ([heads, 3, head_dim] x hidden); GPT-2's
  ``c_attn`` holds all queries, then all keys, then all values, as a Conv1D (weights transposed).
* every other linear layer is transposed (Conv1D), layer norms and embeddings keep their shape;
* the vocabulary keeps Megatron's padding (``vocab_size`` = padded size).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .gated import is_gated
from .manifest import CheckpointError
from .selection import TensorId

_LAYER_MAP = {
    "self_attention.linear_qkv.layer_norm_weight": ("ln_1.weight", None),
    "self_attention.linear_qkv.layer_norm_bias": ("ln_1.bias", None),
    "self_attention.linear_proj.weight": ("attn.c_proj.weight", "t"),
    "self_attention.linear_proj.bias": ("attn.c_proj.bias", None),
    "mlp.linear_fc1.layer_norm_weight": ("ln_2.weight", None),
    "mlp.linear_fc1.layer_norm_bias": ("ln_2.bias", None),
    "mlp.linear_fc1.weight": ("mlp.c_fc.weight", "t"),
    "mlp.linear_fc1.bias": ("mlp.c_fc.bias", None),
    "mlp.linear_fc2.weight": ("mlp.c_proj.weight", "t"),
    "mlp.linear_fc2.bias": ("mlp.c_proj.bias", None),
}
_GLOBAL_MAP = {"embedding.word_embeddings.weight": "transformer.wte.weight",
               "embedding.position_embeddings.weight": "transformer.wpe.weight",
               "decoder.final_layernorm.weight": "transformer.ln_f.weight",
               "decoder.final_layernorm.bias": "transformer.ln_f.bias"}


def _qkv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[heads * 3 * head_dim, ...] per-head interleaved -> [3 * heads * head_dim, ...] (q block, k block, v block)."""
    rest = t.shape[1:]
    return t.reshape(heads, 3, t.shape[0] // (3 * heads), *rest).transpose(0, 1).reshape(t.shape[0], *rest)


def to_gpt2(params: dict[TensorId, torch.Tensor], *, num_attention_heads: int) -> tuple[dict, dict]:
    """``param/KEY`` full tensors -> (GPT-2 state dict, GPT-2 config). Untied output layers are refused."""
    out: dict[str, torch.Tensor] = {}
    layers = set()
    for (name, index), t in params.items():
        key = name.split("/", 1)[1]
        if is_gated(key, tuple(t.shape)):
            raise CheckpointError(f"{name}: a gated MLP weight (--swiglu); GPT-2's MLP is not gated, so this export "
                                  "does not apply to the model")
        if key in _GLOBAL_MAP:
            out[_GLOBAL_MAP[key]] = t.contiguous()
        elif key == "output_layer.weight":
            raise CheckpointError("the checkpoint has an untied output layer (--untie-embeddings-and-output-weights); "
                                  "GPT-2 ties it to the word embeddings, so this export does not apply")
        elif key.startswith("decoder.layers.") and key[len("decoder.layers."):] in _LAYER_MAP:
            hf, op = _LAYER_MAP[key[len("decoder.layers."):]]
            out[f"transformer.h.{index[0]}.{hf}"] = (t.t() if op == "t" else t).contiguous()
            layers.add(index[0])
        elif key.startswith("decoder.layers.self_attention.linear_qkv."):
            weight = key.endswith("weight")
            fused = _qkv(t, num_attention_heads)
            out[f"transformer.h.{index[0]}.attn.c_attn.{'weight' if weight else 'bias'}"] = \
                (fused.t() if weight else fused).contiguous()
            layers.add(index[0])
        else:
            raise CheckpointError(f"{name}: no GPT-2 counterpart; this export covers hetu_ext's GPT only")
    vocab, hidden = out["transformer.wte.weight"].shape
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": vocab, "n_embd": hidden,
              "n_layer": len(layers), "n_head": num_attention_heads,
              "n_inner": out["transformer.h.0.mlp.c_fc.weight"].shape[1],
              "n_positions": out["transformer.wpe.weight"].shape[0], "activation_function": "gelu",
              "layer_norm_epsilon": 1e-5, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
              "tie_word_embeddings": True, "bos_token_id": None, "eos_token_id": None}
    return out, config


def write_gpt2(directory: str, params: dict[TensorId, torch.Tensor], *, num_attention_heads: int) -> int:
    """Write ``config.json`` and ``model.safetensors`` into ``directory``; returns the number of tensors."""
    from safetensors.torch import save_file

    state, config = to_gpt2(params, num_attention_heads=num_attention_heads)
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return len(state)
