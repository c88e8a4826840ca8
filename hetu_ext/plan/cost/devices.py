"""Device profiles (pure): what one GPU type computes and moves, read from YAML, for the step-time model.

A profile is a YAML file (the shipped ones: ``hetu_ext/plan/cost/devices/{a100-80gb-sxm,h100-sxm,h200}.yaml``; a user's:
any path). Keys (unknown ones are refused, naming the key and the closest allowed one)::

    name: A100-80GB-SXM
    peak_flops: 312.0e12           # dense bf16 tensor-core FLOP/s of one GPU (the MFU denominator)
    gemm_efficiency: {512: 0.40, 1024: 0.62, 2048: 0.76, 4096: 0.84}
                                   # GEMM size -> fraction of peak_flops; size = (m n k) ** (1/3) of one GEMM,
                                   # interpolated in log(size), clamped at both ends
    memory_gib: 80                 # device memory, GiB
    hbm_bytes_per_s: 2.039e12      # memory bandwidth (elementwise kernels, optimizer step)
    nvlink_bytes_per_s: 230.0e9    # NCCL all-reduce *bus* bandwidth inside a node (nccl-tests' busbw)
    nvlink_latency_s: 1.0e-5       # per collective inside a node
    inter_node_bytes_per_s: 25.0e9 # per GPU across nodes (its NIC), bus bandwidth
    inter_node_latency_s: 2.0e-5   # per collective across nodes
    gpus_per_node: 8
    calibrate: null                # optional: a cost table of `python -m hetu_ext.cli.calibrate` (path
                                   # relative to the profile) measured on this device, and the layer it measured
    note: where the numbers come from

``--device NAME`` picks a shipped profile by file stem (case-insensitive); ``--device FILE`` reads any profile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from hetu_ext.keys import check_keys, read_yaml

DEVICES_DIR = Path(__file__).with_name("devices")
KEYS = ("name", "peak_flops", "gemm_efficiency", "memory_gib", "hbm_bytes_per_s", "nvlink_bytes_per_s",
        "nvlink_latency_s", "inter_node_bytes_per_s", "inter_node_latency_s", "gpus_per_node", "calibrate", "note")
REQUIRED = ("name", "peak_flops", "gemm_efficiency", "memory_gib", "hbm_bytes_per_s", "nvlink_bytes_per_s",
            "inter_node_bytes_per_s")
CALIBRATE_KEYS = ("table", "hidden_size", "num_attention_heads", "ffn_hidden_size", "micro_batch_size")


@dataclass(frozen=True)
class Calibration:
    """A measured per-layer cost table (``python -m hetu_ext.cli.calibrate``) and the layer it measured."""

    table: Path
    """The cost table file (YAML)."""
    hidden_size: int
    """The measured layer's shape (the table prices only layers of this shape)."""
    num_attention_heads: int
    ffn_hidden_size: int
    micro_batch_size: int = 1
    """Sequences per measured microbatch (the calibration runs one document per pack: 1)."""


@dataclass(frozen=True, kw_only=True)
class Device:
    """One GPU type. Units: FLOP/s, bytes, bytes/s, seconds."""

    name: str
    peak_flops: float
    """Dense bf16 tensor-core FLOP/s (the MFU denominator)."""
    gemm_efficiency: tuple[tuple[float, float], ...]
    """(GEMM size, fraction of peak) points, sizes increasing; size = cube root of m n k."""
    memory_gib: float
    """Device memory, GiB."""
    hbm_bytes_per_s: float
    """Memory bandwidth, bytes/s (memory-bound kernels, the optimizer step)."""
    nvlink_bytes_per_s: float
    """NCCL bus bandwidth of a collective inside a node: a ring all-reduce of B bytes over t GPUs takes
    ``2 (t-1)/t B / nvlink_bytes_per_s``; a reduce-scatter or all-gather half of it."""
    inter_node_bytes_per_s: float
    """Bus bandwidth per GPU of a collective (or a point-to-point send) that crosses nodes."""
    nvlink_latency_s: float = 1e-5
    """Seconds added to each collective inside a node."""
    inter_node_latency_s: float = 2e-5
    """Seconds added to each collective or send across nodes."""
    gpus_per_node: int = 8
    calibrate: Calibration | None = None
    """A layer table measured on this device (:class:`Calibration`); None: the FLOP model prices every layer."""
    note: str = ""
    """Where the numbers come from."""

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * 2**30

    def gemm_flops_per_s(self, m: float, n: float, k: float) -> float:
        """Sustained FLOP/s of one (m x k) @ (k x n) GEMM: peak x the efficiency curve at (m n k) ** (1/3)."""
        return self.peak_flops * self.efficiency((m * n * k) ** (1 / 3))

    def efficiency(self, size: float) -> float:
        """The efficiency curve at ``size`` (log-linear between points, clamped at the ends)."""
        points = self.gemm_efficiency
        if size <= points[0][0]:
            return points[0][1]
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            if size <= x1:
                w = (math.log(size) - math.log(x0)) / (math.log(x1) - math.log(x0))
                return y0 + w * (y1 - y0)
        return points[-1][1]

    def link(self, group: int, spans_nodes: bool) -> tuple[float, float]:
        """(bus bytes/s, latency s) of a collective over ``group`` GPUs, inside a node or across nodes."""
        if spans_nodes or group > self.gpus_per_node:
            return self.inter_node_bytes_per_s, self.inter_node_latency_s
        return self.nvlink_bytes_per_s, self.nvlink_latency_s


def shipped_devices() -> list[str]:
    """Names of the profiles shipped with hetu_ext (file stems)."""
    return sorted(p.stem for p in DEVICES_DIR.glob("*.yaml"))


def load_device(name_or_path: str | Path) -> Device:
    """A shipped profile by name (``a100-80gb-sxm``, ``h100-sxm``, ``h200``; case-insensitive) or a YAML file;
    ValueError (one line: the rule, the value, the fix) otherwise."""
    text = str(name_or_path)
    path = DEVICES_DIR / f"{text.lower()}.yaml"
    if not path.exists():
        path = Path(text)
        if not path.exists():
            raise ValueError(f"--device {text!r} is neither a shipped profile ({', '.join(shipped_devices())}) nor "
                             "a file; give one of those names or a profile YAML (docs/cost_model.md)")
    where = f"device profile {str(path)!r}"
    data = check_keys(read_yaml(path, "device profile"), KEYS, where, required=REQUIRED)
    return device_from_dict(data, where=where, base=path.parent)


def _number(value: object) -> object:
    """YAML 1.1 reads ``312.0e12`` (no exponent sign) as a string: accept numeric strings as floats."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def device_from_dict(data: dict, *, where: str = "device profile", base: Path = Path(".")) -> Device:
    """Build and validate a :class:`Device` from a profile's mapping (keys already checked)."""
    numbers = {}
    for key in ("peak_flops", "memory_gib", "hbm_bytes_per_s", "nvlink_bytes_per_s", "inter_node_bytes_per_s",
                "nvlink_latency_s", "inter_node_latency_s"):
        if key in data:
            value = _number(data[key])
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (
                    not key.endswith("latency_s") and value == 0):
                raise ValueError(f"{where}: {key} must be a positive number, got {value!r}")
            numbers[key] = float(value)
    curve = data["gemm_efficiency"]
    if not isinstance(curve, dict) or not curve:
        raise ValueError(f"{where}: gemm_efficiency must map GEMM sizes to efficiencies, got {curve!r}")
    points = []
    for size, eff in sorted((_number(k), _number(x)) for k, x in curve.items()):
        if isinstance(size, bool) or not isinstance(size, (int, float)) or size <= 0 or isinstance(eff, bool) \
                or not isinstance(eff, (int, float)) or not 0 < eff <= 1:
            raise ValueError(f"{where}: gemm_efficiency entry {size!r}: {eff!r} must be a size > 0 and an "
                             "efficiency in (0, 1]")
        points.append((float(size), float(eff)))
    gpus = data.get("gpus_per_node", 8)
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"{where}: gpus_per_node must be a positive integer, got {gpus!r}")
    calibration = None
    if data.get("calibrate") is not None:
        raw = check_keys(data["calibrate"], CALIBRATE_KEYS, f"{where} calibrate",
                         required=("table", "hidden_size", "num_attention_heads", "ffn_hidden_size"))
        table = Path(str(raw["table"]))
        calibration = Calibration(table=table if table.is_absolute() else base / table,
                                  hidden_size=int(raw["hidden_size"]),
                                  num_attention_heads=int(raw["num_attention_heads"]),
                                  ffn_hidden_size=int(raw["ffn_hidden_size"]),
                                  micro_batch_size=int(raw.get("micro_batch_size", 1)))
    return Device(name=str(data["name"]), gemm_efficiency=tuple(points), gpus_per_node=gpus,
                  calibrate=calibration, note=str(data.get("note", "")), **numbers)
