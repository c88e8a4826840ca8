"""One rank's shard file: the safetensors format, written straight from host tensors, with CRC-32 checksums.

The file is plain safetensors (8-byte little-endian header length, a JSON header naming each entry's dtype,
shape and byte range, then the raw bytes), so any safetensors reader opens it; it is written here rather than
through ``safetensors.torch.save`` so that the bytes go from the snapshot to the disk without a second copy.
Checksums: one CRC-32 over the header bytes and one per entry over its data. CRC-32 detects every error burst
of up to 32 bits, so a flipped byte anywhere in the file is always caught (in the header by the header CRC, in
the data by the entry's CRC), and a truncated file fails the size check before anything is parsed.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass

import torch

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL"}
"""torch dtype -> safetensors dtype name."""
BY_NAME: dict[str, torch.dtype] = {v: k for k, v in DTYPES.items()}


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without copying."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def crc32(tensor: torch.Tensor) -> int:
    return zlib.crc32(raw_bytes(tensor))


@dataclass(frozen=True)
class EntryRecord:
    """Where one entry's bytes sit in a shard file and their checksum."""

    entry: str
    dtype: str
    """safetensors dtype name (``F32``, ``BF16``, ...)."""
    shape: tuple[int, ...]
    crc32: int


@dataclass(frozen=True)
class FileRecord:
    """A written shard file: size and header checksum (checked before the file is opened)."""

    name: str
    size: int
    """Bytes."""
    header_crc32: int
    """CRC-32 of the first 8 + header-length bytes."""


def encode(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
           ) -> tuple[list[bytes | memoryview], list[EntryRecord], int, int]:
    """Chunks of a safetensors file holding ``tensors`` (contiguous CPU tensors, in the given order).

    Returns ``(chunks, entries, total size in bytes, header CRC-32)``.
    """
    header: dict[str, object] = {"__metadata__": dict(metadata or {})}
    entries, chunks, offset = [], [], 0
    for name, tensor in tensors.items():
        if tensor.dtype not in DTYPES:
            raise TypeError(f"{name}: dtype {tensor.dtype} cannot be checkpointed; use one of {list(DTYPES)}")
        data = raw_bytes(tensor)
        header[name] = {"dtype": DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + data.nbytes]}
        offset += data.nbytes
        chunks.append(data)
        entries.append(EntryRecord(entry=name, dtype=DTYPES[tensor.dtype], shape=tuple(tensor.shape),
                                   crc32=zlib.crc32(data)))
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors aligns the data to 8 bytes
    head = struct.pack("<Q", len(text)) + text
    return [head, *chunks], entries, len(head) + offset, zlib.crc32(head)


def header_crc32(path: str) -> int:
    """CRC-32 of a safetensors file's length prefix and header, reading only those bytes."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            return zlib.crc32(prefix)
        (n,) = struct.unpack("<Q", prefix)
        return zlib.crc32(prefix + f.read(min(n, 100 * 2**20)))
