"""The adapters' global identity under any plan: keys, shards, layout-independent initial values, gathering.

An adapter tensor is named like Megatron's stacked layer tensors, ``decoder.layers.<path>.lora_A.<tenant>`` with
the *global* layer index, and its local data is a box of the global tensor (column B split by output rows, row A
split by input columns, the other factor whole). The same seed gives every tenant the same adapter under every
TP / PP / DP layout (A from a generator seeded by seed, tenant, key and layer; B zero, as PEFT initialises).
"""

from __future__ import annotations

import math
import re
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .layers import Adapters, lora_layers

_LAYER = re.compile(r"(?:^|\.)decoder\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class AdapterShard:
    """One local adapter tensor: ``global[index][slices] == param``."""

    key: str
    """``decoder.layers.<module path>.lora_A.<tenant>`` (no layer number)."""
    index: tuple[int, ...]
    """(global layer,)"""
    slices: tuple[slice, ...]
    shape: tuple[int, ...]
    """Global shape of the tensor."""
    tenant: str
    param: torch.nn.Parameter
    data: torch.Tensor | None = None
    """``param`` in the box's shape where they differ: a gated fc1's B, ``(2, f, r)`` (gate rows, up rows: its
    TP rank holds ``[gate_r; up_r]``, as the base weight, hetu_ext.checkpoint.gated); None: ``param`` itself."""

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (shaped like ``param``: its gradient, a moment) in the box's shape."""
        return tensor if self.data is None else tensor.view(self.data.shape)


def _tp_rank(adapters: Adapters, module) -> int:
    group = getattr(module, "tp_group", None)
    return group.rank() if group is not None and adapters.tp > 1 else 0


def adapter_shards(model: torch.nn.Module, *, layer_offset: int = 0) -> list[AdapterShard]:
    """Every adapter tensor of a stage model, with its global key, layer and box."""
    out = []
    modules = dict(model.named_modules())
    for name, adapters in lora_layers(model):
        match = _LAYER.search(name)
        if match is None:
            raise ValueError(f"LoRA layer {name!r} is not inside decoder.layers.N")
        layer, path = int(match.group(1)) + layer_offset, match.group(2)
        path = path[: -len(".lora")] if path.endswith(".lora") else path
        linear = modules[name[: -len(".lora")]] if name.endswith(".lora") else None
        tp, rank = adapters.tp, _tp_rank(adapters, linear)
        for tenant in adapters.settings:
            a, b = adapters.lora_A[tenant], adapters.lora_B[tenant]
            b_data = None
            if adapters.kind == "column" and _gated(linear):  # B's rows are [gate_r; up_r]: (2, f, r) boxes
                a_shape, a_sl = tuple(a.shape), (slice(0, a.shape[0]), slice(0, a.shape[1]))
                f = b.shape[0] // 2
                b_data = b.view(2, f, b.shape[1])
                b_shape = (2, f * tp, b.shape[1])
                b_sl = (slice(0, 2), slice(rank * f, (rank + 1) * f), slice(0, b.shape[1]))
            elif adapters.kind == "column":  # A (r, in) whole; B (out, r) split by rows
                a_shape, a_sl = tuple(a.shape), (slice(0, a.shape[0]), slice(0, a.shape[1]))
                b_shape = (b.shape[0] * tp, b.shape[1])
                b_sl = (slice(rank * b.shape[0], (rank + 1) * b.shape[0]), slice(0, b.shape[1]))
            else:  # row: A (r, in) split by columns; B (out, r) whole
                a_shape = (a.shape[0], a.shape[1] * tp)
                a_sl = (slice(0, a.shape[0]), slice(rank * a.shape[1], (rank + 1) * a.shape[1]))
                b_shape, b_sl = tuple(b.shape), (slice(0, b.shape[0]), slice(0, b.shape[1]))
            out.append(AdapterShard(f"decoder.layers.{path}.lora_A.{tenant}", (layer,), a_sl, a_shape, tenant, a))
            out.append(AdapterShard(f"decoder.layers.{path}.lora_B.{tenant}", (layer,), b_sl, b_shape, tenant, b,
                                    b_data))
    return out


def _gated(linear) -> bool:
    """A gated MLP's fc1 (--swiglu): its output rows on each TP rank are [gate_r; up_r]."""
    return bool(getattr(linear, "lora_gated", False))


def initial_adapter(key: str, index: tuple[int, ...], shape: tuple[int, ...], *, seed: int) -> torch.Tensor:
    """A: uniform in +-1/sqrt(in) (PEFT's kaiming_uniform(a=sqrt(5)) bound); B: zero."""
    if ".lora_B." in key:
        return torch.zeros(shape)
    generator = torch.Generator().manual_seed(
        (seed * 1_000_003 + zlib.crc32(key.encode()) * 10_007 + sum(i * 31 ** k for k, i in enumerate(index)))
        % (2**63))
    bound = 1.0 / math.sqrt(shape[1])
    return (torch.rand(shape, generator=generator) * 2 - 1) * bound


@torch.no_grad()
def init_adapters(model: torch.nn.Module, *, seed: int, layer_offset: int = 0) -> int:
    """Set every adapter of a stage model to its layout-independent initial value; returns the elements set."""
    count = 0
    for s in adapter_shards(model, layer_offset=layer_offset):
        s.view(s.param).copy_(initial_adapter(s.key, s.index, s.shape, seed=seed)[s.slices])
        count += s.param.numel()
    return count


def gather_adapters(model: torch.nn.Module | None, *, layer_offset: int = 0, values: dict | None = None
                    ) -> dict[str, torch.Tensor]:
    """Full fp32 adapter tensors by key (stacked over layers), on every rank; copies must agree bit for bit.
    ``values`` (parameter id -> tensor of its shape) gathers those instead (e.g. Adam moments). Collective over
    the world; ranks holding nothing pass ``model=None``."""
    from hetu_ext.megatron.weights import assemble

    values = values or {}
    mine = [(s.key, s.index, s.slices, s.shape, s.view(values.get(id(s.param), s.param)).detach().float().cpu().clone())
            for s in adapter_shards(model, layer_offset=layer_offset)] if model is not None else []
    everyone: list = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
    if dist.is_initialized():
        dist.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    return assemble(p for part in everyone for p in part)
