"""Multi-tenant LoRA on Megatron-core's ColumnParallelLinear and RowParallelLinear (0.16.1).

Each layer holds one adapter per tenant that targets it; every token carries its tenant's index
(:class:`TenantRouting`), so one pass over the frozen base serves every tenant of a packed microbatch:
``y = W x + sum_t [token is t's] (alpha_t / r_t) B_t A_t dropout(x)``.

Tensor parallelism without new activation communication (``p`` = TP degree):

* column (W split by output rows): A ``(r, in)`` replicated, B ``(out / p, r)`` split by output like W. Both the
  base and the adapter read the same input, and their input gradients (each a partial sum over this rank's
  output slice) are added *before* the layer's one all-reduce of the input gradient (we route the input through
  ``copy_to_tensor_model_parallel_region`` and build the base layer with ``disable_grad_reduce``, the seam
  Megatron-core keeps for adapters).
* row (W split by input columns): A ``(r, in / p)`` split by input like W, B ``(out, r)`` replicated; the adapter's
  output is a partial sum added to the base's partial output before the layer's all-reduce.

The replicated factor's gradient (column A, row B) is a partial sum on each TP rank (it sees one slice of the
other factor); :func:`partial_grads` lists them and the trainer sums them over the TP group with the step's
gradient reduction (``r x hidden`` elements per layer and tenant).

The adapters stay out of ``sharded_state_dict`` (the base model's checkpoints and layout-independent
initialisation do not see them); :mod:`hetu_ext.lora.adapters` gives them their global identity.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

from hetu_ext.config.tenants import LoRASettings


class TenantRouting:
    """Which tenant each token of the current microbatch belongs to; shared by every LoRA layer of a model.

    ``set(ids)`` before the model's forward (ids ``(b, s)`` of tenant indices, the batch's layout); layers see
    tokens in Megatron's ``(s, b)`` order. Backward needs nothing from here (autograd kept the indices).
    """

    def __init__(self) -> None:
        self.flat: torch.Tensor | None = None
        self.index: dict[int, torch.Tensor] = {}
        self.only: int | None = None

    def set(self, ids: torch.Tensor) -> None:
        flat = ids.t().reshape(-1)  # (b, s) -> (s * b,), Megatron's hidden-state order
        self.flat = flat
        present = torch.unique(flat).tolist()
        self.only = int(present[0]) if len(present) == 1 else None
        self.index = {} if self.only is not None else {int(t): torch.nonzero(flat == t).view(-1) for t in present}


class Adapters(torch.nn.Module):
    """One layer's adapters: ``lora_A[name]`` ``(r, in_local)``, ``lora_B[name]`` ``(out_local, r)``."""

    def __init__(self, tenants: list[tuple[int, str, LoRASettings]], in_local: int, out_local: int, *,
                 kind: str, tp: int, routing: TenantRouting, dtype: torch.dtype) -> None:
        super().__init__()
        self.kind, self.tp, self.routing = kind, tp, routing
        self.lora_A = torch.nn.ParameterDict()
        self.lora_B = torch.nn.ParameterDict()
        self.settings: dict[str, LoRASettings] = {}
        self.index_of: dict[int, str] = {}
        for index, name, settings in tenants:
            self.lora_A[name] = torch.nn.Parameter(torch.zeros(settings.rank, in_local, dtype=dtype))
            self.lora_B[name] = torch.nn.Parameter(torch.zeros(out_local, settings.rank, dtype=dtype))
            for adapter in (self.lora_A[name], self.lora_B[name]):  # not the base's: lora/checkpoint.py saves them
                adapter.hetu_saved_apart = "LoRA adapter"
            split = self.lora_B[name] if kind == "column" else self.lora_A[name]
            split.tensor_model_parallel, split.partition_dim, split.partition_stride = True, \
                (0 if kind == "column" else 1), 1
            self.settings[name], self.index_of[index] = settings, name

    def _one(self, name: str, x: torch.Tensor) -> torch.Tensor:
        s = self.settings[name]
        if s.dropout and self.training:
            x = F.dropout(x, p=s.dropout)
        return F.linear(F.linear(x, self.lora_A[name]), self.lora_B[name]) * s.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """The adapters' output for input ``x`` ``(s, b, in_local)``, or None when no token has an adapter here."""
        r = self.routing
        if r.flat is None:
            raise RuntimeError("LoRA layer called before TenantRouting.set(tenant_ids) (the forward step sets it)")
        shape = x.shape[:-1]
        if r.only is not None:
            name = self.index_of.get(r.only)
            return None if name is None else self._one(name, x)
        flat = x.reshape(-1, x.shape[-1])  # (s * b, in_local)
        out = None
        for t, idx in r.index.items():
            name = self.index_of.get(t)
            if name is None:
                continue
            y = self._one(name, flat.index_select(0, idx))
            if out is None:
                out = flat.new_zeros(flat.shape[0], y.shape[-1])
            out = out.index_add(0, idx, y)
        return None if out is None else out.view(*shape, -1)


def _add(base: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
    return base if delta is None else base + delta


class LoRAColumnParallelLinear(ColumnParallelLinear):
    """ColumnParallelLinear with tenants' adapters; built by the LoRA layer spec (hetu_ext.lora.install)."""

    def __init__(self, *args, lora_tenants=(), lora_routing: TenantRouting | None = None, lora_slot: str = "",
                 **kwargs) -> None:
        kwargs["disable_grad_reduce"] = True  # the input gradient is all-reduced once, in forward's region below
        super().__init__(*args, **kwargs)
        if self.gather_output:
            raise NotImplementedError("LoRA on a ColumnParallelLinear with gather_output is not supported")
        self.lora_gated = lora_slot == "fc1" and bool(self.config.gated_linear_unit)
        """A gated MLP's fc1: each TP rank's output rows (and B's rows) are [gate_r; up_r] (lora/adapters.py)."""
        tp = self.tp_group.size() if self.tp_group is not None else 1
        self.lora = Adapters(list(lora_tenants), self.input_size, self.output_size_per_partition, kind="column",
                             tp=tp, routing=lora_routing, dtype=self.weight.dtype)

    def forward(self, input_, weight=None, runtime_gather_output=None):
        if self.lora.tp > 1:  # identity forward; backward: one all-reduce of base + adapter input gradients
            input_ = copy_to_tensor_model_parallel_region(input_, group=self.tp_group)
        return super().forward(input_, weight, runtime_gather_output)

    def _forward_impl(self, input, weight, *args, **kwargs):  # noqa: A002 (Megatron's keyword)
        return _add(super()._forward_impl(input, weight, *args, **kwargs), self.lora(input))

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return _without_lora(super().sharded_state_dict(prefix, sharded_offsets, metadata))


class LoRARowParallelLinear(RowParallelLinear):
    """RowParallelLinear with tenants' adapters, added before the layer's all-reduce."""

    def __init__(self, *args, lora_tenants=(), lora_routing: TenantRouting | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        tp = self.tp_group.size() if self.tp_group is not None else 1
        self.lora = Adapters(list(lora_tenants), self.input_size_per_partition, self.output_size, kind="row",
                             tp=tp, routing=lora_routing, dtype=self.weight.dtype)

    def _forward_impl(self, input, weight, *args, **kwargs):  # noqa: A002 (Megatron's keyword)
        return _add(super()._forward_impl(input, weight, *args, **kwargs), self.lora(input))

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return _without_lora(super().sharded_state_dict(prefix, sharded_offsets, metadata))


def _without_lora(state: dict) -> dict:
    return {k: v for k, v in state.items() if ".lora." not in f".{k}"}


def lora_layers(model: torch.nn.Module) -> list[tuple[str, Adapters]]:
    """``(module name, Adapters)`` of every LoRA layer of ``model`` (wrappers such as DDP are looked through)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, Adapters)]


def partial_grads(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Replicated factors whose gradient is a partial sum over the TP group: column A and row B (TP > 1)."""
    out = []
    for _, adapters in lora_layers(model):
        if adapters.tp > 1:
            out += list((adapters.lora_A if adapters.kind == "column" else adapters.lora_B).values())
    return out
