"""Run a function on N gloo ranks, fast and reliably on a 2-core machine (tests and benchmarks).

* Ranks are forked from a ``forkserver`` that imported torch and Megatron-core once (``preload``), so a test
  pays ~0.1 s per rank instead of a fresh interpreter and imports (4-18 s with torchrun). ``torch._dynamo`` is
  among them: torch's ``Optimizer.step`` imports it at a rank's first step (~0.8 CPU-s each).
* Rendezvous through a ``FileStore`` in a temporary directory: no ports to collide.
* One thread per rank (``OMP_NUM_THREADS=1``): oversubscribed threads make 2-core runs 7-15x slower.
* A rank that hangs dumps every thread's stack (``faulthandler``) shortly before the deadline; at the deadline
  all ranks are killed at once and the error names the ranks that did not finish.
* Ranks are not daemons (Megatron's checkpoint writer starts child processes); the parent kills them.
* A rank that raises sends its traceback to the parent, which raises :class:`RankError` naming that rank.

The function must be a module-level (picklable) callable ``fn(rank, world_size, *args)``; its return value on
each rank comes back in a list indexed by rank.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "TORCHDYNAMO_DISABLE": "1",
       "PYTHONWARNINGS": "ignore"}
DEFAULT_PRELOAD = ("torch", "torch.distributed", "hetu_ext.megatron", "megatron.core", "megatron.core.models.gpt",
                   "megatron.core.optimizer", "megatron.core.distributed", "megatron.core.pipeline_parallel",
                   "hetu_ext.train.trainer", "torch._dynamo", "deepspeed", "hetu_ext.deepspeed.engine")
"""DeepSpeed among them: ~2.5 CPU-s per rank of a DeepSpeed test otherwise, ~2.5 s once per process here (its
accelerator is chosen at import: ``DS_ACCELERATOR=cpu`` is set first where there is no CUDA device)."""

_CONTEXT: mp.context.BaseContext | None = None


class RankError(RuntimeError):
    """A rank raised, or ranks did not finish before the deadline."""


def _context(preload: Sequence[str]) -> mp.context.BaseContext:
    global _CONTEXT
    if _CONTEXT is None:
        os.environ.update(ENV)
        if "deepspeed" in preload and "DS_ACCELERATOR" not in os.environ:
            import torch

            if not torch.cuda.is_available():
                os.environ["DS_ACCELERATOR"] = "cpu"
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([m for m in preload if _importable(m)])
        _CONTEXT = ctx
    return _CONTEXT


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module.split(".")[0]) is not None
    except (ImportError, ValueError):
        return False


def _rank_main(fn: Callable, rank: int, world_size: int, store_path: str, args: tuple, results, dump_after: float):
    import torch
    import torch.distributed as dist

    os.setpgrp()  # its own process group, so the parent can reap helpers it starts (checkpoint writers)
    os.environ.update(ENV)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size)})
    torch.set_num_threads(1)
    faulthandler.dump_traceback_later(dump_after, exit=False, file=sys.stderr)
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        value = fn(rank, world_size, *args)
        # plain pickle: tensors travel as bytes, not as shared-memory handles that die with this process
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        faulthandler.cancel_dump_traceback_later()
        try:
            from hetu_ext.megatron import host

            host.shutdown()
        except Exception:  # noqa: BLE001 - megatron may be absent; the process ends anyway
            if dist.is_initialized():
                dist.destroy_process_group()


def _kill_group(proc) -> None:
    """Kill a rank and anything it started (its process group); reap it."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.join()


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0,
              preload: Sequence[str] = DEFAULT_PRELOAD) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the per-rank results.

    ``timeout`` (seconds) only catches hangs; ``HETU_TEST_TIMEOUT_SCALE`` multiplies it where the machine is shared
    by design (`make test` runs two tests side by side on two cores)."""
    timeout *= float(os.environ.get("HETU_TEST_TIMEOUT_SCALE", "1"))
    ctx = _context(preload)
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="hetu_store_") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_main, name=f"rank{r}", daemon=False,
                             args=(fn, r, world_size, store_path, args, results, max(timeout - 5.0, 1.0)))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        out: dict[int, Any] = {}
        failures: list[str] = []
        try:
            while len(out) + len(failures) < world_size:
                try:
                    rank, ok, value = results.get(timeout=max(deadline - time.monotonic(), 0.01))
                except queue.Empty:
                    pending = sorted(set(range(world_size)) - set(out) - {int(f.split()[1]) for f in failures})
                    raise RankError(f"ranks {pending} did not finish within {timeout:.0f} s (their stacks are "
                                    "on stderr above)") from None
                if ok:
                    out[rank] = pickle.loads(value)
                else:
                    failures.append(f"rank {rank} raised:\n{value}")
                    break  # the other ranks are likely blocked on the failed one
        finally:
            for p in procs:
                p.join(timeout=10.0 if not failures and len(out) == world_size else 0.0)
                _kill_group(p)
    if failures:
        raise RankError(failures[0])
    return [out[r] for r in range(world_size)]
