"""Megatron-LM's training package (``megatron/training``, tag core_v0.16.1) on a CPU-only machine: the patches,
each named, probed and removable, on top of :mod:`hetu_ext.patches.megatron_cpu` (Megatron-core's).

A user's Megatron-LM checkout brings ``pretrain_gpt.py`` and ``megatron/{training,legacy,...}``; megatron-core comes
from pip. ``megatron/training`` assumes CUDA in a few more places than megatron-core: ``initialize_megatron``
asserts CUDA, ``_initialize_distributed`` sets the device and creates the model-parallel groups only when
``torch.cuda.device_count() > 0``, ``_compile_dependencies`` builds the dataset helpers and the fused kernels with
nvcc, tensors are made with ``device='cuda'`` (training, utils, checkpointing, core timers), ``get_model`` and
the batch loader call ``.cuda()``, the checkpoint's RNG state reads the CUDA generator, and ``initialize`` imports
megatron-core's batch-invariant kernels, which import ``triton`` at module level.

The same two kinds of patch as Megatron-core's cover them (module-scoped torch: a view of torch seen only by the
listed modules; ``Tensor.cuda`` as identity inside one function), plus three small replacements. No file of the
checkout is modified; :meth:`PatchSet.remove` restores every attribute.

:data:`TESTED_TAG` is the Megatron-LM tag these patch points were read from. A checkout whose patch points moved is
refused by :func:`check_patch_points` with the symbol and the tag (:class:`MegatronLMVersionError`), before any
patch is applied.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.machinery
import sys
import types
from typing import Any, Callable, Iterable

import torch

from .base import Patch, PatchError, PatchSet
from .megatron_cpu import _CpuCuda, _CpuTorch

TESTED_TAG = "core_v0.16.1"
"""The Megatron-LM tag (``git describe``) whose ``megatron/training`` these patches and hooks were written for."""

_MT = "megatron.training"
_MC = "megatron.core"


class MegatronLMVersionError(PatchError):
    """The Megatron-LM checkout lacks a symbol hetu_ext patches or hooks (it is not the tested tag)."""


class _TrainingCuda(_CpuCuda):
    """``torch.cuda`` as a patched training module sees it: Megatron-core's CPU stand-in (one CPU device, no-op
    synchronisation and streams, the CPU generator) plus what ``megatron/training`` asks of it: a device that is
    available and set, zero memory counters."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith(("memory_", "max_memory_")) or name in ("device_memory_used",):
            return lambda *a, **k: 0
        return getattr(self._real, name)

    is_available = staticmethod(lambda: True)
    device_count = staticmethod(lambda: 1)
    set_device = staticmethod(lambda *a, **k: None)
    memory_stats = staticmethod(lambda *a, **k: {})


class _TrainingTorch(_CpuTorch):
    """``torch`` as a patched training module sees it: CUDA devices of tensor factories (random ones too) are the
    CPU."""

    _FACTORIES = _CpuTorch._FACTORIES + ("rand", "randn")
    _CUDA = _TrainingCuda


def _module_torch(real: Any) -> _TrainingTorch:
    if real is not torch:
        raise TypeError(f"expected the torch module, found {real!r}")
    return _TrainingTorch(real)


@contextlib.contextmanager
def _tensor_cuda_is_identity():
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


def _within_cuda_identity(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _tensor_cuda_is_identity():
            return original(*args, **kwargs)

    return wrapper


def _no_compile(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def compile_dependencies() -> None:
        """On CPU: nothing to build (pip's megatron-core ships the dataset helpers; the local transformer
        implementation uses no fused kernel)."""
        return None

    return compile_dependencies


def _arch_zero(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def get_device_arch_version() -> int:
        return 0

    return get_device_arch_version


_TORCH_SCOPED = {
    f"{_MT}.initialize": "asserts CUDA; sets the device and builds the model-parallel groups only with a CUDA "
                        "device; seeds the CUDA RNG tracker only with one",
    f"{_MT}.training": "start-time, loss and flag tensors made with device='cuda'; CUDA streams and memory stats",
    f"{_MT}.utils": "norm and batch-broadcast buffers made on the CUDA device; memory report",
    f"{_MT}.checkpointing": "the iteration all-reduce on the CUDA device; the CUDA RNG state saved and restored",
    f"{_MC}.timers": "torch.cuda.synchronize() and timing buffers on the CUDA device",
    f"{_MC}.rerun_state_machine": "saves and restores the CUDA RNG state around each step; flags made on the "
                                  "CUDA device",
}

PATCH_POINTS: dict[str, str] = {
    f"{_MT}.training:pretrain": "pretrain_gpt.py's entry",
    f"{_MT}.training:initialize_megatron": "argument parsing and process groups",
    f"{_MT}.training:setup_model_and_optimizer": "model, optimizer, --load",
    f"{_MT}.training:get_model": "model construction",
    f"{_MT}.training:train": "the training loop",
    f"{_MT}.training:train_step": "one step",
    f"{_MT}.training:get_forward_backward_func": "the pipeline schedule",
    f"{_MT}.training:save_checkpoint": "--save",
    f"{_MT}.training:load_checkpoint": "--load",
    f"{_MT}.training:build_train_valid_test_data_iterators": "the data iterators",
    f"{_MT}.training:build_pretraining_data_loader": "the train data loader",
    f"{_MT}.initialize:_compile_dependencies": "the dataset-helper and fused-kernel builds",
    f"{_MT}.utils:get_batch_on_this_tp_rank": "batch loading",
    f"{_MT}.arguments:get_device_arch_version": "the device-arch query",
    f"{_MT}.arguments:parse_args": "Megatron-LM's argument parser",
    f"{_MT}.global_vars:get_args": "the parsed arguments",
    f"{_MT}.training:evaluate": "evaluation (--eval-iters)",
    f"{_MC}.transformer.torch_norm:WrappedTorchNorm": "the local layer spec's norms",
}
"""``module:symbol`` -> its role: every symbol of Megatron-LM's training package that hetu_ext patches or hooks."""


def check_patch_points(points: Iterable[str] = PATCH_POINTS) -> None:
    """Raise :class:`MegatronLMVersionError` naming the first missing symbol and the tested tag."""
    for point in points:
        module_name, _, path = point.partition(":")
        try:
            owner: Any = importlib.import_module(module_name)
        except ImportError as exc:
            raise MegatronLMVersionError(
                f"Megatron-LM module {module_name} cannot be imported ({exc}); hetu_ext supports Megatron-LM "
                f"{TESTED_TAG}: check out that tag") from exc
        for part in path.split("."):
            if not hasattr(owner, part):
                raise MegatronLMVersionError(
                    f"Megatron-LM patch point {module_name}.{path} not found (used for "
                    f"{PATCH_POINTS.get(point, 'a hook')}); hetu_ext's hooks are tested with Megatron-LM "
                    f"{TESTED_TAG}: check out that tag")
            owner = getattr(owner, part)


class _Anything:
    """Stands in for any ``triton`` object at import time: a decorator returns the function, an attribute or a
    call returns another stand-in (enough to define, never to run, a Triton kernel)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return self

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()


TRITON_IMPORTERS = (f"{_MC}.transformer.custom_layers.batch_invariant_kernels",)
"""Megatron-core modules that megatron/training imports and that import ``triton`` at module level."""


def import_without_triton(modules: Iterable[str] = TRITON_IMPORTERS) -> list[str]:
    """Import ``modules`` with a stand-in ``triton`` in ``sys.modules`` for the duration of the import only (so no
    other module ever sees it). Returns the modules imported this way (none when triton is installed)."""
    try:
        importlib.import_module("triton")
        return []
    except ImportError:
        pass
    names = ("triton", "triton.language")
    stand_ins = {name: _StandInModule(name) for name in names}
    for name, module in stand_ins.items():
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    stand_ins["triton"].language = stand_ins["triton.language"]
    done = []
    sys.modules.update(stand_ins)
    try:
        for module in modules:
            if module not in sys.modules:
                importlib.import_module(module)
                done.append(module)
    finally:
        for name in names:
            if sys.modules.get(name) is stand_ins[name]:
                del sys.modules[name]
    return done


def megatron_lm_cpu_patches() -> PatchSet:
    """The patches Megatron-LM's training package (tag core_v0.16.1) needs on CPU beyond Megatron-core's."""
    patches = [
        Patch(name=f"cpu_torch:{mod}", target=f"{mod}:torch", make=_module_torch, reason=why)
        for mod, why in _TORCH_SCOPED.items()
    ]
    patches += [
        Patch(name="no_build:_compile_dependencies", target=f"{_MT}.initialize:_compile_dependencies",
              make=_no_compile, reason="builds the dataset helpers with make and the fused kernels with nvcc"),
        Patch(name="tensor_cuda_identity:get_model", target=f"{_MT}.training:get_model",
              make=_within_cuda_identity, reason="moves each model chunk with module.cuda()"),
        Patch(name="tensor_cuda_identity:get_batch_on_this_tp_rank",
              target=f"{_MT}.utils:get_batch_on_this_tp_rank", make=_within_cuda_identity,
              reason="moves the batch with tensor.cuda(non_blocking=True)"),
        Patch(name="arch:get_device_arch_version", target=f"{_MT}.arguments:get_device_arch_version",
              make=_arch_zero, reason="queries the CUDA device's compute capability"),
        Patch(name="tensor_cuda_identity:evaluate", target=f"{_MT}.training:evaluate", make=_within_cuda_identity,
              reason="moves the validation loss sums with tensor.cuda()"),
    ]
    return PatchSet("megatron-lm-cpu", patches)
