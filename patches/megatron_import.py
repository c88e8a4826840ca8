"""Import Megatron-core with ``torch.compile`` deferred to each compiled function's first call.

Megatron-core decorates its fused element-wise functions with ``jit_fuser``, which is ``torch.compile`` on torch
>= 2.2 (``megatron/core/jit.py``). Calling ``torch.compile(fn)`` compiles nothing yet, but it imports TorchDynamo
and Inductor, about 1.6 CPU-seconds per process, paid by every rank at ``import megatron.core`` whether or not a
fused function ever runs (on CPU, where hetu_ext turns those fusions off, none does). While
:func:`deferred_compile` is in effect, ``torch.compile(fn)`` returns a wrapper that makes the very same call on
the wrapper's first use and then calls what it returned: what runs, and when it compiles, is unchanged; only the
imports move to the first fused call. Modules (``torch.compile(module)``) are compiled at once, as before.
Where ``TORCHDYNAMO_DISABLE=1`` is set at that first call (hetu_ext sets it on CPU), ``torch.compile`` would return
the function itself (``torch._dynamo.optimize``'s null decorator): the wrapper uses the function itself then, and
nothing is imported at all (Megatron-LM's ``_warmup_jit_function`` calls the fused functions at start-up).

Only the import of Megatron-core is wrapped (:func:`import_megatron_core`); ``torch.compile`` is the original
again when it returns. Megatron's ``jit_fuser``, bound during that import, keeps deferring.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys
import threading
from typing import Any, Callable, Iterator

import torch


def _deferring(compile_fn: Callable[..., Any]) -> Callable[..., Any]:
    """A stand-in for ``compile_fn`` (``torch.compile``) that defers the call for plain functions."""

    def compile(model: Any = None, **kwargs: Any) -> Any:
        if model is None:  # used as @torch.compile(...): the decorator applies the same deferral
            return lambda fn: compile(fn, **kwargs)
        if isinstance(model, torch.nn.Module) or not callable(model):
            return compile_fn(model, **kwargs)
        lock = threading.Lock()
        compiled: list[Callable[..., Any]] = []

        @functools.wraps(model)
        def first_call_compiles(*args: Any, **kw: Any) -> Any:
            if not compiled:
                with lock:
                    if not compiled:
                        disabled = os.environ.get("TORCHDYNAMO_DISABLE", "") == "1"  # as torch._dynamo reads it
                        compiled.append(model if disabled else compile_fn(model, **kwargs))
            return compiled[0](*args, **kw)

        first_call_compiles.__hetu_deferred_compile__ = True
        return first_call_compiles

    return compile


@contextlib.contextmanager
def deferred_compile() -> Iterator[None]:
    """``torch.compile`` defers plain functions for the duration of the block (then it is the original again)."""
    real = torch.compile
    torch.compile = _deferring(real)
    try:
        yield
    finally:
        torch.compile = real


def import_megatron_core() -> Any:
    """``import megatron.core`` with :func:`deferred_compile` in effect, the first time in this process."""
    if "megatron.core" in sys.modules:
        return sys.modules["megatron.core"]
    with deferred_compile():
        return importlib.import_module("megatron.core")
