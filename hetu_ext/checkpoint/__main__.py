"""``python -m hetu_ext.checkpoint inspect|verify|convert`` (see cli.py).

The entry point, an application like the scripts in launch/: it composes the checkpoint CLI (host-free) with the
formats of the host adapters, DeepSpeed ZeRO's (hetu_ext/deepspeed/zero_checkpoint.py, which imports DeepSpeed
only when it reads a DeepSpeed folder). tests/test_layering.py lets entry points import the adapters and nothing
import an entry point.
"""

from __future__ import annotations

import sys

from hetu_ext.deepspeed.zero_checkpoint import ZERO_CHECKPOINTS

from .cli import main as cli_main

FORMATS = (ZERO_CHECKPOINTS,)
"""The other frameworks' checkpoint formats the CLI reads."""


def main(argv: list[str] | None = None) -> int:
    """The checkpoint CLI with every format hetu_ext reads; the exit code."""
    return cli_main(argv, formats=FORMATS)


if __name__ == "__main__":
    sys.exit(main())
