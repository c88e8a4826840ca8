"""Megatron-core 0.16.1 on a CPU-only machine (gloo): the patches, each named, probed and removable.

Megatron-core hard-codes CUDA in a handful of modules: tensor factories with ``device="cuda"`` or
``device=torch.cuda.current_device()``, ``torch.cuda.synchronize()``, CUDA streams, the CUDA RNG of the model
parallel RNG tracker, and ``param.type() == 'torch.cuda.FloatTensor'`` checks (../shared/notes/megatron-cpu.md).

Two kinds of patch cover every site without copying any Megatron code:

* **module-scoped torch** (``cpu_torch:<module>``): the module's global name ``torch`` is replaced by a thin
  view of torch whose tensor factories map a CUDA device to the CPU and whose ``torch.cuda`` answers
  ``current_device()`` with the CPU device, makes ``synchronize`` a no-op and routes the RNG calls to the CPU
  generator. Only the listed modules see it; everything else, and every tensor op, is plain torch. A global
  ``TorchFunctionMode`` would do the same for every op and costs ~1.3x on small steps; this costs one attribute
  lookup per factory call.
* **Tensor.cuda as identity** (``tensor_cuda_identity:<function>``): inside the listed function only,
  ``tensor.cuda()`` returns the tensor.
* **CUDA type names** (``cuda_type_names:<function>``): the few functions that compare ``tensor.type()`` with
  ``'torch.cuda.FloatTensor'`` run with ``Tensor.type()`` reporting the CUDA name of a CPU tensor, for the
  duration of that call only.

Nothing here runs on a CUDA machine unless asked: :func:`needs_cpu_patches` decides.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import sys
import functools
from typing import Any, Callable

import torch

from .base import Patch, PatchSet

_CUDA_DEVICE_STRINGS = ("cuda",)


def _to_cpu_device(device: Any) -> Any:
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str) and device.split(":")[0] in _CUDA_DEVICE_STRINGS:
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _NullStream:
    """Stands in for a CUDA stream: waits are no-ops, using it as a context does nothing."""

    def wait_stream(self, other: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def record_event(self, event: Any = None) -> "_NullStream":
        """An event on it (MoE's alltoall dispatcher records one after its device-to-host copies): waiting on it,
        or synchronising it, does nothing."""
        return self

    def wait(self, *_: Any) -> None:
        return None

    def query(self) -> bool:
        return True

    def __enter__(self) -> "_NullStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class _CpuCuda:
    """The ``torch.cuda`` seen by a patched module: CPU device, no-op synchronisation, CPU RNG."""

    def __init__(self, real_cuda: Any) -> None:
        self._real = real_cuda

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cpu")

    @staticmethod
    def synchronize(*_: Any, **__: Any) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def default_stream(*_: Any, **__: Any) -> _NullStream:
        return _NullStream()

    @staticmethod
    def current_stream(*_: Any, **__: Any) -> _NullStream:
        return _NullStream()

    @staticmethod
    def Stream(*_: Any, **__: Any) -> _NullStream:  # noqa: N802 (mirrors torch.cuda.Stream)
        return _NullStream()

    @staticmethod
    def stream(*_: Any, **__: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    @staticmethod
    def get_rng_state(*_: Any, **__: Any) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, *_: Any, **__: Any) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)


class _CpuTorch:
    """The ``torch`` seen by a patched module: tensor factories put CUDA requests on the CPU."""

    _FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "empty_like", "ones_like")
    _CUDA = _CpuCuda
    """What ``torch.cuda`` is to the patched module (Megatron-LM's training package needs a little more)."""

    def __init__(self, real_torch: Any) -> None:
        self._real = real_torch
        self.cuda = self._CUDA(real_torch.cuda)
        for name in self._FACTORIES:
            setattr(self, name, self._cpu_factory(getattr(real_torch, name)))

    @staticmethod
    def _cpu_factory(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        @functools.wraps(factory)
        def cpu_factory(*args: Any, **kwargs: Any) -> torch.Tensor:
            if "device" in kwargs:
                kwargs["device"] = _to_cpu_device(kwargs["device"])
            kwargs.pop("pin_memory", None)
            return factory(*args, **kwargs)

        return cpu_factory

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _module_torch(real: Any) -> _CpuTorch:
    if real is not torch:
        raise TypeError(f"expected the torch module, found {real!r}")
    return _CpuTorch(real)


@contextlib.contextmanager
def _cuda_type_names():
    """Within the block, ``cpu_tensor.type()`` reports ``'torch.cuda.FloatTensor'`` (and so on)."""
    original = torch.Tensor.type

    def type_(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if not args and not kwargs and self.device.type == "cpu" and isinstance(result, str):
            return result.replace("torch.", "torch.cuda.", 1)
        return result

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


def _within(context: Callable[[], contextlib.AbstractContextManager]) -> Callable[[Any], Any]:
    """Patch maker: run the original function (plain, static or class method) inside ``context()``."""

    def make(original: Any) -> Any:
        kind = type(original) if isinstance(original, (staticmethod, classmethod)) else None
        fn = original.__func__ if kind else original

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with context():
                return fn(*args, **kwargs)

        return kind(wrapper) if kind else wrapper

    return make


_with_cuda_type_names = _within(_cuda_type_names)


@contextlib.contextmanager
def _tensor_cuda_is_identity():
    """Within the block, ``tensor.cuda()`` returns the (CPU) tensor itself."""
    original = torch.Tensor.cuda

    def cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self

    torch.Tensor.cuda = cuda
    try:
        yield
    finally:
        torch.Tensor.cuda = original


_with_tensor_cuda_identity = _within(_tensor_cuda_is_identity)


def _cpu_rng_get(original: Callable[..., Any]) -> Callable[..., Any]:
    def get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        state = torch.get_rng_state()
        return state.clone() if clone else state

    return get_rng_state


def _cpu_rng_set(original: Callable[..., Any]) -> Callable[..., Any]:
    def set_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    return set_rng_state


_MC = "megatron.core"
_TORCH_SCOPED_MODULES = {
    f"{_MC}.tensor_parallel.random": "the RNG tracker seeds and forks the CUDA generator",
    f"{_MC}.tensor_parallel.layers": "weight and gather buffers (the sequence-parallel all-gather of a linear "
                                     "layer's input too) are made on torch.cuda.current_device()",
    f"{_MC}.distributed.param_and_grad_buffer": "grad buffers on torch.cuda.current_device(), CUDA streams",
    f"{_MC}.distributed.distributed_data_parallel": "a CUDA communication stream; torch.cuda.synchronize()",
    f"{_MC}.pipeline_parallel.p2p_communication": "shape buffers on the CUDA device; torch.cuda.synchronize()",
    f"{_MC}.pipeline_parallel.schedules": "token counters made with device='cuda'",
    f"{_MC}.optimizer.optimizer": "found_inf and loss scale tensors made with device='cuda'",
    f"{_MC}.optimizer.grad_scaler": "--fp16: the dynamic loss scaler's scale and hysteresis tensors made with "
                                    "device='cuda'",
    f"{_MC}.optimizer.clip_grads": "norm buffers made with device='cuda'",
    f"{_MC}.optimizer.distrib_optimizer": "shard buffers on torch.cuda.current_device()",
    f"{_MC}.transformer.utils": "attention masks made with device='cuda'",
    f"{_MC}.transformer.module": "buffers on torch.cuda.current_device()",
    f"{_MC}.models.common.embeddings.rotary_pos_embedding": "RoPE moves inv_freq to torch.cuda.current_device() "
                                                             "in get_emb (--position-embedding-type rope)",
    f"{_MC}.models.common.embeddings.rope_utils": "context parallelism: RoPE's per-CP-rank chunk index is made in "
                                                   "pinned memory (pin_memory=True)",
    f"{_MC}.tensor_parallel.mappings": "sequence parallelism's gather and reduce-scatter allocate on "
                                       "torch.cuda.current_device() (--sequence-parallel)",
    f"{_MC}.utils": "the global memory buffer and local l2 norm use the CUDA device",
    f"{_MC}.dist_checkpointing.strategies.filesystem_async": "torch.cuda.synchronize() before writing shards",
    f"{_MC}.dist_checkpointing.strategies.state_dict_saver": "save verification flags made on the CUDA device",
    f"{_MC}.transformer.moe.router": "MoE: the router moves its weights to torch.cuda.current_device() at each "
                                     "forward; its token counters are made there",
    f"{_MC}.transformer.moe.token_dispatcher": "MoE: the alltoall dispatcher creates a CUDA stream for its "
                                               "device-to-host copies",
    f"{_MC}.transformer.moe.moe_utils": "MoE: the aux-loss tracker is made with device='cuda'",
}


def _results_queue_by_fork(original: Callable[[], Any]) -> Callable[[], Any]:
    """The torch_dist saver's results queue, its Manager started by fork instead of spawn: a spawned Manager is a
    fresh interpreter that re-imports the whole job (torch, Megatron, the script: 8 s on an idle core, 30 s on a
    busy machine, at every first save of a run). Spawn guards a CUDA context, which a CPU process does not have."""
    module = sys.modules[original.__module__]

    def get_write_results_queue() -> Any:
        if module._results_queue is None:
            module._results_queue = multiprocessing.get_context("fork").Manager().Queue()
        return module._results_queue
    return get_write_results_queue


def _router_gating_linear(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The MoE router's logits in ``router_dtype`` (fp32 or fp64 when asked, else the input's) as a plain linear
    layer: Megatron-core 0.16.1's RouterGatingLinearFunction reads ``te_general_gemm``, a name its module defines
    only when Transformer Engine imports (NameError without it). Autograd's gradients of the cast inputs are the
    ones its hand-written backward computes (in router_dtype, cast back to the input's and the weight's dtypes)."""

    def router_gating_linear(inp: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             router_dtype: torch.dtype) -> torch.Tensor:
        return torch.nn.functional.linear(inp.to(router_dtype), weight.to(router_dtype),
                                          None if bias is None else bias.to(router_dtype))

    return router_gating_linear


def _splits_as_numpy(original: Callable[..., Any]) -> Callable[..., Any]:
    """The alltoall dispatcher's split sizes as numpy arrays on CPU too: Megatron-core converts them (device to
    host) only when they are CUDA tensors, and ``all_to_all_single`` takes sequences of ints, not tensors."""

    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return maybe_move_tensor_to_cpu


def megatron_cpu_patches() -> PatchSet:
    """All patches Megatron-core 0.16.1 needs on CPU, in the order they are applied."""
    patches = [
        Patch(name=f"cpu_torch:{mod.removeprefix(_MC + '.')}", target=f"{mod}:torch", make=_module_torch,
              reason=why)
        for mod, why in _TORCH_SCOPED_MODULES.items()
    ]
    patches += [
        Patch(name="cpu_rng:get", target=f"{_MC}.tensor_parallel.random:_get_cuda_rng_state", make=_cpu_rng_get,
              reason="reads torch.cuda.default_generators"),
        Patch(name="cpu_rng:set", target=f"{_MC}.tensor_parallel.random:_set_cuda_rng_state", make=_cpu_rng_set,
              reason="calls torch._C._cuda_setRNGState"),
        Patch(name="cuda_type_names:clip_grad_by_total_norm_fp32",
              target=f"{_MC}.optimizer.clip_grads:clip_grad_by_total_norm_fp32", make=_with_cuda_type_names,
              reason="asserts grad.type() == 'torch.cuda.FloatTensor'"),
        Patch(name="cuda_type_names:clip_grad_by_total_norm_fp32@optimizer",
              target=f"{_MC}.optimizer.optimizer:clip_grad_by_total_norm_fp32", make=_with_cuda_type_names,
              reason="optimizer.py holds its own reference to the asserting function"),
        Patch(name="cuda_type_names:Float16OptimizerWithFloat16Params",
              target=f"{_MC}.optimizer.optimizer:Float16OptimizerWithFloat16Params.__init__",
              make=_with_cuda_type_names, reason="--bf16: accepts only torch.cuda.*Tensor parameters"),
        Patch(name="cuda_type_names:DistributedOptimizer",
              target=f"{_MC}.optimizer.distrib_optimizer:DistributedOptimizer._build_model_and_main_param_groups",
              make=_with_cuda_type_names, reason="--use-distributed-optimizer: accepts only torch.cuda.*Tensor"),
        Patch(name="tensor_cuda_identity:LanguageModule.setup_embeddings_and_output_layer",
              target=f"{_MC}.models.common.language_module.language_module:LanguageModule."
                     "setup_embeddings_and_output_layer",
              make=_with_tensor_cuda_identity, reason="moves the tied embedding with weight.data.cuda()"),
        Patch(name="tensor_cuda_identity:get_pos_emb_on_this_cp_rank",
              target=f"{_MC}.models.common.embeddings.rotary_pos_embedding:get_pos_emb_on_this_cp_rank",
              make=_with_tensor_cuda_identity, reason="context parallelism: RoPE moves its chunk index with .cuda()"),
        Patch(name="fork_results_queue:filesystem_async",
              target=f"{_MC}.dist_checkpointing.strategies.filesystem_async:_get_write_results_queue",
              make=_results_queue_by_fork, reason="torch_dist saves start a Manager by spawn (re-imports the job)"),
        Patch(name="no_te:router_gating_linear", target=f"{_MC}.transformer.moe.router:router_gating_linear",
              make=_router_gating_linear, reason="MoE without Transformer Engine: the router's linear function reads "
                                                 "te_general_gemm, undefined (NameError)"),
        Patch(name="cpu_splits:maybe_move_tensor_to_cpu",
              target=f"{_MC}.transformer.moe.token_dispatcher:maybe_move_tensor_to_cpu", make=_splits_as_numpy,
              reason="MoE alltoall dispatch: split sizes stay tensors on CPU, which all_to_all_single refuses"),
        Patch(name="tensor_cuda_identity:DynamicGradScaler.load_state_dict",
              target=f"{_MC}.optimizer.grad_scaler:DynamicGradScaler.load_state_dict",
              make=_with_tensor_cuda_identity, reason="--fp16 resume: moves the saved loss scale with .cuda()"),
    ]
    return PatchSet("megatron-cpu", patches)


def needs_cpu_patches(force: bool | None = None) -> bool:
    """Patch when asked (``force=True``), never when told not to (``False``), else only without CUDA."""
    if force is not None:
        return force
    return not torch.cuda.is_available()
