"""Read a checkpoint: find it, check it, and read shards through safetensors' memory map.

Checks, in the order they run: the ``latest`` pointer names a committed checkpoint; the manifest's own CRC-32;
each shard file's size (a truncated file fails here) and header CRC-32 before safetensors parses it; each
entry's dtype and shape against the manifest and its CRC-32 after its bytes are read. Every failure is a
:class:`CheckpointError` naming the file.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch

from . import manifest as mf
from .manifest import CheckpointError, Manifest, ShardRecord, TensorRecord
from .selection import TensorId
from .shardfile import BY_NAME, crc32, header_crc32
from .storage import Storage
from .writer import TRACKER, UNREADABLE, checkpoint_name, complete_iterations, run_of


def latest_iteration(storage: Storage) -> int | None:
    """The iteration ``latest_checkpointed_iteration.txt`` names, or None without one."""
    if TRACKER not in storage.list(""):
        return None
    text = storage.read(TRACKER).decode(errors="replace").strip()
    if not text.isdigit():
        raise CheckpointError(f"{storage.local_path(TRACKER)}: expected an iteration number, found {text[:40]!r}; "
                              "fix or delete the file")
    return int(text)


def candidates(storage: Storage, *, fallback: bool) -> list[int]:
    """Iterations to try, in order: the latest, then (with ``fallback``) older committed ones of the same run,
    newest first.

    The latest is the tracker's iteration (as in Megatron-LM), whatever other directories exist: a newer one may
    be another run's, or this run's whose tracker move a crash cut short (the tracker moves right after the
    directory's rename). If the tracker names a missing or corrupt checkpoint, that is an error, or a fallback.
    Only without a tracker is the newest committed directory the latest. Older ones written by another run (a
    different ``run_id`` in a readable manifest) are never fallbacks.
    """
    tracked = latest_iteration(storage)
    complete = complete_iterations(storage)
    if tracked is None and not complete:
        return []
    latest = tracked if tracked is not None else complete[-1]
    if not fallback:
        return [latest]
    run = run_of(storage, latest) if latest in complete else UNREADABLE
    older = [it for it in reversed(complete) if it < latest]
    if run != UNREADABLE:  # the latest's run is known: stay within it
        older = [it for it in older if run_of(storage, it) in (run, UNREADABLE)]
    return [latest] + older


def read_manifest(storage: Storage, iteration: int) -> Manifest:
    path = f"{checkpoint_name(iteration)}/{mf.MANIFEST}"
    if mf.MANIFEST not in storage.list(checkpoint_name(iteration)):
        raise CheckpointError(f"{storage.local_path(path)}: missing; iteration {iteration} (named by {TRACKER}) "
                              "was never committed or was deleted")
    manifest = mf.from_bytes(storage.read(path), storage.local_path(path))
    if manifest.iteration != iteration:
        raise CheckpointError(f"{storage.local_path(path)}: manifest says iteration {manifest.iteration}, its "
                              f"directory says {iteration}; the checkpoint directory was renamed or mixed up")
    return manifest


class ShardReader:
    """Reads shards of one checkpoint, checking each file once before its first use."""

    def __init__(self, storage: Storage, manifest: Manifest) -> None:
        self.storage = storage
        self.manifest = manifest
        self.directory = checkpoint_name(manifest.iteration)
        self.files = {f.name: f for f in manifest.files}
        self._open: dict[str, object] = {}
        self.bytes_read = 0
        """Bytes of shard data read so far through the memory maps (logical: page-cache hits count too, so this
        is not the bytes fetched from the disk; file headers are not counted)."""

    def _path(self, file: str) -> str:
        return self.storage.local_path(f"{self.directory}/{file}")

    def check_file(self, file: str):
        """Size and header CRC-32 of one shard file, then open it (memory-mapped)."""
        from safetensors import safe_open

        if file not in self._open:
            record, path = self.files[file], self._path(file)
            if not os.path.exists(path):
                raise CheckpointError(f"{path}: missing shard file (the manifest lists it)")
            size = os.path.getsize(path)
            if size != record.size:
                raise CheckpointError(f"{path}: {size} bytes but the manifest says {record.size}: the shard file is "
                                      "truncated or was overwritten")
            if header_crc32(path) != record.header_crc32:
                raise CheckpointError(f"{path}: header checksum mismatch: the shard file is corrupt")
            try:
                self._open[file] = safe_open(path, framework="pt")
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
                raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
        return self._open[file]

    def read(self, tensor: TensorRecord, shard: ShardRecord) -> torch.Tensor:
        """One shard's data (its box of the global tensor), checksum-verified."""
        handle = self.check_file(shard.file)
        path = self._path(shard.file)
        try:
            view = handle.get_slice(shard.entry)
            dtype, shape = view.get_dtype(), tuple(view.get_shape())
        except Exception as e:  # noqa: BLE001 - safetensors' error types are not public
            raise CheckpointError(f"{path}: entry {shard.entry!r} unreadable ({e}); the file is corrupt") from None
        want = tuple(b - a for a, b in shard.box)
        if dtype != tensor.dtype or shape != want:
            raise CheckpointError(f"{path}: entry {shard.entry!r} is {dtype}{list(shape)} but the manifest says "
                                  f"{tensor.dtype}{list(want)}; the file is corrupt or from another checkpoint")
        data = view[tuple(slice(None) for _ in shape)] if shape else handle.get_tensor(shard.entry)
        data = data.contiguous()
        if crc32(data) != shard.crc32:
            raise CheckpointError(f"{path}: entry {shard.entry!r} checksum mismatch: the shard data is corrupt")
        self.bytes_read += data.numel() * data.element_size()
        return data

    def read_box(self, tensor: TensorRecord, shard: ShardRecord, box: tuple[tuple[int, int], ...]) -> torch.Tensor:
        """Just the elements ``box`` (global offsets, inside the shard) of one shard, through the memory map.

        Not checksummed here: the shard's CRC covers the whole entry, so the caller has another rank read the
        shard whole and check it (load.py's "node" policy)."""
        handle = self.check_file(shard.file)
        try:
            local = tuple(slice(a - s0, b - s0) for (a, b), (s0, _) in zip(box, shard.box))
            data = handle.get_slice(shard.entry)[local]
        except Exception as e:  # noqa: BLE001 - safetensors' error types are not public
            raise CheckpointError(f"{self._path(shard.file)}: entry {shard.entry!r} unreadable ({e})") from None
        self.bytes_read += data.numel() * data.element_size()
        return data

    def read_full(self, names: Iterable[str] | None = None) -> dict[TensorId, torch.Tensor]:
        """Whole global tensors (all of them, or those whose name is in ``names``), assembled in one process."""
        wanted = set(names) if names is not None else None
        out = {}
        for t in self.manifest.tensors:
            if wanted is not None and t.name not in wanted:
                continue
            full = torch.empty(t.shape, dtype=BY_NAME[t.dtype])
            for s in t.shards:
                full[tuple(slice(a, b) for a, b in s.box)] = self.read(t, s)
            out[(t.name, t.index)] = full
        return out

    def verify(self) -> int:
        """Check every file and every shard; returns the bytes of data checked."""
        for f in self.manifest.files:
            self.check_file(f.name)
        for t in self.manifest.tensors:
            for s in t.shards:
                self.read(t, s)
        return self.bytes_read
