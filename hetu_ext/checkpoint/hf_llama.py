"""Hugging Face Llama-family checkpoints (Llama, Mistral, Qwen2; Mixtral and Qwen2-MoE, whose MoE layers are
:mod:`.hf_moe`'s) to and from hetu checkpoints, by the inventory.

A Hugging Face model directory (``config.json`` + ``model.safetensors`` or its shards) maps onto Megatron-core's
GPT with the local layer spec, tensor by tensor (no transformers import: its files are read directly):

* ``q_proj``, ``k_proj``, ``v_proj`` -> ``linear_qkv``, grouped rows ``[groups x (q heads per group + k + v) x
  head_dim]`` (and their biases for Qwen2);
* ``gate_proj``, ``up_proj`` -> the gated ``linear_fc1`` with its gate axis ``(2, F, h)`` (hetu_ext.checkpoint.gated);
* ``o_proj`` -> ``linear_proj``, ``down_proj`` -> ``linear_fc2``; ``input_layernorm`` / ``post_attention_layernorm``
  -> the layer's two norms (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``), ``norm`` ->
  ``final_layernorm``; ``embed_tokens`` / ``lm_head`` -> the word embedding / output layer, padded to the model's
  padded vocabulary (zero rows: padding carries nothing) and cut back on export.

Rotary embeddings need no permutation: Megatron-core's default RoPE rotates halves as Hugging Face's does.
An architecture or a setting this mapping does not cover is refused by name (one line), never approximated.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hetu_ext.model.spec import ModelSpec

from .hf_moe import MOE_ARCHITECTURES, moe_from_hf, moe_settings, moe_to_hf
from .manifest import CheckpointError

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", *MOE_ARCHITECTURES)
LLAMA3_SCALING = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
"""Llama 3.1's RoPE scaling as Megatron-core applies it (``--use-rope-scaling``: only the factor is a flag)."""


def _rope_scaling(config: dict) -> dict:
    """The RoPE scaling of a config ({} for none): transformers 4's ``rope_scaling``, 5's ``rope_parameters``."""
    scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
    return scaling if isinstance(scaling, dict) else {}
LAYER = "decoder.layers."


def read_config(directory: str | Path) -> dict:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{directory}: no config.json; give a Hugging Face model directory (save_pretrained)")
    config = json.loads(path.read_text())
    archs = config.get("architectures") or []
    if not archs or archs[0] not in ARCHITECTURES:
        raise CheckpointError(f"{directory}: architecture {archs[0] if archs else None!r} has no mapping here; "
                              f"supported: {', '.join(ARCHITECTURES)}")
    scaling = _rope_scaling(config)
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind not in (None, "default", "llama3"):
        raise CheckpointError(f"{directory}: rope scaling {kind!r} has no mapping here (default RoPE, or Llama "
                              "3.1's llama3 scaling)")
    if kind == "llama3":
        fixed = {k: scaling.get(k) for k in LLAMA3_SCALING}
        if fixed != LLAMA3_SCALING:
            raise CheckpointError(f"{directory}: llama3 rope scaling with {fixed}; Megatron-core's --use-rope-scaling "
                                  f"has {LLAMA3_SCALING} (only its factor is a flag)")
    if config.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{directory}: hidden_act {config.get('hidden_act')!r}; the gated MLP here is SwiGLU")
    return config


def spec_from_hf(config: dict, *, seq_length: int | None = None) -> ModelSpec:
    """The hetu_ext model settings of a Hugging Face Llama-family config."""
    h, heads = config["hidden_size"], config["num_attention_heads"]
    arch = config["architectures"][0]
    qwen2 = arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
    moe = moe_settings(config) if arch in MOE_ARCHITECTURES else {}
    theta = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    scaling = _rope_scaling(config)
    llama3 = (scaling.get("rope_type") or scaling.get("type")) == "llama3"
    max_pos = config.get("max_position_embeddings", 2048)
    return ModelSpec(num_layers=config["num_hidden_layers"], hidden_size=h, num_attention_heads=heads,
                     ffn_hidden_size=config["intermediate_size"], vocab_size=config["vocab_size"],
                     seq_length=seq_length or max_pos, max_position_embeddings=max_pos,
                     untie_embeddings_and_output_weights=not config.get("tie_word_embeddings", False),
                     normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
                     num_query_groups=config.get("num_key_value_heads", heads),
                     kv_channels=config.get("head_dim") or h // heads, add_bias_linear=False,
                     add_qkv_bias=bool(config.get("attention_bias", config.get("qkv_bias", qwen2))),
                     norm_epsilon=float(config.get("rms_norm_eps", 1e-6)), rotary_base=int(theta),
                     rope_scaling=llama3, rope_scaling_factor=float(scaling.get("factor", 8.0)) if llama3 else 8.0,
                     **moe)


def read_state(directory: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    root = Path(directory)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors weights (save_pretrained writes model.safetensors)")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t


def from_hf(state: dict[str, torch.Tensor], spec: ModelSpec, arch: str = "LlamaForCausalLM"
            ) -> dict[tuple[str, tuple[int, ...]], torch.Tensor]:
    """Hugging Face tensors -> hetu ``param/KEY`` full tensors (per layer; per layer and expert), fp32. Every HF
    tensor must be used. ``arch``: the config's architecture (an MoE one maps its MoE layers by :mod:`.hf_moe`)."""
    groups, d, heads = spec.num_query_groups, spec.kv_channels, spec.num_attention_heads
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in state:
            raise CheckpointError(f"the Hugging Face checkpoint has no {name}; it is not a {ARCHITECTURES} model")
        used.add(name)
        return state[name].float()

    def grouped(q, k, v):  # (heads*d, ...), (groups*d, ...) -> [groups x (q per group + 2) x d] rows
        rest = q.shape[1:]
        parts = (q.reshape(groups, heads // groups * d, *rest), k.reshape(groups, d, *rest),
                 v.reshape(groups, d, *rest))
        return torch.cat(parts, dim=1).reshape(-1, *rest)

    out = {("param/embedding.word_embeddings.weight", ()): _pad_rows(take("model.embed_tokens.weight"),
                                                                        spec.padded_vocab_size)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        attn = [take(f"{p}self_attn.{x}_proj.weight") for x in "qkv"]
        layer = {"self_attention.linear_qkv.layer_norm_weight": take(f"{p}input_layernorm.weight"),
                 "self_attention.linear_qkv.weight": grouped(*attn),
                 "self_attention.linear_proj.weight": take(f"{p}self_attn.o_proj.weight"),
                 "mlp.linear_fc1.layer_norm_weight": take(f"{p}post_attention_layernorm.weight")}
        if spec.is_moe:
            out.update(moe_from_hf(take, arch, p, i, spec.num_experts))
        else:
            layer.update({"mlp.linear_fc1.weight": torch.stack([take(f"{p}mlp.gate_proj.weight"),
                                                                take(f"{p}mlp.up_proj.weight")]),
                          "mlp.linear_fc2.weight": take(f"{p}mlp.down_proj.weight")})
        if spec.add_qkv_bias:
            layer["self_attention.linear_qkv.bias"] = grouped(*(take(f"{p}self_attn.{x}_proj.bias") for x in "qkv"))
        out.update({(f"param/{LAYER}{k}", (i,)): t for k, t in layer.items()})
    out[("param/decoder.final_layernorm.weight", ())] = take("model.norm.weight")
    if spec.untie_embeddings_and_output_weights:
        out[("param/output_layer.weight", ())] = _pad_rows(take("lm_head.weight"), spec.padded_vocab_size)
    left = sorted(set(state) - used - {"lm_head.weight"})
    if left:
        raise CheckpointError(f"the Hugging Face checkpoint holds {left[:3]} ({len(left)} tensors) that have no "
                              "mapping here; refusing to drop them")
    return out


def split_grouped_rows(t: torch.Tensor, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``linear_qkv`` rows ``[groups x (q heads per group + k + v) x head_dim]`` -> the rows of ``q_proj``,
    ``k_proj``, ``v_proj`` (a weight, a bias, or a LoRA B factor: any trailing shape)."""
    groups, d, qpg = spec.num_query_groups, spec.kv_channels, spec.num_attention_heads // spec.num_query_groups
    rest = t.shape[1:]
    g = t.reshape(groups, (qpg + 2) * d, *rest)
    return (g[:, :qpg * d].reshape(-1, *rest), g[:, qpg * d:(qpg + 1) * d].reshape(-1, *rest),
            g[:, (qpg + 1) * d:].reshape(-1, *rest))


def hf_config_of(spec: ModelSpec) -> dict:
    """The Hugging Face config of a model hetu_ext trained from scratch: ``LlamaForCausalLM``, or
    ``Qwen2ForCausalLM`` with a qkv bias. Settings neither architecture has are refused by name."""
    unmapped = [name for name, bad in (
        ("--swiglu missing (the MLP is not gated)", not spec.swiglu),
        (f"--normalization {spec.normalization}", spec.normalization != "RMSNorm"),
        (f"--position-embedding-type {spec.position_embedding_type}", spec.position_embedding_type != "rope"),
        (f"--rotary-percent {spec.rotary_percent}", spec.rotary_percent != 1.0),
        ("linear biases (no --disable-bias-linear)", spec.add_bias_linear),
        ("--qk-layernorm", spec.qk_layernorm),
        (f"--num-experts {spec.num_experts} (an MoE model keeps its Hugging Face config only when imported with "
         "import-hf)", spec.is_moe)) if bad]
    if unmapped:
        raise CheckpointError(f"the model has {unmapped[0]}, which {' / '.join(ARCHITECTURES)} cannot hold; "
                              "export it with --to safetensors instead")
    arch = "Qwen2ForCausalLM" if spec.add_qkv_bias else "LlamaForCausalLM"
    return {"architectures": [arch], "model_type": "qwen2" if spec.add_qkv_bias else "llama",
            "hidden_size": spec.hidden_size, "intermediate_size": spec.ffn_hidden_size,
            "num_attention_heads": spec.num_attention_heads, "num_key_value_heads": spec.num_query_groups,
            "head_dim": spec.kv_channels, "num_hidden_layers": spec.num_layers, "vocab_size": spec.vocab_size,
            "max_position_embeddings": spec.max_position_embeddings, "rms_norm_eps": spec.norm_epsilon,
            "rope_theta": float(spec.rotary_base), "hidden_act": "silu",
            "tie_word_embeddings": not spec.untie_embeddings_and_output_weights, "torch_dtype": "float32",
            **({"rope_scaling": {"rope_type": "llama3", "factor": spec.rope_scaling_factor, **LLAMA3_SCALING}}
               if spec.rope_scaling else {}),
            **({} if spec.add_qkv_bias else {"attention_bias": False, "mlp_bias": False})}


def to_hf(full: dict[tuple[str, tuple[int, ...]], torch.Tensor], spec: ModelSpec,
          arch: str = "LlamaForCausalLM") -> dict[str, torch.Tensor]:
    """hetu ``param/KEY`` full tensors -> Hugging Face tensors (the inverse of :func:`from_hf`)."""

    def split(t):
        return split_grouped_rows(t, spec)

    def get(key, index=()):
        t = full.get((f"param/{key}", index))
        if t is None:
            raise CheckpointError(f"the checkpoint has no param/{key}{list(index)}; it is not this model's")
        return t

    v = spec.vocab_size
    out = {"model.embed_tokens.weight": get("embedding.word_embeddings.weight")[:v],
           "model.norm.weight": get("decoder.final_layernorm.weight")}
    for i in range(spec.num_layers):
        p, L = f"model.layers.{i}.", (i,)
        q, k, vv = split(get(f"{LAYER}self_attention.linear_qkv.weight", L))
        out.update({f"{p}input_layernorm.weight": get(f"{LAYER}self_attention.linear_qkv.layer_norm_weight", L),
                    f"{p}self_attn.q_proj.weight": q, f"{p}self_attn.k_proj.weight": k,
                    f"{p}self_attn.v_proj.weight": vv,
                    f"{p}self_attn.o_proj.weight": get(f"{LAYER}self_attention.linear_proj.weight", L),
                    f"{p}post_attention_layernorm.weight": get(f"{LAYER}mlp.linear_fc1.layer_norm_weight", L)})
        if spec.is_moe:
            out.update(moe_to_hf(get, arch, p, i, spec.num_experts))
        else:
            fc1 = get(f"{LAYER}mlp.linear_fc1.weight", L)
            out.update({f"{p}mlp.gate_proj.weight": fc1[0], f"{p}mlp.up_proj.weight": fc1[1],
                        f"{p}mlp.down_proj.weight": get(f"{LAYER}mlp.linear_fc2.weight", L)})
        if spec.add_qkv_bias:
            qb, kb, vb = split(get(f"{LAYER}self_attention.linear_qkv.bias", L))
            out.update({f"{p}self_attn.q_proj.bias": qb, f"{p}self_attn.k_proj.bias": kb,
                        f"{p}self_attn.v_proj.bias": vb})
    if spec.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = get("output_layer.weight")[:v]
    return {k: t.contiguous() for k, t in out.items()}


def write_hf(directory: str | Path, state: dict[str, torch.Tensor], config: dict) -> int:
    """``config.json`` (the imported model's, kept) and ``model.safetensors``; returns the tensors written."""
    from safetensors.torch import save_file

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return len(state)
