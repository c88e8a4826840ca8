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
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from .tenants import TenantSpec

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


def peft_state(adapters: dict[str, torch.Tensor], tenant: str, *, num_attention_heads: int) -> dict:
    """One tenant's PEFT state dict from gathered adapters (``decoder.layers.<module>.lora_A.<tenant>`` stacked
    over layers, hetu_ext.lora.adapters.gather_adapters)."""
    out = {}
    for key, stacked in adapters.items():
        match = _KEY.match(key)
        if match is None or match.group(3) != tenant:
            continue
        target, factor = _MODULE[match.group(1)], match.group(2)
        if stacked.dim() != 3:  # (layers, 2, F, r): a gated fc1's B (--swiglu)
            raise ValueError(f"{key}: a gated MLP's adapter (--swiglu); this export writes GPT-2's PEFT layout, "
                             "whose MLP is not gated")
        for layer in range(stacked.shape[0]):
            t = stacked[layer]
            if target == "qkv" and factor == "B":
                t = qkv_rows_to_gpt2(t, num_attention_heads)
            name = f"base_model.model.transformer.h.{layer}.{_TARGET[target]}.lora_{factor}.weight"
            out[name] = t.contiguous().float()
    if not out:
        raise ValueError(f"no adapter of tenant {tenant!r} among the gathered tensors")
    return out


def peft_config(tenant: TenantSpec, base: str | None = None) -> dict:
    """adapter_config.json of a tenant (LoRA on GPT-2's Conv1D modules)."""
    names = "|".join(re.escape(_TARGET[t]) for t in tenant.lora.targets)
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
            "r": tenant.lora.rank, "lora_alpha": tenant.lora.alpha, "lora_dropout": tenant.lora.dropout,
            "target_modules": rf".*\.h\.\d+\.({names})$", "fan_in_fan_out": True, "bias": "none",
            "inference_mode": True, "init_lora_weights": True, "use_rslora": False, "modules_to_save": None}


def write_peft(directory: str | Path, adapters: dict[str, torch.Tensor], tenant: TenantSpec, *,
               num_attention_heads: int, base: str | None = None) -> Path:
    """Write ``directory/adapter_config.json`` and ``adapter_model.safetensors`` for ``tenant``."""
    from safetensors.torch import save_file

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    save_file(peft_state(adapters, tenant.name, num_attention_heads=num_attention_heads),
              str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    (path / "adapter_config.json").write_text(json.dumps(peft_config(tenant, base), indent=1))
    return path
