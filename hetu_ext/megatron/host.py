"""Megatron-core as host: CPU support, the device and backend, and process-group start-up and tear-down."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from hetu_ext.patches.megatron_cpu import megatron_cpu_patches, needs_cpu_patches

logger = logging.getLogger(__name__)

_CPU_PATCHES = None


class _SameGeneratorWarningFilter(logging.Filter):
    """On CPU the tracker's "CUDA" RNG is the CPU generator, so its check that forking left the CPU RNG alone
    always fires; drop that one message (only while the CPU patches are in effect)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


_RNG_FILTER = _SameGeneratorWarningFilter()
_RNG_LOGGER = "megatron.core.tensor_parallel.random"


def enable_cpu_support(force: bool | None = None) -> bool:
    """Apply the Megatron-core CPU patches when no CUDA device is present (or when ``force`` is True).

    Idempotent. Returns whether the patches are in effect. On a CUDA machine nothing is patched unless forced.
    """
    global _CPU_PATCHES
    if _CPU_PATCHES is not None and _CPU_PATCHES.applied:
        return True
    if not needs_cpu_patches(force):
        return False  # CUDA: dynamo stays on (compiled FlexAttention for packs, --hetu-compile)
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # megatron's unfused paths would torch.compile on CPU
    _CPU_PATCHES = megatron_cpu_patches()
    _CPU_PATCHES.apply()
    logging.getLogger(_RNG_LOGGER).addFilter(_RNG_FILTER)
    logger.info("megatron-core CPU support: applied %d patches", len(_CPU_PATCHES.patches))
    return True


def disable_cpu_support() -> None:
    """Remove the CPU patches, restoring Megatron-core exactly."""
    global _CPU_PATCHES
    if _CPU_PATCHES is not None:
        _CPU_PATCHES.remove()
    _CPU_PATCHES = None
    logging.getLogger(_RNG_LOGGER).removeFilter(_RNG_FILTER)


@dataclass(frozen=True)
class Host:
    """Where this process runs: its device, backend, rank and world size."""

    device: torch.device
    backend: str
    rank: int
    world_size: int
    cpu_patched: bool


def init_distributed(*, force_cpu: bool | None = None, timeout_minutes: float = 10.0,
                     backend: str | None = None) -> Host:
    """Start torch.distributed from torchrun's environment (or reuse a started one).

    ``force_cpu``: None runs on CUDA when present, else on CPU; True runs on CPU (patching Megatron); False
    requires CUDA. Backend: NCCL with CUDA, gloo on CPU, unless ``backend`` says otherwise.
    """
    if force_cpu is False and not torch.cuda.is_available():
        raise ValueError("--hetu-cpu-patches off needs a CUDA device and none is available; use auto or on")
    use_cuda = torch.cuda.is_available() and not force_cpu
    patched = enable_cpu_support(True if not use_cuda else None)
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group(backend=backend or ("nccl" if use_cuda else "gloo"),
                                timeout=timedelta(minutes=timeout_minutes))
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    return Host(device=device, backend=dist.get_backend(), rank=dist.get_rank(), world_size=dist.get_world_size(),
                cpu_patched=patched)


def shutdown() -> None:
    """Destroy Megatron's model-parallel state and the process group (gloo may abort at exit otherwise)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
