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
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hetu_ext.errors import HetuExtError
from hetu_ext.model import inventory


@dataclass(frozen=True)
class LocalShard:
    """One local piece of a global tensor: ``global[index][slices] == data`` (index: the prepended axes).

    ``data`` is ``param`` itself, or a view of all of it in the global tensor's axes: a gated ``linear_fc1``
    (SwiGLU, GeGLU) holds ``[gate_r; up_r]`` on each TP rank, which is no box of Megatron's global ``[gate; up]``
    (rows ``2F``), so its global tensor gets a leading gate axis, ``(2, F, ...)`` (:mod:`hetu_ext.checkpoint.gated`;
    the same bytes as ``[gate; up]`` in row-major order), of which the rank holds the box
    ``(0:2, rF/tp:(r+1)F/tp, ...)``, a view of the whole local parameter. Anything that belongs to the
    parameter (its fp32 master, ``main_grad``, Adam moments) takes the box's shape through :meth:`view`.
    """

    key: str
    index: tuple[int, ...]
    """Positions along the prepended axes (the global layer number for stacked layer tensors)."""
    slices: tuple[slice, ...]
    shape: tuple[int, ...]
    """Global shape of one tensor, without the prepended axes."""
    data: torch.Tensor
    param: torch.Tensor
    """The local parameter (or buffer) that ``data`` views: optimizer state and ``main_grad`` are found by it."""

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (shaped like :attr:`param`: its master, gradient or a moment) in the box's shape."""
        return tensor if tensor.shape == self.data.shape else tensor.view(self.data.shape)

    @property
    def gated(self) -> bool:
        return self.data is not self.param


def local_shards(model: torch.nn.Module, *, layer_offset: int = 0, metadata: dict | None = None
                 ) -> list[LocalShard]:
    """Every tensor of ``model``'s sharded state dict (a GPTModel, or wrappers around one) as a
    :class:`LocalShard`; raises :class:`HetuExtError` on an entry it has no rule for, and unless the shards cover
    every element of every parameter (:func:`check_coverage`).

    ``layer_offset``: global number of the stage's first layer when the stage model was built with local layer
    numbering (the plan runtime); Megatron's own pipeline layout numbers layers globally (offset 0).
    ``metadata``: passed to ``sharded_state_dict`` (the plan runtime supplies its ``dp_cp_group`` there).
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values

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
    shards = []
    for entry in nested_values(state):
        for shard in _entry_shards(entry, layer_offset):
            if tied_copy and shard.key == "output_layer.weight":
                shard = dataclasses.replace(shard, key="embedding.word_embeddings.weight")
            shards.append(shard)
    check_coverage(module, shards)
    return shards


def _entry_shards(entry, layer_offset: int) -> list[LocalShard]:
    """The rule for each kind of entry of a sharded state dict; anything else is refused by name."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    if isinstance(entry, ShardedTensor):
        return [_shard(entry, entry.data, entry.data, layer_offset)]
    if isinstance(entry, ShardedObject) and entry.key.endswith("._extra_state") and not _holds_tensor(entry.data):
        return []  # the local spec's layers have no extra state (Transformer Engine's FP8 metadata would)
    if isinstance(entry, ShardedTensorFactory):
        return [_gated_shard(entry, layer_offset)]
    raise HetuExtError(f"{entry.key}: sharded_state_dict() returned a {type(entry).__name__} that hetu_ext has no "
                       "rule for (a model option or layer spec it does not cover); drop that option or use "
                       "--hetu-ckpt-format auto (Megatron's own checkpoints)")


def _holds_tensor(data) -> bool:
    if torch.is_tensor(data):
        return data.numel() > 0
    if isinstance(data, dict):
        return any(_holds_tensor(v) for v in data.values())
    if isinstance(data, (list, tuple)):
        return any(_holds_tensor(v) for v in data)
    return False


def _shard(sh, data: torch.Tensor, param: torch.Tensor, layer_offset: int) -> LocalShard:
    if sh.flattened_range is not None:
        raise HetuExtError(f"{sh.key}: flattened shards (Megatron's distributed optimizer layout) have no rule "
                           "here; save the model's own parameters")
    n = sh.prepend_axis_num
    index = tuple(o + layer_offset if k == 0 else o for k, o in enumerate(sh.global_offset[:n]))
    slices = tuple(slice(o, o + s) for o, s in zip(sh.global_offset[n:], sh.local_shape))
    return LocalShard(key=sh.key, index=index, slices=slices, shape=tuple(sh.global_shape[n:]), data=data,
                      param=param)


def _gated_shard(factory, layer_offset: int) -> LocalShard:
    """Megatron's gated-rows factory (``apply_swiglu_sharded_factory``): it builds two ShardedTensors of one key,
    the gate half ``t[:f]`` at rows ``r f`` and the up half ``t[f:]`` at rows ``F + r f`` of ``[gate; up]``
    (``F`` = global rows / 2, ``f`` = local rows / 2). Anything else a factory builds is refused by name."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    param = factory.data
    built = list(nested_values(factory.build()))
    why = None
    if len(built) != 2 or not all(isinstance(b, ShardedTensor) and b.key == factory.key for b in built):
        why = f"it builds {[type(b).__name__ for b in built]}"
    else:
        gate, up = built
        n, f = gate.prepend_axis_num, param.shape[0] // 2
        rows = gate.global_shape[n]
        if not (param.is_contiguous() and gate.data.data_ptr() == param.data_ptr()
                and up.data.data_ptr() == param[f:].data_ptr() and tuple(gate.local_shape) == (f, *param.shape[1:])
                and up.global_offset[n] - gate.global_offset[n] == rows // 2
                and gate.global_offset[:n] == up.global_offset[:n]):
            why = "its halves are not the gate and up rows of one parameter"
    if why is not None:
        raise HetuExtError(f"{factory.key}: a ShardedTensorFactory that hetu_ext has no rule for ({why}); only "
                           "Megatron's gated linear_fc1 (--swiglu) is known; drop that option or use "
                           "--hetu-ckpt-format auto (Megatron's own checkpoints)")
    shard = _shard(gate, param.view(2, f, *param.shape[1:]), param, layer_offset)
    return dataclasses.replace(shard, slices=(slice(0, 2), *shard.slices), shape=(2, rows // 2, *shard.shape[1:]))


def check_coverage(module: torch.nn.Module, shards: list[LocalShard]) -> None:
    """Every element of every parameter of ``module`` is in exactly one shard (parameters marked
    ``hetu_saved_apart``, e.g. LoRA adapters, have their own checkpoint); raises naming the ones that are not."""
    covered: dict[int, int] = {}
    for s in shards:
        covered[id(s.param)] = covered.get(id(s.param), 0) + s.data.numel()
    seen, short = set(), []
    for name, p in module.named_parameters():
        if id(p) in seen or getattr(p, "hetu_saved_apart", None):
            continue
        seen.add(id(p))
        if covered.get(id(p), 0) != p.numel():
            short.append(f"{name} ({covered.get(id(p), 0)} of {p.numel()} elements)")
    if short:
        raise HetuExtError(f"the sharded state dict does not cover {len(short)} parameter(s): "
                           f"{', '.join(short[:4])}{' ...' if len(short) > 4 else ''}; hetu_ext refuses to save or "
                           "load a partial model")


def initial_value(key: str, index: tuple[int, ...], shape: tuple[int, ...], *, seed: int, std: float,
                  num_layers: int) -> torch.Tensor:
    """The fp32 initial value of one global tensor, by the model inventory's rule for ``key``
    (:func:`hetu_ext.model.inventory.init_rule`): norms 1, biases 0, weights N(0, std), each layer's output
    projections (``linear_proj``, ``linear_fc2``) N(0, std / sqrt(2 num_layers)) as Megatron's
    ``output_layer_init_method``; a key the inventory does not list is an error, not a guess."""
    rule = inventory.init_rule(key)
    if rule == "ones":
        return torch.ones(shape)
    if rule == "zeros":
        return torch.zeros(shape)
    if rule == "normal_output":
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
        if split and not getattr(shard.param, "tensor_model_parallel", False) and shard.param.requires_grad:
            raise HetuExtError(f"{shard.key}: a TP-split parameter lacks tensor_model_parallel=True, so Megatron "
                               "would count one shard in the grad norm; build with perform_initialization=True")
        full = initial_value(shard.key, shard.index, shard.shape, seed=seed, std=std, num_layers=num_layers)
        if getattr(shard.param, "zero_centered_gamma", False):  # --apply-layernorm-1p: stored as gamma - 1
            full = full - 1
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
    mine = [(s.key, s.index, s.slices, s.shape, s.view(values.get(id(s.param), s.param)).detach().float().cpu().clone())
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
