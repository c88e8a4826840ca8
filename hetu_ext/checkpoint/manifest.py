"""The manifest: what a checkpoint holds, where every shard's bytes are, and how to check them.

One ``manifest.json`` per checkpoint directory, written last (after every shard file is durable). Its first
line is ``hetu_ext-manifest v1 crc32=XXXXXXXX`` and the CRC-32 covers every byte after that line, so any
flipped or missing byte in the manifest is detected. Each global tensor is named by a ``name`` (``param/...``,
``exp_avg/...``) and a layer ``index``; it is stored as shards, each a box of global offsets
``[[start, stop], ...]`` kept in one entry of one shard file. Shards of a tensor never overlap and together cover
it exactly once: each unique element is written once, whatever the plan's replication.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass, field
from typing import Any

from .shardfile import BY_NAME, FileRecord

FORMAT = "hetu_ext-manifest"
VERSION = 1
MANIFEST = "manifest.json"

Box = tuple[tuple[int, int], ...]


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or corrupt; the message names the file and what is wrong."""


@dataclass(frozen=True, kw_only=True)
class ShardRecord:
    """One stored slice of a global tensor."""

    file: str
    """Shard file (relative to the checkpoint directory)."""
    entry: str
    """safetensors entry name inside the file."""
    box: Box
    """Global offsets ``((start, stop), ...)`` per dimension."""
    crc32: int
    """CRC-32 of the entry's bytes."""

    @property
    def numel(self) -> int:
        return math.prod(b - a for a, b in self.box)


@dataclass(frozen=True, kw_only=True)
class TensorRecord:
    """A global tensor and its shards."""

    name: str
    """``kind/key``: kind is ``param``, ``master``, ``exp_avg`` or ``exp_avg_sq``; key is Megatron's."""
    index: tuple[int, ...]
    """Global layer index for per-layer tensors, () otherwise."""
    shape: tuple[int, ...]
    """Global shape (without the layer index)."""
    dtype: str
    """safetensors dtype name."""
    shards: tuple[ShardRecord, ...]
    """Disjoint boxes that together cover the tensor exactly once."""

    def __post_init__(self) -> None:
        if self.dtype not in BY_NAME:
            raise CheckpointError(f"{self.name}{list(self.index)}: unknown dtype {self.dtype!r}")
        covered = sum(s.numel for s in self.shards)
        if covered != math.prod(self.shape):
            raise CheckpointError(f"{self.name}{list(self.index)}: shards hold {covered} elements but the tensor "
                                  f"has {math.prod(self.shape)} (shape {list(self.shape)}); the manifest is corrupt")


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """Everything needed to resume: tensors, files, iteration, data position, plan, config and RNG."""

    iteration: int
    """Training iterations completed."""
    consumed_samples: int | None
    """Samples of the training set consumed (Megatron-LM's count); None where the run does not know it (packed
    variable-length sequences: the data position is then the iteration and the data settings in ``state``)."""
    tensors: tuple[TensorRecord, ...]
    """Every global tensor and its shards."""
    files: tuple[FileRecord, ...]
    """Every shard file, with its size and header checksum."""
    world_size: int
    """Ranks that wrote the checkpoint (the saving plan's used ranks)."""
    plan: dict[str, Any] | None = None
    """The saving plan (hetu_ext.plan.plan_to_dict form)."""
    config: dict[str, Any] = field(default_factory=dict)
    """The run's flags (JSON-able values)."""
    state: dict[str, Any] = field(default_factory=dict)
    """Small training state: LR scheduler, Adam step, losses so far."""
    rng: dict[str, Any] = field(default_factory=dict)
    """Per writing rank (its rank as a string): RNG states."""
    run_id: str | None = None
    """The identity of the run that wrote it (a run resumed from a checkpoint keeps that checkpoint's); retention
    deletes only checkpoints of its own run. None: written before run identities existed, or by a tool."""

    def __post_init__(self) -> None:
        if self.iteration < 0 or (self.consumed_samples is not None and self.consumed_samples < 0):
            raise CheckpointError(f"manifest: iteration {self.iteration} and consumed_samples "
                                  f"{self.consumed_samples} must be >= 0")
        names = {f.name for f in self.files}
        for t in self.tensors:
            for s in t.shards:
                if s.file not in names:
                    raise CheckpointError(f"manifest: {t.name} refers to file {s.file!r}, which is not listed")

    def tensor_map(self) -> dict[tuple[str, tuple[int, ...]], TensorRecord]:
        return {(t.name, t.index): t for t in self.tensors}

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def _box(value: Any) -> Box:
    return tuple((int(a), int(b)) for a, b in value)


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def to_bytes(m: Manifest) -> bytes:
    body = {"format": FORMAT, "version": VERSION, "run_id": m.run_id, "iteration": m.iteration,
            "consumed_samples": m.consumed_samples, "world_size": m.world_size, "plan": m.plan,
            "config": m.config, "state": m.state, "rng": m.rng,
            "files": [{"name": f.name, "size": f.size, "header_crc32": f.header_crc32} for f in m.files],
            "tensors": [{"name": t.name, "index": list(t.index), "shape": list(t.shape), "dtype": t.dtype,
                         "shards": [{"file": s.file, "entry": s.entry, "box": [list(b) for b in s.box],
                                     "crc32": s.crc32} for s in t.shards]} for t in m.tensors]}
    text = json.dumps(body, indent=1).encode()
    return f"{FORMAT} v{VERSION} crc32={zlib.crc32(text):08x}\n".encode() + text


def from_bytes(data: bytes, where: str) -> Manifest:
    """Parse and check a manifest; :class:`CheckpointError` naming ``where`` if it is truncated or corrupt."""
    first, sep, text = data.partition(b"\n")
    parts = first.decode("ascii", errors="replace").split()
    if not sep or len(parts) != 3 or parts[0] != FORMAT or not parts[2].startswith("crc32="):
        raise CheckpointError(f"{where}: not a hetu_ext manifest (first line {first[:60]!r}); the file is corrupt "
                              "or not a checkpoint manifest")
    if parts[1] != f"v{VERSION}":
        raise CheckpointError(f"{where}: manifest version {parts[1]} is not supported (this release reads "
                              f"v{VERSION}); load it with the hetu_ext release that wrote it")
    if f"{zlib.crc32(text):08x}" != parts[2][6:]:
        raise CheckpointError(f"{where}: checksum mismatch (stored {parts[2][6:]}, computed "
                              f"{zlib.crc32(text):08x}, {len(text)} bytes): the manifest is truncated or corrupt")
    try:
        body = json.loads(text)
        files = tuple(FileRecord(name=f["name"], size=int(f["size"]), header_crc32=int(f["header_crc32"]))
                      for f in body["files"])
        tensors = tuple(TensorRecord(
            name=t["name"], index=tuple(int(i) for i in t["index"]), shape=tuple(int(d) for d in t["shape"]),
            dtype=t["dtype"], shards=tuple(ShardRecord(file=s["file"], entry=s["entry"], box=_box(s["box"]),
                                                       crc32=int(s["crc32"])) for s in t["shards"]))
            for t in body["tensors"])
        return Manifest(iteration=int(body["iteration"]), consumed_samples=_optional_int(body["consumed_samples"]),
                        world_size=int(body["world_size"]), plan=body["plan"], config=body["config"],
                        state=body["state"], rng=body["rng"], files=files, tensors=tensors,
                        run_id=body.get("run_id"))
    except CheckpointError as e:
        raise CheckpointError(f"{where}: {e}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{where}: malformed manifest ({type(e).__name__}: {e})") from None
