"""``--hetu-config FILE.yaml``: hetu_ext settings in one YAML file; unknown keys are rejected by name.

Recognised keys (each also a ``--hetu-*`` flag; a flag given on the command line wins over the file):

    plan: plans/hetero_2pipes.yaml   # path (relative to the YAML file) of a plan
    runtime: auto                    # auto | megatron | plan
    cpu_patches: auto                # auto | on | off
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

_KEYS = {"plan": "hetu_plan", "runtime": "hetu_runtime", "cpu_patches": "hetu_cpu_patches"}
_DEFAULTS = {"hetu_plan": None, "hetu_runtime": "auto", "hetu_cpu_patches": "auto"}
_CHOICES = {"runtime": ("auto", "megatron", "plan"), "cpu_patches": ("auto", "on", "off")}


def load_hetu_config(path: str) -> dict:
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
        plan = Path(str(data["plan"]))
        data["plan"] = str(plan if plan.is_absolute() else file.parent / plan)
    return data


def apply_hetu_config(args: argparse.Namespace) -> None:
    """Fill ``args.hetu_*`` from ``--hetu-config`` where the command line left the default."""
    if not args.hetu_config:
        return
    for key, value in load_hetu_config(args.hetu_config).items():
        dest = _KEYS[key]
        if getattr(args, dest) == _DEFAULTS[dest]:
            setattr(args, dest, value)
