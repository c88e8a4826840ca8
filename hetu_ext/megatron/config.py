"""``--hetu-config FILE.yaml``: hetu_ext settings in one YAML file; unknown keys are rejected by name.

Recognised keys (each also a ``--hetu-*`` flag; a flag given on the command line wins over the file):

    plan: plans/hetero_2pipes.yaml   # path (relative to the YAML file) of a plan
    runtime: auto                    # auto | megatron | plan
    cpu_patches: auto                # auto | on | off
    packing:                         # Hydraulis (each key also a --hetu-* flag)
      method: balanced               # --hetu-packing: off | unpacked | concat | concat-causal | ffd | greedy | balanced
      global_batch_tokens: 65536     # --hetu-global-batch-tokens
      cost_model: calibration/cpu.yaml  # --hetu-cost-model (relative to the YAML file)
      varlen_mock: {mode: distribution, type: lognormal, min_seq_len: 16, max_seq_len: 8192,
                    mean_seq_len: 1024, lognormal_sigma: 1.26}   # --hetu-varlen-mock (with --mock-data)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from .packed_data import PACKING_METHODS

_KEYS = {"plan": "hetu_plan", "runtime": "hetu_runtime", "cpu_patches": "hetu_cpu_patches", "packing": None}
_DEFAULTS = {"hetu_plan": None, "hetu_runtime": "auto", "hetu_cpu_patches": "auto", "hetu_packing": "off",
             "hetu_global_batch_tokens": None, "hetu_cost_model": None, "hetu_varlen_mock": None}
_CHOICES = {"runtime": ("auto", "megatron", "plan"), "cpu_patches": ("auto", "on", "off"),
            "method": PACKING_METHODS}
_PACKING_KEYS = {"method": "hetu_packing", "global_batch_tokens": "hetu_global_batch_tokens",
                 "cost_model": "hetu_cost_model", "varlen_mock": "hetu_varlen_mock"}


def load_hetu_config(path: str) -> dict:
    """The file's settings as ``args`` destinations (``hetu_plan``, ``hetu_packing``, ...), paths made absolute."""
    file = Path(path)
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except OSError as exc:
        raise ValueError(f"--hetu-config {path!r} cannot be read: {exc.strerror}; check the path") from exc
    except yaml.YAMLError as exc:
        raise ValueError(f"--hetu-config {path!r} is not valid YAML: {exc}".replace("\n", " ")) from exc
    if not isinstance(data, dict):
        raise ValueError(f"--hetu-config {path!r}: expected a mapping of settings, got {type(data).__name__}")
    unknown = sorted(set(data) - set(_KEYS))
    if unknown:
        raise ValueError(f"--hetu-config {path!r}: unknown key(s) {unknown}; allowed keys are {sorted(_KEYS)}")
    for key, choices in _CHOICES.items():
        if key in data and data[key] not in choices:
            raise ValueError(f"--hetu-config {path!r}: {key} must be one of {list(choices)}, got {data[key]!r}")
    if "plan" in data and data["plan"] is not None:
        data["plan"] = _relative_to(file, data["plan"])
    packing = data.pop("packing", None) or {}
    if not isinstance(packing, dict):
        raise ValueError(f"--hetu-config {path!r}: packing must be a mapping of {sorted(_PACKING_KEYS)}")
    unknown = sorted(set(packing) - set(_PACKING_KEYS))
    if unknown:
        raise ValueError(f"--hetu-config {path!r}: unknown key(s) {unknown} under packing; allowed keys are "
                         f"{sorted(_PACKING_KEYS)}")
    if "method" in packing and packing["method"] not in _CHOICES["method"]:
        raise ValueError(f"--hetu-config {path!r}: packing.method must be one of {list(_CHOICES['method'])}, got "
                         f"{packing['method']!r}")
    if packing.get("cost_model") is not None:
        packing["cost_model"] = _relative_to(file, packing["cost_model"])
    if isinstance(packing.get("varlen_mock"), dict):
        mock = dict(packing["varlen_mock"])
        if mock.get("mode") == "file" and "path" in mock:
            mock["path"] = _relative_to(file, mock["path"])
        packing["varlen_mock"] = json.dumps(mock)
    return {_KEYS[k]: v for k, v in data.items()} | {_PACKING_KEYS[k]: v for k, v in packing.items()}


def _relative_to(file: Path, value) -> str:
    path = Path(str(value))
    return str(path if path.is_absolute() else file.parent / path)


def apply_hetu_config(args: argparse.Namespace) -> None:
    """Fill ``args.hetu_*`` from ``--hetu-config`` where the command line left the default."""
    if not args.hetu_config:
        return
    for dest, value in load_hetu_config(args.hetu_config).items():
        if getattr(args, dest) == _DEFAULTS[dest]:
            setattr(args, dest, value)
