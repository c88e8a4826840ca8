"""The seam through which other frameworks' checkpoints reach ``python -m hetu_ext.checkpoint`` (pure).

``checkpoint/`` reads and writes hetu_ext's own format and imports no host framework; a format another framework
writes (DeepSpeed ZeRO: hetu_ext/deepspeed/zero_checkpoint.py) implements :class:`ForeignCheckpoints` in its
adapter package, and the entry point (``hetu_ext/checkpoint/__main__.py``) hands it to :func:`cli.main
<hetu_ext.checkpoint.cli.main>`. The CLI asks each format whether it recognises the path before reading it as
a hetu checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class ForeignCheckpoints(Protocol):
    """A checkpoint format written by another framework, as the checkpoint CLI reads it."""

    name: str
    """What the format is called in messages (``DeepSpeed ZeRO``)."""

    def recognises(self, path: str) -> bool:
        """Whether ``path`` (an existing directory) holds a checkpoint of this format. Looks at file names only:
        cheap, imports no framework, raises nothing."""
        ...

    def cli_lines(self, command: str, path: str, output: str | None, kind: str, to: str) -> list[str]:
        """The lines ``python -m hetu_ext.checkpoint COMMAND PATH`` prints for a checkpoint of this format
        (``command``: inspect, verify or convert; ``output``, ``kind`` and ``to``: convert's arguments). Raises
        :class:`~hetu_ext.checkpoint.manifest.CheckpointError` (one line: what is wrong, how to fix it) for a
        command the format cannot serve or a checkpoint it cannot read."""
        ...


def recognising(formats: Sequence[ForeignCheckpoints], path: str) -> ForeignCheckpoints | None:
    """The first of ``formats`` that recognises ``path``, or None (a hetu checkpoint, or none at all)."""
    return next((f for f in formats if f.recognises(path)), None)
