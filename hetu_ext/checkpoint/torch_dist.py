"""Megatron-core ``dist_checkpointing`` (torch_dist) checkpoints as a reshard source, without an offline step.

A torch_dist checkpoint is PyTorch's distributed-checkpoint format: global tensors by key, per-layer tensors
stacked along a leading layer axis (``decoder.layers.mlp.linear_fc1.weight`` of shape [L, 64, 32]), Adam's
moments under ``optimizer.state.exp_avg.<key>``, and the bf16 runs' fp32 masters under
``optimizer.state.fp32_param.<key>``. Here each global tensor is read whole by one rank (the rank with the fewest
bytes read so far, among tensors some rank needs), cut into per-layer pieces named as the hetu format names
them, and handed to the reshard engine, which delivers every rank the boxes its plan holds. Only torch is
imported (no Megatron).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from hetu_ext.runtime.reshard import Piece, ReshardReport, reshard

from .manifest import CheckpointError

logger = logging.getLogger(__name__)

_KINDS = {"optimizer.state.exp_avg.": "exp_avg", "optimizer.state.exp_avg_sq.": "exp_avg_sq",
          "optimizer.state.fp32_param.": "master"}
_LAYERED = "decoder.layers."


def hetu_name(key: str) -> str | None:
    """``optimizer.state.exp_avg.K`` -> ``exp_avg/K``, ``K`` -> ``param/K``; None for non-tensor entries."""
    if "_extra_state" in key:
        return None
    for prefix, kind in _KINDS.items():
        if key.startswith(prefix):
            return f"{kind}/{key[len(prefix):]}"
    if key.startswith("optimizer."):
        return None
    return f"param/{key}"


def tensors_of(path: str) -> dict[str, tuple[str, torch.Size, torch.dtype]]:
    """dcp key -> (hetu name, global shape, dtype) for every tensor of the checkpoint directory ``path``."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 - torch raises various errors for a missing or bad .metadata
        raise CheckpointError(f"{path}: not a readable dist_checkpointing (torch_dist) checkpoint ({e})") from None
    out = {}
    for key, md in metadata.state_dict_metadata.items():
        name = hetu_name(key)
        if name is not None and isinstance(md, TensorStorageMetadata):
            out[key] = (name, md.size, md.properties.dtype)
    return out


def _split(name: str, full: torch.Tensor) -> list[Piece]:
    """A global tensor as hetu pieces: one per layer for stacked layer tensors, else one."""
    key = name.split("/", 1)[1]
    if key.startswith(_LAYERED):
        return [Piece(name, (layer,), tuple((0, d) for d in full.shape[1:]), full[layer])
                for layer in range(full.shape[0])]
    return [Piece(name, (), tuple((0, d) for d in full.shape), full)]


def load_resharded(path: str, destinations: list[Piece] | Callable[[set[str]], list[Piece]], *,
                   group=None) -> ReshardReport:
    """Fill this rank's destination pieces from the torch_dist checkpoint in ``path`` (collective).

    ``destinations`` may be a function of the set of hetu names the checkpoint holds.
    """
    from torch.distributed.checkpoint import FileSystemReader, load

    tensors = tensors_of(path)
    mine = destinations({n for n, _, _ in tensors.values()}) if callable(destinations) else destinations
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    missing = sorted({p.key for p in mine} - {n for n, _, _ in tensors.values()})
    error = (f"{path}: the checkpoint has no {missing[:3]} ({len(missing)} missing); it was saved from another "
             "model or optimizer") if missing else None
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (sorted({p.key for p in mine}), error), group=group)
    errors = sorted({e for _, e in everyone if e})
    if errors:
        raise CheckpointError("; ".join(errors))
    wanted = {name for names, _ in everyone for name in names}
    load_by_rank = [0] * world
    reading = {}
    for key, (name, shape, dtype) in sorted(tensors.items()):
        if name in wanted:
            reader = min(range(world), key=lambda r: (load_by_rank[r], r))
            load_by_rank[reader] += shape.numel() * dtype.itemsize
            if reader == rank:
                reading[key] = torch.empty(shape, dtype=dtype)
    if reading:
        load(reading, storage_reader=FileSystemReader(path), no_dist=True)
    sources = [p for key, full in reading.items() for p in _split(tensors[key][0], full)]
    return reshard(sources, mine, group=group)
