"""Length-aware time and memory of one transformer layer (pure: PyYAML only), the numbers packers read.

Time of one layer, forward + backward, for a pack (microbatch) of documents of ``s_1 .. s_n`` tokens that each
attend only to themselves::

    t(pack) = sum_i (a s_i^2 + b s_i) + c          seconds

``a`` is attention (scores and values grow with the square of each document's own length), ``b`` everything that
grows with tokens (QKV, projection and MLP matmuls, norms), ``c`` the fixed cost of running one microbatch through
the layer (kernel launches, framework overhead). One document of ``s`` tokens alone costs ``a s^2 + b s + c``;
``python -m hetu_ext.cli.calibrate`` measures that on the actual device and fits the three numbers.

Memory of one layer for a pack of ``S`` tokens: ``memory_fixed_bytes + memory_per_token_bytes * S`` (activations
kept for backward grow with tokens only when attention never materialises an s x s matrix, as with
FlashAttention / FlexAttention / varlen kernels).

A :class:`CostTable` holds one :class:`LengthCost` per strategy (TP degree) and is stored as YAML::

    device: cpu
    device_memory_bytes: null
    per_tp:
      1: {a: 1.0e-10, b: 2.0e-7, c: 1.0e-4, memory_per_token_bytes: 8704, memory_fixed_bytes: 0}
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from hetu_ext.keys import check_keys, read_yaml


@dataclass(frozen=True, kw_only=True)
class LengthCost:
    """Forward + backward seconds of one layer (or, scaled, of one stage) as a function of document lengths."""

    a: float
    """Seconds per squared token of one document (attention)."""
    b: float
    """Seconds per token (matmuls, norms, elementwise)."""
    c: float = 0.0
    """Seconds per microbatch, whatever it holds (launches, framework overhead)."""
    memory_per_token_bytes: float = 0.0
    """Activation bytes kept for backward per token of a microbatch."""
    memory_fixed_bytes: float = 0.0
    """Bytes held whatever the microbatch (weights, gradients, optimizer state of the layer)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0.0:
                raise ValueError(f"LengthCost: {f.name} must be a number >= 0, got {value!r}; a negative fitted "
                                 "coefficient means the fit is poor: measure more lengths or clamp it to 0")
            object.__setattr__(self, f.name, float(value))

    def document_s(self, tokens: float) -> float:
        """Seconds one document of ``tokens`` tokens adds to a microbatch (``a s^2 + b s``; excludes ``c``)."""
        return self.a * tokens * tokens + self.b * tokens

    def microbatch_s(self, lengths: Sequence[int]) -> float:
        """Seconds of one microbatch of documents of ``lengths`` tokens (``c`` included once)."""
        return sum(self.document_s(s) for s in lengths) + self.c

    def moments_s(self, sum_sq: float, sum_tokens: float, count: float = 1.0) -> float:
        """Seconds of ``count`` microbatches holding ``sum_sq`` squared tokens and ``sum_tokens`` tokens in all."""
        return self.a * sum_sq + self.b * sum_tokens + self.c * count

    def memory_bytes(self, tokens: float) -> float:
        """Bytes of one microbatch of ``tokens`` tokens."""
        return self.memory_fixed_bytes + self.memory_per_token_bytes * tokens

    def scaled(self, factor: float) -> LengthCost:
        """Time (a, b, c) scaled by ``factor`` (a slowdown); memory unchanged."""
        if not factor > 0:
            raise ValueError(f"LengthCost.scaled: factor must be > 0, got {factor!r}")
        return LengthCost(a=self.a * factor, b=self.b * factor, c=self.c * factor,
                          memory_per_token_bytes=self.memory_per_token_bytes,
                          memory_fixed_bytes=self.memory_fixed_bytes)

    def times_layers(self, num_layers: int, slowdown: float = 1.0) -> LengthCost:
        """The cost of a stage of ``num_layers`` layers whose slowest rank is ``slowdown`` times slower: time
        scales with layers x slowdown, memory with layers."""
        if num_layers < 0 or not slowdown > 0:
            raise ValueError(f"LengthCost.times_layers: need num_layers >= 0 and slowdown > 0, got {num_layers}, "
                             f"{slowdown}")
        k = num_layers * slowdown
        return LengthCost(a=self.a * k, b=self.b * k, c=self.c * k,
                          memory_per_token_bytes=self.memory_per_token_bytes * num_layers,
                          memory_fixed_bytes=self.memory_fixed_bytes * num_layers)


def _default_per_tp() -> dict[int, LengthCost]:
    # A100-class defaults for a 4096-wide GPT layer (ffn 16384, 32 heads), bf16, causal FlashAttention at 150
    # TFLOP/s sustained, FLOPs and bytes from the model inventory: forward FLOPs per token 24 h^2 (matmuls) and
    # 2 s h (causal scores + values); backward = 2 x forward, so b = 3 * 24 h^2 / F = 8.05e-6 s/token and
    # a = 3 * 2 h / F = 1.64e-10 s/token^2 (attention equals the matmuls at s = 12 h = 49K tokens); c = 1e-4 s
    # (about 30 kernels fwd+bwd at a few microseconds each). TP t divides a and b by t at 0.95 / 0.9 / 0.85
    # efficiency for t = 2 / 4 / 8. Activations h (10 + 24 / t) bytes per token (Korthikanti et al., no s x s term
    # with FlashAttention); weights + grads + Adam 18 bytes per parameter a rank holds.
    from hetu_ext.model import ModelSpec, inventory

    spec, flops = ModelSpec(num_layers=1, hidden_size=4096, num_attention_heads=32), 150e12
    base = {"a": 3 * inventory.attention_flops_per_square_token(spec, causal=True) / flops,
            "b": 3 * inventory.layer_matmul_flops_per_token(spec) / flops, "c": 1e-4}
    table = {}
    for tp, eff in ((1, 1.0), (2, 0.95), (4, 0.9), (8, 0.85)):
        table[tp] = LengthCost(
            a=base["a"] / (tp * eff), b=base["b"] / (tp * eff), c=base["c"],
            memory_per_token_bytes=inventory.activation_bytes_per_token(spec, tp=tp, attention_scores=False),
            memory_fixed_bytes=18 * inventory.layer_params(spec, tp=tp))
    return table


@dataclass(frozen=True, kw_only=True)
class CostTable:
    """Per-layer :class:`LengthCost` of each strategy (TP degree) on one device type."""

    per_tp: dict[int, LengthCost] = field(default_factory=_default_per_tp)
    """TP degree -> per-layer cost. Defaults: an A100-class GPU, 4096-wide layer (see ``_default_per_tp``)."""
    device: str = "a100-flops-model"
    """Where the numbers come from (``cpu``, ``cuda:NVIDIA H100``, or a model's name)."""
    device_memory_bytes: float | None = None
    """Memory of one device available to a stage, bytes; None: packs are bounded by their length only."""
    note: str = ""
    """Free text: model shape and settings of the calibration, the fit's error."""

    def __post_init__(self) -> None:
        if not self.per_tp:
            raise ValueError("CostTable: per_tp is empty; give at least the cost of TP 1")
        for tp, cost in self.per_tp.items():
            if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or not isinstance(cost, LengthCost):
                raise ValueError(f"CostTable: per_tp maps a TP degree >= 1 to a LengthCost, got {tp!r}: {cost!r}")
        if self.device_memory_bytes is not None and not self.device_memory_bytes > 0:
            raise ValueError(f"CostTable: device_memory_bytes must be > 0 or null, got {self.device_memory_bytes}")

    def for_tp(self, tp: int) -> LengthCost:
        """Per-layer cost at TP ``tp``; ValueError naming the degrees the table has."""
        if tp not in self.per_tp:
            raise ValueError(f"cost table ({self.device}): no cost for TP degree {tp}; it has TP "
                             f"{sorted(self.per_tp)}; calibrate with `python -m hetu_ext.cli.calibrate --tp {tp}`")
        return self.per_tp[tp]


_TABLE_KEYS = {"device", "device_memory_bytes", "note", "per_tp"}
_COST_KEYS = {f.name for f in fields(LengthCost)}



def cost_table_from_dict(data: Any, where: str = "cost table") -> CostTable:
    """Build a CostTable from its YAML mapping; unknown keys are rejected naming the allowed ones."""
    data = check_keys(data, _TABLE_KEYS, where, type_error=TypeError)
    per_tp_raw = check_keys(data.get("per_tp"), set(data.get("per_tp") or {}), f"{where} per_tp",
                            type_error=TypeError)
    per_tp = {}
    for tp, raw in per_tp_raw.items():
        here = f"{where} per_tp[{tp}]"
        raw = check_keys(raw, _COST_KEYS, here, type_error=TypeError)
        if not {"a", "b"} <= set(raw):
            raise ValueError(f"{here}: 'a' and 'b' are required, got keys {sorted(raw)}")
        try:
            per_tp[int(tp)] = LengthCost(**raw)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{here}: {exc}") from exc
    return CostTable(per_tp=per_tp, device=str(data.get("device", "unknown")),
                     device_memory_bytes=data.get("device_memory_bytes"), note=str(data.get("note", "")))


def cost_table_to_dict(table: CostTable) -> dict:
    return {"device": table.device, "device_memory_bytes": table.device_memory_bytes, "note": table.note,
            "per_tp": {tp: asdict(c) for tp, c in sorted(table.per_tp.items())}}


def load_cost_table(path: str | Path) -> CostTable:
    """Read a cost table YAML; ValueError naming the file for a missing, unreadable or malformed one."""
    path = Path(path)
    data = read_yaml(path, "cost table file",
                     fix="check the path or create it with `python -m hetu_ext.cli.calibrate --out FILE`")
    return cost_table_from_dict(data, where=f"cost table file {str(path)!r}")


def save_cost_table(table: CostTable, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cost_table_to_dict(table), sort_keys=False))
