"""Install tenants' adapters into the stage models hetu_ext builds, through Megatron-core's layer spec.

:func:`installed` is a context manager around the plan runtime's model building: while it is open, one probed,
removable patch (patches/base.py) makes ``megatron.core.models.gpt.GPTModel`` (the name
``hetu_ext.megatron.model.build_gpt_stage`` resolves when it builds) a subclass that

1. rewrites a copy of the transformer-layer spec it receives, replacing the local spec's ``linear_qkv``,
   ``linear_proj``, ``linear_fc1``, ``linear_fc2`` (checked to be 0.16.1's ColumnParallelLinear and
   RowParallelLinear) by :mod:`hetu_ext.lora.layers`' LoRA linears, each given the tenants that target it;
2. freezes every base parameter (``requires_grad=False``), before DistributedDataParallel and the optimizer
   are built, so the base gets no gradient buffer and no optimizer state;
3. sets each adapter to its layout-independent initial value (:func:`hetu_ext.lora.adapters.init_adapters`,
   the stage's global layer offset given here).

No other target is touched, and the patch is removed when the context closes.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch

from .tenants import TenantSpec

_SLOTS = (("self_attention", "linear_qkv", "qkv", "column"), ("self_attention", "linear_proj", "proj", "row"),
          ("mlp", "linear_fc1", "fc1", "column"), ("mlp", "linear_fc2", "fc2", "row"))
"""(submodule, linear slot, target name, kind) of a transformer layer's spec."""


def _lora_spec(layer_spec, tenants: tuple[TenantSpec, ...], routing):
    """A copy of ``layer_spec`` whose four linears are LoRA linears (the tenants targeting each)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    from hetu_ext.patches.base import PatchError

    from .layers import LoRAColumnParallelLinear, LoRARowParallelLinear

    spec = copy.deepcopy(layer_spec)
    expected = {"column": (ColumnParallelLinear, LoRAColumnParallelLinear),
                "row": (RowParallelLinear, LoRARowParallelLinear)}
    for part, slot, target, kind in _SLOTS:
        subs = spec.submodules
        owner = getattr(getattr(subs, part, None), "submodules", None)
        current = getattr(owner, slot, None)
        base, lora = expected[kind]
        if current is not base:
            raise PatchError(f"LoRA: the layer spec's {part}.{slot} is {current!r}, not Megatron-core 0.16.1's "
                             f"{base.__name__}; hetu_ext.lora supports the local layer spec of 0.16.1")
        mine = tuple((k, t.name, t.lora) for k, t in enumerate(tenants) if target in t.lora.targets)
        setattr(owner, slot, ModuleSpec(module=lora, params={"lora_tenants": mine, "lora_routing": routing}))
    return spec


def _lora_model_class(original, tenants: tuple[TenantSpec, ...], *, seed: int, layer_offset: int):
    from .adapters import init_adapters
    from .layers import TenantRouting

    class LoRAGPTModel(original):
        """Megatron-core's GPTModel with tenants' adapters in every layer and its base frozen."""

        def __init__(self, config, transformer_layer_spec, *args, **kwargs):
            routing = TenantRouting()
            super().__init__(config, _lora_spec(transformer_layer_spec, tenants, routing), *args, **kwargs)
            self.lora_routing = routing
            for name, param in self.named_parameters():
                if ".lora." not in f".{name}":
                    param.requires_grad_(False)
            init_adapters(self, seed=seed, layer_offset=layer_offset)

    LoRAGPTModel.__qualname__ = LoRAGPTModel.__name__ = "LoRAGPTModel"
    return LoRAGPTModel


@contextlib.contextmanager
def installed(tenants: tuple[TenantSpec, ...], *, seed: int, layer_offset: int) -> Iterator[None]:
    """While open, stage models built by hetu_ext carry ``tenants``' adapters over a frozen base."""
    from hetu_ext.patches.base import Patch

    patch = Patch(name="lora-gpt-model", target="megatron.core.models.gpt:GPTModel",
                  make=lambda original: _lora_model_class(original, tenants, seed=seed, layer_offset=layer_offset),
                  reason="Megatron-core 0.16.1 has no LoRA: the stage model's linears get tenants' adapters")
    patch.apply()
    try:
        yield
    finally:
        patch.remove()


def routing_of(model: torch.nn.Module):
    """The TenantRouting of a (wrapped) LoRA stage model."""
    module = model
    while not hasattr(module, "lora_routing") and hasattr(module, "module"):
        module = module.module
    return module.lora_routing


def frozen_report(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable elements, frozen elements) of a stage model."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return trainable, frozen
