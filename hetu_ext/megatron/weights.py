"""Layout-agnostic weights: initialise and gather a stage model's tensors by their global identity.

Megatron-core describes every parameter of a stage by a ``ShardedTensor`` (``model.sharded_state_dict()``): a
global key, the global shape and this rank's offset in it. Layers
are stacked along a prepended axis indexed by the *global* layer number, so the same key and index name the same
tensor under any TP / PP / DP layout.

* :func:`init_weights` fills each local shard from a generator seeded by (seed, key, layer index): the same seed
  gives the same model under every layout, which Megatron's own initialisation does not (its RNG stream depends
  on the stage and TP rank).
* :func:`gather_weights` assembles the full tensors (on every rank) from every copy, requiring copies of one
  element to agree bit for bit: how tests compare weights across layouts.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hetu_ext.errors import HetuExtError


@dataclass(frozen=True)
class LocalShard:
    """One local piece of a global tensor: ``global[index][slices] == data`` (index: the prepended axes)."""

    key: str
    index: tuple[int, ...]
    """Positions along the prepended axes (the global layer number for stacked layer tensors)."""
    slices: tuple[slice, ...]
    shape: tuple[int, ...]
    """Global shape of one tensor, without the prepended axes."""
    data: torch.Tensor


def local_shards(model: torch.nn.Module, *, layer_offset: int = 0, metadata: dict | None = None
                 ) -> Iterator[LocalShard]:
    """Every ShardedTensor of ``model`` (a GPTModel, or wrappers around one) as a :class:`LocalShard`.

    ``layer_offset``: global number of the stage's first layer when the stage model was built with local layer
    numbering (the plan runtime); Megatron's own pipeline layout numbers layers globally (offset 0).
    ``metadata``: passed to ``sharded_state_dict`` (the plan runtime supplies its ``dp_cp_group`` there).
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    module = model
    while hasattr(module, "module"):
        module = module.module
    # A last stage holding a tied output layer names it after the first stage's embedding; Megatron 0.16.1 does
    # that renaming through parallel_state's data-parallel group (ignoring pg_collection), so ask for the untied
    # form and rename here.
    tied_copy = bool(getattr(module, "share_embeddings_and_output_weights", False) and module.post_process
                     and not module.pre_process)
    if tied_copy:
        module.share_embeddings_and_output_weights = False
    try:
        state = module.sharded_state_dict(metadata=metadata)
    finally:
        if tied_copy:
            module.share_embeddings_and_output_weights = True
    for sh in nested_values(state):
        if not isinstance(sh, ShardedTensor):
            continue  # _extra_state objects carry no weights
        if tied_copy and sh.key == "output_layer.weight":
            sh = dataclasses.replace(sh, key="embedding.word_embeddings.weight")
        if sh.flattened_range is not None:
            raise NotImplementedError(f"{sh.key}: flattened shards are not supported")
        n = sh.prepend_axis_num
        index = tuple(o + layer_offset if k == 0 else o for k, o in enumerate(sh.global_offset[:n]))
        slices = tuple(slice(o, o + s) for o, s in zip(sh.global_offset[n:], sh.local_shape))
        yield LocalShard(key=sh.key, index=index, slices=slices, shape=tuple(sh.global_shape[n:]),
                         data=sh.data)


def initial_value(key: str, index: tuple[int, ...], shape: tuple[int, ...], *, seed: int, std: float,
                  num_layers: int) -> torch.Tensor:
    """The fp32 initial value of one global tensor: norms 1, biases 0, weights N(0, std).

    Output projections of each layer (``linear_proj``, ``linear_fc2``) use std / sqrt(2 num_layers), as Megatron's
    ``output_layer_init_method`` does.
    """
    name = key.rsplit(".", 1)[-1]
    if "norm" in key and name in ("weight", "layer_norm_weight"):
        return torch.ones(shape)
    if name.endswith("bias"):
        return torch.zeros(shape)
    if key.endswith(("linear_proj.weight", "linear_fc2.weight")):
        std = std / math.sqrt(2.0 * num_layers)
    generator = torch.Generator().manual_seed(
        (seed * 1_000_003 + zlib.crc32(key.encode()) * 10_007 + sum(i * 31 ** k for k, i in enumerate(index)))
        % (2**63))
    return torch.randn(shape, generator=generator) * std


@torch.no_grad()
def init_weights(model: torch.nn.Module, *, seed: int, std: float, num_layers: int, **shard_kwargs) -> int:
    """Set every parameter of a stage model to its layout-independent initial value. Returns elements set.

    Also checks that every TP-split parameter carries Megatron's ``tensor_model_parallel`` mark, which the
    global grad norm relies on to count each shard once (0.16.1 omits it when perform_initialization=False).
    """
    count = 0
    for shard in local_shards(model, **shard_kwargs):
        split = tuple(s.stop - s.start for s in shard.slices) != shard.shape
        if split and not getattr(shard.data, "tensor_model_parallel", False) and shard.data.requires_grad:
            raise HetuExtError(f"{shard.key}: a TP-split parameter lacks tensor_model_parallel=True, so Megatron "
                               "would count one shard in the grad norm; build with perform_initialization=True")
        full = initial_value(shard.key, shard.index, shard.shape, seed=seed, std=std, num_layers=num_layers)
        shard.data.copy_(full[shard.slices])
        count += shard.data.numel()
    return count


def gather_weights(model: torch.nn.Module | None, group=None, values: dict | None = None,
                   **shard_kwargs) -> dict[str, torch.Tensor]:
    """Full fp32 tensors by key (layer tensors stacked along their prepended axis), on every rank of ``group``.

    Every copy of every piece is gathered (ranks holding nothing, e.g. unused ones, pass ``model=None``), and
    copies of one element must agree bit for bit: replicas that drifted apart are an error, not an average.
    ``values`` (parameter id -> tensor of its shape) gathers those instead, e.g. the optimizer's fp32 masters.
    """
    values = values or {}
    mine = [(s.key, s.index, s.slices, s.shape, values.get(id(s.data), s.data).detach().float().cpu().clone())
            for s in local_shards(model, **shard_kwargs)] if model is not None else []
    everyone: list = [None] * (dist.get_world_size(group) if dist.is_initialized() else 1)
    if dist.is_initialized():
        dist.all_gather_object(everyone, mine, group=group)
    else:
        everyone = [mine]
    return assemble(p for part in everyone for p in part)


def assemble(pieces) -> dict[str, torch.Tensor]:
    """Build full tensors from ``(key, index, slices, shape, data)`` pieces.

    Every element must be covered at least once; where pieces overlap (replicas, TP copies of replicated
    tensors, the tied output layer) their values must be identical.
    """
    pieces = list(pieces)
    lead: dict[str, list[int]] = {}
    for key, index, _, _, _ in pieces:
        cur = lead.setdefault(key, [0] * len(index))
        for k, i in enumerate(index):
            cur[k] = max(cur[k], i + 1)
    out: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    for key, index, slices, shape, data in pieces:
        if key not in out:
            out[key] = torch.zeros(tuple(lead[key]) + tuple(shape))
            covered[key] = torch.zeros(out[key].shape, dtype=torch.bool)
        region, seen = out[key][index][slices], covered[key][index][slices]
        if bool(seen.any()) and not torch.equal(region[seen], data[seen]):
            worst = float((region[seen] - data[seen]).abs().max())
            raise AssertionError(f"{key}{list(index)}: copies of the same elements differ (max {worst:.3e})")
        region.copy_(data)
        seen.fill_(True)
    for key, cov in covered.items():
        if not bool(cov.all()):
            raise AssertionError(f"{key}: {int((~cov).sum())} elements are held by no rank")
    return out
