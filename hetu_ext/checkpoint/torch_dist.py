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

import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from hetu_ext.runtime.reshard import Piece, ReshardReport, reshard

from .gated import from_megatron, is_gated, to_megatron
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


def _split(name: str, full: torch.Tensor, gated: bool) -> list[Piece]:
    """A global tensor as hetu pieces: one per layer for stacked layer tensors, else one; a ``gated`` one
    (Megatron's ``[gate; up]``) with its gate axis (:mod:`.gated`)."""
    key = name.split("/", 1)[1]
    if key.startswith(_LAYERED):
        layers = [from_megatron(full[layer]) if gated else full[layer] for layer in range(full.shape[0])]
        return [Piece(name, (layer,), tuple((0, d) for d in t.shape), t) for layer, t in enumerate(layers)]
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
    gated = sorted({p.key for p in mine if is_gated(p.key, tuple(b - a for a, b in p.box))})
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (sorted({p.key for p in mine}), error, gated), group=group)
    errors = sorted({e for _, e, _ in everyone if e})
    if errors:
        raise CheckpointError("; ".join(errors))
    wanted = {name for names, _, _ in everyone for name in names}
    gated_names = {name for _, _, names in everyone for name in names}
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
    sources = [p for key, full in reading.items()
               for p in _split(tensors[key][0], full, tensors[key][0] in gated_names)]
    return reshard(sources, mine, group=group)


_EXPORT_KINDS = {"param": "", "exp_avg": "optimizer.state.exp_avg.", "exp_avg_sq": "optimizer.state.exp_avg_sq.",
                 "master": "optimizer.state.fp32_param."}


def export(full: dict[tuple[str, tuple[int, ...]], torch.Tensor], directory: str, *, iteration: int,
           optimizer_step: float | None) -> int:
    """Write full hetu tensors as a dist_checkpointing (torch_dist) checkpoint ``directory/iter_NNNNNNN``.

    Per-layer tensors are stacked along the leading layer axis under Megatron's keys; the tracker file is
    written last. Megatron-core's own loader reads the model weights from it (load the model's ShardedTensors: the
    layers' ``_extra_state`` objects, empty for the local layer spec, are not written; its optimizer loader also
    needs Megatron's parameter groups, which are not recorded: load those through hetu_ext). Returns tensors.
    """
    from torch.distributed.checkpoint import FileSystemWriter, save

    stacked: dict[str, dict[int, torch.Tensor]] = {}
    state: dict[str, torch.Tensor] = {}
    for (name, index), t in full.items():
        kind, key = name.split("/", 1)
        if kind not in _EXPORT_KINDS:
            raise CheckpointError(f"{name}: no dist_checkpointing counterpart for kind {kind!r}")
        target = _EXPORT_KINDS[kind] + key
        if is_gated(key, tuple(t.shape)):
            t = to_megatron(t)  # Megatron's [gate; up]
        if index:
            stacked.setdefault(target, {})[index[0]] = t
        else:
            state[target] = t.contiguous()
    for target, layers in stacked.items():
        if sorted(layers) != list(range(len(layers))):
            raise CheckpointError(f"{target}: layers {sorted(layers)} are not 0..{len(layers) - 1}")
        state[target] = torch.stack([layers[i] for i in range(len(layers))])
    path = Path(directory) / f"iter_{iteration:07d}"
    path.mkdir(parents=True, exist_ok=True)
    save(state, storage_writer=FileSystemWriter(str(path)), no_dist=True)
    common = {"optimizer": {"state": {"common_step": torch.tensor(optimizer_step)}}} \
        if optimizer_step is not None else {}
    torch.save(common, path / "common.pt")
    (path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                    "common_backend": "torch", "common_backend_version": 1}))
    tracker = Path(directory) / "latest_checkpointed_iteration.txt"
    tracker.with_suffix(".tmp").write_text(str(iteration))
    tracker.with_suffix(".tmp").replace(tracker)
    return len(state)
