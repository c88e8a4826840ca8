"""Where checkpoint files live: a small storage seam and its local-filesystem implementation.

The writer and reader touch files only through :class:`Storage`, so a test can put a fault (a kill, a short
write) at any single operation, and another backend (object store, FUSE mount) needs only these methods.
Paths are ``/``-separated and relative to the storage's root. Durability contract of the local one: a
``write`` is fsynced before it returns, and ``rename`` fsyncs the parent directory, so a renamed name never
points at data that a power loss could still take away.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol, runtime_checkable


@runtime_checkable
class Storage(Protocol):
    """The seven operations checkpointing needs from a file store."""

    def write(self, path: str, chunks: Iterable[bytes | memoryview]) -> int:
        """Create or replace ``path`` with the concatenated chunks, durable on return; returns bytes written."""

    def read(self, path: str) -> bytes:
        """The whole content of a (small) file: manifests, part records, the ``latest`` pointer."""

    def local_path(self, path: str) -> str:
        """A filesystem path of ``path`` that safetensors can memory-map for byte-range reads."""

    def rename(self, src: str, dst: str) -> None:
        """Atomically move a file or directory; ``dst`` must not be a non-empty directory. Durable on return."""

    def list(self, path: str) -> list[str]:
        """Names directly under the directory ``path`` (sorted); [] if it does not exist."""

    def makedirs(self, path: str) -> None:
        """Create the directory ``path`` and its parents if missing."""

    def remove(self, path: str) -> None:
        """Delete a file or a directory tree; no error if it is already gone."""


class LocalStorage:
    """:class:`Storage` on a local or shared POSIX filesystem rooted at ``root``."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)

    def _p(self, path: str) -> Path:
        return self.root / path if path else self.root

    def write(self, path: str, chunks: Iterable[bytes | memoryview]) -> int:
        target = self._p(path)
        total = 0
        with open(target, "wb") as f:
            for chunk in chunks:
                total += f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        return total

    def read(self, path: str) -> bytes:
        return self._p(path).read_bytes()

    def local_path(self, path: str) -> str:
        return str(self._p(path))

    def rename(self, src: str, dst: str) -> None:
        os.replace(self._p(src), self._p(dst))
        _fsync_dir(self._p(dst).parent)

    def list(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(self._p(path)))
        except FileNotFoundError:
            return []

    def makedirs(self, path: str) -> None:
        self._p(path).mkdir(parents=True, exist_ok=True)

    def remove(self, path: str) -> None:
        target = self._p(path)
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target, ignore_errors=True)
        else:
            target.unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
