"""Each tenant's adapter in the PEFT format, for the Hugging Face GPT-2 export of the base (hetu_ext.checkpoint.hf).

A folder per tenant with ``adapter_config.json`` and ``adapter_model.safetensors`` that ``peft`` loads onto the
``GPT2LMHeadModel`` written by ``python -m hetu_ext.checkpoint convert CKPT DIR --to hf-gpt2`` (extra ``lora``
installs peft; writing needs only safetensors). The mapping of targets to GPT-2's Conv1D modules:

* ``qkv`` -> ``attn.c_attn``: B's rows reordered from Megatron's per-head [q, k, v] interleave to GPT-2's q, k, v
  blocks (the permutation the base export applies to the fused weight); A unchanged;
* ``proj`` -> ``attn.c_proj``, ``fc1`` -> ``mlp.c_fc``, ``fc2`` -> ``mlp.c_proj``.

PEFT's LoRA on a Conv1D keeps A as ``(r, in)`` and B as ``(out, r)`` like ours (``fan_in_fan_out`` only matters
when merging) and scales by ``lora_alpha / r``. The targets are a regular expression over the full module names,
since GPT-2 calls both attention's and the MLP's output projections ``c_proj``.

For a Llama-family model (the Hugging Face export of hetu_ext.checkpoint.hf_llama), a fused target becomes
several PEFT modules that share its A: ``qkv`` -> ``q_proj``, ``k_proj``, ``v_proj`` (B's grouped rows split as the
base weight's), ``fc1`` -> ``gate_proj``, ``up_proj`` (B's gate axis ``(2, F, r)``: its two halves); ``proj`` ->
``o_proj``, ``fc2`` -> ``down_proj``. ``B_q A x`` is the fused ``B A x``'s q rows, so the split is exact.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from hetu_ext.config.tenants import TenantSpec
from hetu_ext.model.spec import ModelSpec

_TARGET = {"qkv": "attn.c_attn", "proj": "attn.c_proj", "fc1": "mlp.c_fc", "fc2": "mlp.c_proj"}
_KEY = re.compile(r"^decoder\.layers\.(self_attention\.linear_qkv|self_attention\.linear_proj|mlp\.linear_fc1|"
                  r"mlp\.linear_fc2)\.lora_([AB])\.(.+)$")
_MODULE = {"self_attention.linear_qkv": "qkv", "self_attention.linear_proj": "proj", "mlp.linear_fc1": "fc1",
           "mlp.linear_fc2": "fc2"}


def qkv_rows_to_gpt2(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows ``[heads * 3 * head_dim]`` in Megatron's per-head (q, k, v) interleave -> GPT-2's all-q, all-k, all-v
    blocks (the order hetu_ext.checkpoint.hf gives the fused QKV weight)."""
    rest = t.shape[1:]
    return t.reshape(heads, 3, t.shape[0] // (3 * heads), *rest).transpose(0, 1).reshape(t.shape[0], *rest)


_LLAMA_TARGET = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "proj": ("self_attn.o_proj",),
                 "fc1": ("mlp.gate_proj", "mlp.up_proj"), "fc2": ("mlp.down_proj",)}


def _llama_family(spec: ModelSpec | None) -> bool:
    return spec is not None and spec.swiglu


def _layer_tensors(target: str, factor: str, t: torch.Tensor, num_attention_heads: int,
                   spec: ModelSpec | None) -> dict[str, torch.Tensor]:
    """One layer's factor of one target -> ``{Hugging Face module: tensor}``."""
    if not _llama_family(spec):
        if t.dim() != 2:  # (2, F, r): a gated fc1's B
            raise ValueError(f"a gated MLP's {target} adapter (--swiglu) has no GPT-2 layout; give the model's "
                             "spec to export the Llama family's")
        if target == "qkv" and factor == "B":
            t = qkv_rows_to_gpt2(t, num_attention_heads)
        return {f"transformer.h.{{layer}}.{_TARGET[target]}": t}
    from hetu_ext.checkpoint.hf_llama import split_grouped_rows

    modules = _LLAMA_TARGET[target]
    if factor == "A":
        parts = tuple(t.clone() for _ in modules)  # the fused module's A, one copy per module it becomes
    elif target == "qkv":
        parts = split_grouped_rows(t, spec)
    elif target == "fc1":
        parts = (t[0], t[1])  # the gate axis: gate rows, up rows
    else:
        parts = (t,)
    return {f"model.layers.{{layer}}.{m}": p for m, p in zip(modules, parts)}


def peft_state(adapters: dict[str, torch.Tensor], tenant: str, *, num_attention_heads: int,
               spec: ModelSpec | None = None) -> dict:
    """One tenant's PEFT state dict from gathered adapters (``decoder.layers.<module>.lora_A.<tenant>`` stacked
    over layers, hetu_ext.lora.adapters.gather_adapters): GPT-2's modules, or the Llama family's when ``spec`` is a
    gated (--swiglu) model."""
    out = {}
    for key, stacked in adapters.items():
        match = _KEY.match(key)
        if match is None or match.group(3) != tenant:
            continue
        target, factor = _MODULE[match.group(1)], match.group(2)
        for layer in range(stacked.shape[0]):
            for module, t in _layer_tensors(target, factor, stacked[layer], num_attention_heads, spec).items():
                out[f"base_model.model.{module.format(layer=layer)}.lora_{factor}.weight"] = t.contiguous().float()
    if not out:
        raise ValueError(f"no adapter of tenant {tenant!r} among the gathered tensors")
    return out


def peft_config(tenant: TenantSpec, base: str | None = None, spec: ModelSpec | None = None) -> dict:
    """adapter_config.json of a tenant: LoRA on GPT-2's Conv1D modules, or on the Llama family's Linear ones."""
    if _llama_family(spec):
        names = "|".join(re.escape(m) for t in tenant.lora.targets for m in _LLAMA_TARGET[t])
        target_modules, fan_in_fan_out = rf".*\.layers\.\d+\.({names})$", False
    else:
        names = "|".join(re.escape(_TARGET[t]) for t in tenant.lora.targets)
        target_modules, fan_in_fan_out = rf".*\.h\.\d+\.({names})$", True
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
            "r": tenant.lora.rank, "lora_alpha": tenant.lora.alpha, "lora_dropout": tenant.lora.dropout,
            "target_modules": target_modules, "fan_in_fan_out": fan_in_fan_out, "bias": "none",
            "inference_mode": True, "init_lora_weights": True, "use_rslora": False, "modules_to_save": None}


def write_peft(directory: str | Path, adapters: dict[str, torch.Tensor], tenant: TenantSpec, *,
               num_attention_heads: int, base: str | None = None, spec: ModelSpec | None = None) -> Path:
    """Write ``directory/adapter_config.json`` and ``adapter_model.safetensors`` for ``tenant`` (``spec``: the
    base model; a gated one is exported in the Llama family's layout)."""
    from safetensors.torch import save_file

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    save_file(peft_state(adapters, tenant.name, num_attention_heads=num_attention_heads, spec=spec),
              str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    (path / "adapter_config.json").write_text(json.dumps(peft_config(tenant, base, spec), indent=1))
    return path
