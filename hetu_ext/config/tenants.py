"""The tenants file of LobRA's joint multi-LoRA fine-tuning (``--hetu-lora-tenants FILE``); pure: no torch.

A tenant is one user's fine-tuning job: its own data, its own per-step share of the global batch and its own
LoRA adapter over the shared frozen base model::

    tenants:
      - name: alice                      # letters, digits, '_' or '-'; names the adapter's parameters
        lengths: {mode: distribution, type: lognormal, min_seq_len: 8, max_seq_len: 512, mean_seq_len: 64,
                  lognormal_sigma: 1.0}  # or {mode: file, path: lengths.txt}: mock tokens of those lengths
        documents: 2000                  # mock documents drawn (default 10000)
        samples: 4                       # sequences per step; a list is a per-step schedule, cycled ([4, 0])
        lora: {rank: 8, alpha: 16, dropout: 0.0, targets: [qkv, proj, fc1, fc2]}
      - name: bob
        data_path: data/bob_text_document   # a Megatron indexed dataset (preprocess_data's prefix)
        tokens: 2048                     # or a token budget per step (at least one sequence when > 0)

Exactly one of ``lengths`` / ``data_path`` and one of ``samples`` / ``tokens``. A step in which a tenant has no
sequence leaves its adapter and its optimizer state untouched. Paths are relative to the tenants file.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hetu_ext.keys import check_keys

TARGETS = ("qkv", "proj", "fc1", "fc2")
"""Megatron-core's linear layers of a transformer layer that take an adapter: attention's fused QKV
(ColumnParallelLinear), its output projection (RowParallelLinear), the MLP's fc1 (column) and fc2 (row)."""
_TENANT_KEYS = ("name", "lengths", "documents", "data_path", "samples", "tokens", "lora")
_LORA_KEYS = ("rank", "alpha", "dropout", "targets")
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True, kw_only=True)
class LoRASettings:
    """One adapter's shape: ``W x + (alpha / rank) B A dropout(x)`` on each target layer."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = TARGETS

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


@dataclass(frozen=True, kw_only=True)
class TenantSpec:
    """One tenant of the tenants file."""

    name: str
    lengths: Mapping[str, Any] | None = None
    """Mock documents' length spec (hetu_ext.data.lengths forms); None with ``data_path``."""
    documents: int = 10_000
    data_path: str | None = None
    samples: tuple[int, ...] | None = None
    """Sequences per step, cycled over steps; None with ``tokens``."""
    tokens: tuple[int, ...] | None = None
    """Token budget per step, cycled over steps; None with ``samples``."""
    lora: LoRASettings = LoRASettings()

    @property
    def seed_offset(self) -> int:
        """A stable number for this tenant's random streams (data order, adapter init): its name's CRC-32, so a
        tenant's data and adapter do not depend on the other tenants of the file."""
        return zlib.crc32(self.name.encode())

    def quota(self, step: int) -> tuple[str, int]:
        """(``"samples"`` or ``"tokens"``, how many) for 0-based ``step``."""
        kind, values = ("samples", self.samples) if self.samples is not None else ("tokens", self.tokens)
        return kind, values[step % len(values)]


def _counts(value: Any, where: str) -> tuple[int, ...]:
    values = value if isinstance(value, list) else [value]
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
        raise ValueError(f"{where}: expected a count >= 0 or a non-empty list of them, got {value!r}")
    if not any(values):
        raise ValueError(f"{where}: {value!r} gives the tenant no data in any step; give a positive count")
    return tuple(values)


def _lora(obj: Any, where: str) -> LoRASettings:
    if obj is None:
        return LoRASettings()
    obj = check_keys(obj, _LORA_KEYS, where)
    settings = LoRASettings(**{k: tuple(v) if k == "targets" and isinstance(v, list) else v for k, v in obj.items()})
    if isinstance(settings.rank, bool) or not isinstance(settings.rank, int) or settings.rank < 1:
        raise ValueError(f"{where}: rank must be an integer >= 1, got {settings.rank!r}")
    if not isinstance(settings.alpha, (int, float)) or settings.alpha <= 0:
        raise ValueError(f"{where}: alpha must be > 0, got {settings.alpha!r}")
    if not isinstance(settings.dropout, (int, float)) or not 0 <= settings.dropout < 1:
        raise ValueError(f"{where}: dropout must be in [0, 1), got {settings.dropout!r}")
    if not isinstance(settings.targets, tuple) or not settings.targets:
        raise ValueError(f"{where}: targets must be a non-empty list of {list(TARGETS)}, got {settings.targets!r}")
    for target in settings.targets:
        if target not in TARGETS:
            raise ValueError(f"{where}: target {target!r} is not a layer of the model; the targets are "
                             f"{list(TARGETS)} (attention's qkv and proj, the MLP's fc1 and fc2)")
    return settings


def parse_tenants(data: Any, where: str = "the tenants file", base: Path | None = None) -> tuple[TenantSpec, ...]:
    """The tenants of a parsed tenants file (``{"tenants": [...]}``); ValueError naming the rule and the fix."""
    data = check_keys(data, ("tenants",), where, required=("tenants",))
    items = data["tenants"]
    if not isinstance(items, list) or not items:
        raise ValueError(f"{where}: 'tenants' must be a non-empty list of tenants, got {items!r}")
    out = []
    for k, item in enumerate(items):
        name = item.get("name") if isinstance(item, Mapping) else None
        at = f"tenant {name!r} of {where}" if isinstance(name, str) else f"tenant {k} of {where}"
        item = check_keys(item, _TENANT_KEYS, at, required=("name",))
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"{at}: name must be 1-64 letters, digits, '_' or '-', got {name!r}")
        if ("lengths" in item) == ("data_path" in item):
            raise ValueError(f"{at}: give exactly one data source, 'lengths' (mock documents of a length spec) or "
                             "'data_path' (an indexed dataset prefix)")
        if ("samples" in item) == ("tokens" in item):
            raise ValueError(f"{at}: give exactly one of 'samples' (sequences per step) or 'tokens' (a token "
                             "budget per step)")
        data_path = item.get("data_path")
        if data_path is not None and base is not None and not Path(data_path).is_absolute():
            data_path = str(base / data_path)
        lengths = item.get("lengths")
        if lengths is not None:
            from hetu_ext.data.lengths import parse_length_spec

            if isinstance(lengths, Mapping) and lengths.get("mode") == "file" and base is not None \
                    and not Path(str(lengths.get("path", ""))).is_absolute():
                lengths = {**lengths, "path": str(base / str(lengths["path"]))}
            try:
                parse_length_spec(dict(lengths) if isinstance(lengths, Mapping) else lengths)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{at}: lengths: {exc}") from exc
        documents = item.get("documents", 10_000)
        if isinstance(documents, bool) or not isinstance(documents, int) or documents < 1:
            raise ValueError(f"{at}: documents must be an integer >= 1, got {documents!r}")
        samples = _counts(item["samples"], f"{at}: samples") if "samples" in item else None
        tokens = _counts(item["tokens"], f"{at}: tokens") if "tokens" in item else None
        out.append(TenantSpec(name=name, lengths=dict(lengths) if lengths is not None else None,
                              documents=documents, data_path=data_path, samples=samples, tokens=tokens,
                              lora=_lora(item.get("lora"), f"lora of {at}")))
    names = [t.name for t in out]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"{where}: tenant names must be unique, {dupes} appear more than once")
    return tuple(out)


def load_tenants(path: str | Path) -> tuple[TenantSpec, ...]:
    """Read and check a tenants file (YAML)."""
    path = Path(path)
    where = f"--hetu-lora-tenants {str(path)!r}"
    if not path.is_file():
        raise ValueError(f"{where}: no such file; give a YAML file with a 'tenants:' list (configs/lobra/)")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"{where}: not valid YAML ({str(exc).splitlines()[0]})") from exc
    return parse_tenants(data, where, base=path.parent)
