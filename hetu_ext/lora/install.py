"""Install tenants' adapters into the stage models hetu_ext builds, through Megatron-core's layer spec.

:class:`LoRAConverter` is the model converter the plan runtime's stage builder takes
(``hetu_ext.megatron.model.build_gpt_stage(converter=...)``); for every stage model it

1. rewrites a copy of the transformer-layer spec, replacing the local spec's ``linear_qkv``,
   ``linear_proj``, ``linear_fc1``, ``linear_fc2`` (checked to be 0.16.1's ColumnParallelLinear and
   RowParallelLinear) by :mod:`hetu_ext.lora.layers`' LoRA linears, each given the tenants that target it;
2. freezes every base parameter (``requires_grad=False``), before DistributedDataParallel and the optimizer
   are built, so the base gets no gradient buffer and no optimizer state;
3. sets each adapter to its layout-independent initial value (:func:`hetu_ext.lora.adapters.init_adapters`,
   the stage's global layer offset given here).

Nothing of Megatron-core is patched.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from hetu_ext.config.tenants import TenantSpec

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
        params = {"lora_tenants": mine, "lora_routing": routing, **({"lora_slot": target} if kind == "column" else {})}
        setattr(owner, slot, ModuleSpec(module=lora, params=params))
    return spec


@dataclass
class LoRAConverter:
    """The model converter that gives stage models tenants' adapters over a frozen base (the ``converter`` of
    hetu_ext.megatron.model.build_gpt_stage, as torchtitan's model converters: chosen where the command line is
    read, applied by the core's stage builder without it knowing LoRA)."""

    tenants: tuple[TenantSpec, ...]
    seed: int

    def layer_spec(self, layer_spec):
        """1: the spec's four linears become LoRA linears (a fresh routing per model built)."""
        from .layers import TenantRouting

        self._routing = TenantRouting()
        return _lora_spec(layer_spec, self.tenants, self._routing)

    def convert(self, model: torch.nn.Module, *, layer_offset: int) -> None:
        """2 and 3: freeze the base (before DDP and the optimizer exist), initialise the adapters."""
        from .adapters import init_adapters

        model.lora_routing = self._routing
        for name, param in model.named_parameters():
            if ".lora." not in f".{name}":
                param.requires_grad_(False)
        init_adapters(model, seed=self.seed, layer_offset=layer_offset)


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
