"""The function each rank runs under the elastic agent (forked from a forkserver that has imported torch and
Megatron-core, and DeepSpeed for ``--launcher deepspeed``, once per node, so a restart does not pay the imports
again)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

PRELOAD = ("torch", "hetu_ext.train.trainer", "hetu_ext.cli.train")
"""Modules the node's forkserver imports once (about 5 s per process on a busy 2-core machine)."""


class _ErrorLine:
    """stderr that remembers the last ``error:`` line written through it (pretrain_gpt.py's one-line errors)."""

    def __init__(self, stream) -> None:
        self.stream, self.line = stream, None

    def write(self, text: str) -> int:
        for line in text.splitlines():
            if ": error: " in line:
                self.line = line
        return self.stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def run_worker(argv_json: str, devices: str, report_dir: str) -> None:
    """pretrain_gpt.py's entry (``hetu_ext.cli.train.main``) with ``argv``, local rank ``i`` on the ``i``-th
    healthy device; exits with its code (2 leaves the error line in ``report_dir`` for the agent)."""
    _run("hetu_ext.cli.train", argv_json, devices, report_dir)


def run_deepspeed_worker(argv_json: str, devices: str, report_dir: str) -> None:
    """launch/pretrain_gpt_deepspeed.py's entry (``hetu_ext.cli.deepspeed.main``), as :func:`run_worker`."""
    _run("hetu_ext.cli.deepspeed", argv_json, devices, report_dir)


def _run(module: str, argv_json: str, devices: str, report_dir: str) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = devices  # before anything touches CUDA; ignored on a CPU
    from importlib import import_module

    main = import_module(module).main
    sys.stderr = errors = _ErrorLine(sys.stderr)
    try:
        code = main(json.loads(argv_json))
    except SystemExit as exc:  # a parser's one-line error (exit 2)
        code = exc.code if isinstance(exc.code, int) else 1
    if code == 2 and errors.line:
        Path(report_dir, f"config_error_local{os.environ.get('LOCAL_RANK', '0')}.txt").write_text(errors.line)
    sys.stderr.flush()
    sys.stdout.flush()
    if code:
        sys.exit(code)
