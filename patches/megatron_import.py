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

Only the import of Megatron-core is wrapped; ``torch.compile`` is the original again when it returns. Megatron's
``jit_fuser``, bound during that import, keeps deferring. :func:`defer_compile_at_megatron_import` (what
``hetu_ext.megatron`` does when imported; cheap: it imports neither torch nor Megatron) puts a finder on
``sys.meta_path`` that wraps the first import of ``megatron.core``, wherever it happens.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import os
import sys
import threading
from typing import Any, Callable, Iterator


def _deferring(compile_fn: Callable[..., Any]) -> Callable[..., Any]:
    """A stand-in for ``compile_fn`` (``torch.compile``) that defers the call for plain functions."""
    import torch

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
    import torch

    real = torch.compile
    torch.compile = _deferring(real)
    try:
        yield
    finally:
        torch.compile = real


class _DeferringLoader(importlib.abc.Loader):
    """Megatron-core's own loader, its module executed under :func:`deferred_compile`."""

    def __init__(self, real: importlib.abc.Loader) -> None:
        self.real = real

    def create_module(self, spec):
        return self.real.create_module(spec)

    def exec_module(self, module) -> None:
        with deferred_compile():
            self.real.exec_module(module)

    def __getattr__(self, name: str) -> Any:  # resources, is_package, ...: the real loader's
        return getattr(self.real, name)


class _MegatronCoreFinder(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core`` (once) as the path finder does, with :class:`_DeferringLoader` around its loader."""

    def __init__(self) -> None:
        self.done = False

    def find_spec(self, fullname: str, path, target=None):
        if fullname != "megatron.core" or self.done:
            return None
        self.done = True
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None  # not a plain package on a path: imported as it would be
        spec.loader = _DeferringLoader(spec.loader)
        return spec


def defer_compile_at_megatron_import() -> None:
    """The first import of ``megatron.core`` in this process (if it has not happened yet) runs under
    :func:`deferred_compile`. Idempotent."""
    if "megatron.core" in sys.modules or any(isinstance(f, _MegatronCoreFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _MegatronCoreFinder())

