"""Run ``python -m hetu_ext.megatron_lm SCRIPT FLAGS`` on N CPU ranks forked from one process that imported
Megatron-LM's training package once: what torchrun would run, without each rank's 10-15 CPU-s of imports.

A Megatron-LM launch in a test is almost all start-up (two CPU ranks of ``pretrain_gpt.py``: ~27 of 31 CPU-s
before the first step, docs/testing.md). The zygote is one process per test session (per pytest worker) that
imports what a rank imports before the script runs (torch, Megatron-core with ``torch.compile`` deferred, the
checkout's ``megatron.training`` under the same triton stand-in as :func:`hetu_ext.megatron_lm.run.prepare`, the
script's own imports, hetu_ext's trainer for hand-offs) and applies nothing: each forked rank runs
:func:`hetu_ext.megatron_lm.run.main` from its start (flag checks, patches, hooks, the script as ``__main__``),
with the environment torchrun gives a rank (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR/PORT``, ...),
its own working directory, ``TMPDIR`` and ``sys.argv``. Its stdout and stderr go to files of its own.

Tests of the front door itself (the docs' ``torchrun`` blocks, the launcher's errors under torchrun) still run
torchrun; tests of what hetu_ext does on Megatron-LM's loop use this (helpers.py ``megatron_lm``). A test tool,
not part of the package: it imports Megatron-LM's entry point, which hetu_ext's own layers may not.

Protocol (one JSON object per line): the client writes ``{"argv", "env", "cwd", "nproc", "logs"}``; the zygote
answers ``{"pids": [...]}`` at once and ``{"codes": [...], "first": code}`` when every rank has exited (the
first rank to fail ends the launch, as under torchrun).
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import subprocess
import sys
import threading
import traceback
from pathlib import Path

TORCHRUN_ENV = {"GROUP_RANK": "0", "ROLE_NAME": "default", "TORCHELASTIC_RESTART_COUNT": "0",
                "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "hetu-zygote", "MASTER_ADDR": "127.0.0.1"}
"""What torchrun sets besides the rank's own variables (set per rank, ``MASTER_PORT`` a free port per launch)."""


def _preload(script: str) -> None:
    """What a rank imports before its first step, in the order :func:`hetu_ext.megatron_lm.run.prepare` does."""
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    checkout = str(Path(script).resolve().parent)
    if checkout not in sys.path:
        sys.path.append(checkout)
    import torch

    torch.set_num_threads(1)
    import hetu_ext.megatron  # noqa: F401 (Megatron-core below is imported with torch.compile deferred)
    import megatron.core  # noqa: F401 (before the triton stand-in, as in a rank)
    from hetu_ext.patches.megatron_lm import import_without_triton

    import_without_triton()
    runpy.run_path(script, run_name="__hetu_zygote__")  # the script's imports; its __main__ block does not run
    for module in ("torch._dynamo", "megatron.training.checkpointing", "hetu_ext.megatron_lm.checkpoint",
                   "hetu_ext.megatron_lm.handoff", "hetu_ext.megatron_lm.weighting", "hetu_ext.megatron_lm.packing",
                   "hetu_ext.train.trainer", "hetu_ext.megatron.plan_runtime"):
        __import__(module)


def _rank(request: dict, rank: int, port: int) -> None:
    """In the forked child: become rank ``rank`` of the launch and run the entry point; never returns."""
    code = 1
    try:
        os.setpgrp()  # the client kills the rank and whatever it starts (checkpoint writers) as one group
        for fd, path in zip((1, 2), request["logs"][rank]):
            log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(log, fd)
            os.close(log)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.chdir(request["cwd"])
        nproc = str(request["nproc"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ.update(TORCHRUN_ENV)
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank),
                           "WORLD_SIZE": nproc, "LOCAL_WORLD_SIZE": nproc, "ROLE_WORLD_SIZE": nproc,
                           "MASTER_PORT": str(port)})
        import tempfile

        tempfile.tempdir = None  # the zygote's cached choice would ignore this launch's TMPDIR
        from hetu_ext.megatron_lm import __main__ as entry
        from hetu_ext.megatron_lm.run import main

        sys.argv = [entry.__file__, *request["argv"]]
        try:
            code = main(request["argv"])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        threading._shutdown()  # noqa: SLF001 - what the interpreter does at exit: join non-daemon threads
        atexit._run_exitfuncs()  # noqa: SLF001 - and run the exit handlers (checkpoint writers, process groups)
    except BaseException:  # noqa: BLE001 - every failure must reach the log
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(script: str) -> None:
    """The zygote's loop: one launch at a time, read from stdin, answered on stdout."""
    _preload(script)
    answer = os.fdopen(os.dup(1), "w", buffering=1)
    print(json.dumps({"ready": True}), file=answer)
    for line in sys.stdin:
        request = json.loads(line)
        port = _free_port()
        sys.stdout.flush()
        sys.stderr.flush()
        pids = []
        for rank in range(request["nproc"]):
            pid = os.fork()
            if pid == 0:
                _rank(request, rank, port)
            pids.append(pid)
        print(json.dumps({"pids": pids}), file=answer)
        print(json.dumps(_wait(pids)), file=answer)


def _wait(pids: list[int]) -> dict:
    """Every rank's exit code, and the first failure's: as torchrun does, the first rank to exit non-zero ends the
    launch (the others, which would wait in a collective for the process group's timeout, are killed)."""
    import signal

    codes: dict[int, int] = {}
    first = 0
    while len(codes) < len(pids):
        pid, status = os.wait()
        if pid not in pids:
            continue
        codes[pid] = os.waitstatus_to_exitcode(status)
        if codes[pid] != 0 and not first:
            first = codes[pid]
            for other in set(pids) - set(codes):
                try:
                    os.killpg(other, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
    return {"codes": [codes[pid] for pid in pids], "first": first}


class Zygote:
    """The client: starts the zygote for ``script`` on first use, runs launches through it, stops it at exit."""

    def __init__(self, script: Path):
        self.script = str(script)
        self.proc: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, __file__, self.script],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
            atexit.register(self.close)
            ready = self.proc.stdout.readline()
            if not ready:
                raise RuntimeError(f"the zygote for {self.script} exited while importing (its stderr is above)")
        return self.proc

    def run(self, argv: list[str], nproc: int, cwd: Path, env: dict, timeout: float
            ) -> subprocess.CompletedProcess:
        """Like ``subprocess.run`` of torchrun: every rank's output concatenated in rank order, the exit code of the
        first rank that failed (or 0). On ``timeout`` the ranks are killed and :class:`subprocess.TimeoutExpired`
        raised."""
        import signal

        proc = self._start()
        logs = [[str(Path(cwd) / f".zygote_rank{r}.{name}") for name in ("out", "err")] for r in range(nproc)]
        request = {"argv": [str(a) for a in argv], "env": env, "cwd": str(cwd), "nproc": nproc, "logs": logs}
        proc.stdin.write(json.dumps(request) + "\n")
        proc.stdin.flush()
        pids = json.loads(proc.stdout.readline())["pids"]
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        timed_out = reader.is_alive()
        if timed_out:
            for pid in pids:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            reader.join()
        reply = json.loads(lines[0])
        out, err = ("".join(Path(rank[i]).read_text(errors="replace") for rank in logs) for i in (0, 1))
        for path in (p for rank in logs for p in rank):
            Path(path).unlink(missing_ok=True)
        args = ["zygote", *request["argv"]]
        if timed_out:
            raise subprocess.TimeoutExpired(args, timeout, output=out, stderr=err)
        return subprocess.CompletedProcess(args, reply["first"], out, err)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


if __name__ == "__main__":
    serve(sys.argv[1])
