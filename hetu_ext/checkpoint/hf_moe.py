"""Hugging Face Mixtral and Qwen2-MoE: their MoE layers to and from Megatron-core's (the attention, norms and
embeddings are the Llama family's, :mod:`.hf_llama`).

Per layer ``i`` (``model.layers.i.``), what ``save_pretrained`` writes -> hetu_ext's keys (the expert index after
the layer's: :mod:`hetu_ext.model.inventory`'s global expert axis):

* the router: Mixtral's ``block_sparse_moe.gate``, Qwen2-MoE's ``mlp.gate`` (``(E, h)``) -> ``mlp.router.weight``;
* expert ``e``: Mixtral's ``w1`` (gate), ``w3`` (up), ``w2`` (down); Qwen2-MoE's ``gate_proj``, ``up_proj``,
  ``down_proj`` -> ``mlp.experts.experts.linear_fc1.weight[i, e]`` ``(2, F, h)`` (gate, up) and ``linear_fc2``;
* Qwen2-MoE's shared expert (``mlp.shared_expert.*``) -> ``mlp.shared_experts.linear_fc1`` / ``linear_fc2`` and its
  sigmoid gate ``mlp.shared_expert_gate`` -> ``mlp.shared_experts.gate_weight``.

Routing: Mixtral renormalises the top-k of a softmax over all experts, which is Megatron-core's softmax over the
top-k logits (its default); Qwen2-MoE with ``norm_topk_prob: false`` takes the top-k of the softmax as they are,
which is Megatron-core's ``--moe-router-pre-softmax``. A setting with no Megatron-core counterpart here (router
jitter, Qwen2-MoE's dense layers between MoE ones) is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .manifest import CheckpointError

MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM")
LAYER = "decoder.layers."
EXPERTS = f"{LAYER}mlp.experts.experts."
SHARED = f"{LAYER}mlp.shared_experts."


def moe_settings(config: dict) -> dict:
    """The ModelSpec MoE settings of a Mixtral or Qwen2-MoE config; CheckpointError for what has no mapping."""
    arch = config["architectures"][0]
    if arch == "MixtralForCausalLM":
        if config.get("router_jitter_noise"):
            raise CheckpointError(f"Mixtral router_jitter_noise {config['router_jitter_noise']}: Megatron-core's "
                                  "router has no jitter of this form; set it to 0")
        return {"num_experts": config["num_local_experts"], "moe_router_topk": config["num_experts_per_tok"],
                "moe_ffn_hidden_size": config["intermediate_size"]}
    if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
        raise CheckpointError(f"Qwen2-MoE with dense layers (mlp_only_layers {config.get('mlp_only_layers')}, "
                              f"decoder_sparse_step {config.get('decoder_sparse_step')}) has no mapping here; every "
                              "layer must be an MoE layer")
    return {"num_experts": config["num_experts"], "moe_router_topk": config["num_experts_per_tok"],
            "moe_ffn_hidden_size": config["moe_intermediate_size"],
            "moe_shared_expert_intermediate_size": config["shared_expert_intermediate_size"],
            "moe_shared_expert_gate": True, "moe_router_pre_softmax": not config.get("norm_topk_prob", False)}


def _names(arch: str, p: str, e: int) -> tuple[str, str, str]:
    """Expert ``e``'s gate, up and down projections in layer prefix ``p``."""
    if arch == "MixtralForCausalLM":
        return tuple(f"{p}block_sparse_moe.experts.{e}.{w}.weight" for w in ("w1", "w3", "w2"))
    return tuple(f"{p}mlp.experts.{e}.{w}_proj.weight" for w in ("gate", "up", "down"))


def _router(arch: str, p: str) -> str:
    return f"{p}block_sparse_moe.gate.weight" if arch == "MixtralForCausalLM" else f"{p}mlp.gate.weight"


def moe_from_hf(take: Callable[[str], torch.Tensor], arch: str, p: str, i: int, num_experts: int
                ) -> dict[tuple[str, tuple[int, ...]], torch.Tensor]:
    """Layer ``i``'s MoE tensors (``take`` reads one Hugging Face tensor and marks it used)."""
    out = {(f"param/{LAYER}mlp.router.weight", (i,)): take(_router(arch, p))}
    for e in range(num_experts):
        gate, up, down = (take(n) for n in _names(arch, p, e))
        out[(f"param/{EXPERTS}linear_fc1.weight", (i, e))] = torch.stack([gate, up])
        out[(f"param/{EXPERTS}linear_fc2.weight", (i, e))] = down
    if arch == "Qwen2MoeForCausalLM":
        s = f"{p}mlp.shared_expert."
        out[(f"param/{SHARED}linear_fc1.weight", (i,))] = torch.stack([take(f"{s}gate_proj.weight"),
                                                                       take(f"{s}up_proj.weight")])
        out[(f"param/{SHARED}linear_fc2.weight", (i,))] = take(f"{s}down_proj.weight")
        out[(f"param/{SHARED}gate_weight", (i,))] = take(f"{p}mlp.shared_expert_gate.weight")
    return out


def moe_to_hf(get: Callable[..., torch.Tensor], arch: str, p: str, i: int, num_experts: int
              ) -> dict[str, torch.Tensor]:
    """The inverse of :func:`moe_from_hf` for layer ``i`` (``get(key, index)`` reads a hetu tensor)."""
    out = {_router(arch, p): get(f"{LAYER}mlp.router.weight", (i,))}
    for e in range(num_experts):
        gate, up, down = _names(arch, p, e)
        fc1 = get(f"{EXPERTS}linear_fc1.weight", (i, e))
        out.update({gate: fc1[0], up: fc1[1], down: get(f"{EXPERTS}linear_fc2.weight", (i, e))})
    if arch == "Qwen2MoeForCausalLM":
        s, fc1 = f"{p}mlp.shared_expert.", get(f"{SHARED}linear_fc1.weight", (i,))
        out.update({f"{s}gate_proj.weight": fc1[0], f"{s}up_proj.weight": fc1[1],
                    f"{s}down_proj.weight": get(f"{SHARED}linear_fc2.weight", (i,)),
                    f"{p}mlp.shared_expert_gate.weight": get(f"{SHARED}gate_weight", (i,))})
    return out
