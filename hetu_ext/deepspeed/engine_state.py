"""A DeepSpeed ZeRO-0/1/2/3 engine's state as reshard pieces: what a load fills and a hetu-format save writes.

DeepSpeed keeps each rank's share of the fp32 master weights and of Adam's moments in flat buffers:

* ZeRO-1/2: one flat fp32 partition per parameter group (``single_partition_of_fp32_groups[g]``); parameter ``p``
  covers a contiguous range of it, ``p._hp_mapping`` (DeepSpeed's own link, mixed_precision_linkage.py) says
  which elements of ``p`` flattened (``lp_fragment_address``) sit where in the partition (``hp_fragment_address``).
  The moments are flat tensors of the partition's shape in ``optimizer.state[partition]``. Module weights are
  whole on every rank.
* ZeRO-3: one flat fp32 buffer per sub-group (``fp32_partitioned_groups_flat[g]``); rank r holds elements
  ``[r * n_p, (r + 1) * n_p)`` of each parameter flattened (``n_p = p.partition_numel()``, the last rank padded),
  at ``grad_position[id]`` in its sub-group's buffer. Module weights are placeholders; each rank's share is
  ``p.ds_tensor`` (the model dtype).

* ZeRO-0 (DeepSpeed without ZeRO, fp32): the engine's optimizer is torch's AdamW itself; every rank holds every
  parameter (the fp32 master) and its moments whole (``optimizer.state[p]``). Each parameter is one "partition"
  here, its fragment the whole tensor; a save writes parameter i from rank i mod world size only.

A range of a row-major tensor flattened is a union of boxes (:func:`flat_range_boxes`: a partial first row,
whole rows, a partial last row, recursively), so each fragment becomes one to three pieces (``master/KEY``,
``exp_avg/KEY``, ``exp_avg_sq/KEY``: hetu's names, zero_checkpoint.hetu_name) whose tensors are views into
DeepSpeed's buffers: the reshard engine writes into them in place, a save reads from them. After a load the
model-dtype weights are derived from the masters as DeepSpeed's own step does (:func:`refresh_model_weights`).
Pure bookkeeping over DeepSpeed's buffers: nothing here talks to other ranks except that refresh (ZeRO-1/2's
all-gather of the partitions).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from hetu_ext.runtime.reshard import Piece

from .zero_checkpoint import hetu_name

MOMENTS = ("exp_avg", "exp_avg_sq")

Box = tuple[tuple[int, int], ...]


def flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[Box, int]]:
    """Elements ``[start, stop)`` of a row-major tensor of ``shape`` flattened, as boxes with the offset of each
    box's first element from ``start`` (boxes in flat order, so the i-th box is the next numel(box) elements).

    >>> flat_range_boxes((3, 4), 2, 9)
    [(((0, 1), (2, 4)), 0), (((1, 2), (0, 4)), 2), (((2, 3), (0, 1)), 6)]
    """
    if not 0 <= start <= stop <= math.prod(shape):
        raise ValueError(f"flat range [{start}, {stop}) outside a tensor of shape {tuple(shape)}")
    if start == stop:
        return []
    if len(shape) == 0:
        return [((), 0)]
    if len(shape) == 1:
        return [(((start, stop),), 0)]
    inner = math.prod(shape[1:])
    out: list[tuple[Box, int]] = []
    first, last = start // inner, (stop - 1) // inner
    if first == last:  # within one row
        return [(((first, first + 1),) + box, off)
                for box, off in flat_range_boxes(shape[1:], start - first * inner, stop - first * inner)]
    pos = start
    if start % inner:  # the partial first row
        out += [(((first, first + 1),) + box, off) for box, off in
                flat_range_boxes(shape[1:], start % inner, inner)]
        pos = (first + 1) * inner
    whole_end = (stop // inner) * inner
    if whole_end > pos:  # whole rows
        out.append((((pos // inner, whole_end // inner),) + tuple((0, d) for d in shape[1:]), pos - start))
        pos = whole_end
    if stop > pos:  # the partial last row
        row = pos // inner
        out += [(((row, row + 1),) + box, off + pos - start) for box, off in flat_range_boxes(shape[1:], 0, stop - pos)]
    return out


def hetu_shape(key: str, shape: tuple[int, ...], gated: bool) -> tuple[int, ...]:
    """A parameter's global shape in hetu checkpoints: a gated MLP's ``linear_fc1`` (``--swiglu``) gets a leading gate
    axis, ``(2F, ...)`` -> ``(2, F, ...)`` (hetu_ext/checkpoint/gated.py; the same bytes in the same order)."""
    from hetu_ext.checkpoint.gated import GATED_SUFFIXES

    if gated and key.endswith(GATED_SUFFIXES):
        return (2, shape[0] // 2, *shape[1:])
    return shape


def _fragment_pieces(kind: str, name: str, shape: tuple[int, ...], start: int, flat: torch.Tensor,
                     gated: bool = False) -> list[Piece]:
    """Pieces of parameter ``name``'s elements ``[start, start + flat.numel())`` (flattened), viewing ``flat``."""
    key, index = hetu_name(kind, name)
    shape = hetu_shape(key, shape, gated)
    pieces = []
    for box, off in flat_range_boxes(shape, start, start + flat.numel()):
        extent = tuple(hi - lo for lo, hi in box)
        pieces.append(Piece(key, index, box, flat.narrow(0, off, math.prod(extent)).view(extent)))
    return pieces


def _names(engine) -> dict[int, str]:
    return {id(p): n for n, p in engine.module.named_parameters()}


def zero_stage(engine) -> int:
    return int(engine.zero_optimization_stage())


def layout(engine) -> str:
    """Where the engine keeps the fp32 masters: ``params`` (ZeRO-0: whole on every rank, one tensor per parameter:
    the parameters themselves in fp32, their fp32 copies in DeepSpeed's FP16_UnfusedOptimizer under ``--bf16``),
    ``flat`` (ZeRO-1/2, and DeepSpeed's BF16_Optimizer: each rank a flat fp32 partition per group, linked to the
    parameters' fragments) or ``zero3``."""
    stage = zero_stage(engine)
    if stage == 3:
        return "zero3"
    if stage == 0 and type(engine.optimizer).__name__ != "BF16_Optimizer":
        return "params"
    return "flat"


def _lp_groups(engine) -> list[list[torch.nn.Parameter]]:
    """The model-dtype parameter groups of a ``flat`` layout (ZeRO-1/2's ``bit16_groups``, BF16_Optimizer's
    ``bf16_groups``)."""
    optimizer = engine.optimizer
    return optimizer.bit16_groups if hasattr(optimizer, "bit16_groups") else optimizer.bf16_groups


def _stage0_params(engine) -> list[torch.nn.Parameter]:
    """ZeRO-0: the fp32 masters in the optimizer's order (its state dict numbers them so)."""
    return [p for group in engine.optimizer.param_groups for p in group["params"]]


def stage0_parameters(engine) -> list[tuple[str, torch.Tensor, torch.nn.Parameter]]:
    """ZeRO-0: (name, fp32 master, model parameter) in the optimizer's order; under ``--bf16`` the master is
    FP16_UnfusedOptimizer's fp32 copy (``fp32_groups`` beside ``fp16_groups``), else the parameter itself."""
    names = _names(engine)
    optimizer = engine.optimizer
    if hasattr(optimizer, "fp32_groups") and hasattr(optimizer, "fp16_groups"):
        return [(names[id(lp)], hp, lp) for hps, lps in zip(optimizer.fp32_groups, optimizer.fp16_groups)
                for hp, lp in zip(hps, lps)]
    return [(names[id(p)], p, p) for p in _stage0_params(engine)]


@torch.no_grad()
def undo_initial_step(engine) -> None:
    """ZeRO-0 with ``--bf16``: DeepSpeed's FP16_UnfusedOptimizer creates Adam's state with one step on zero
    gradients when it starts (Adam's step then counts one more than the updates, and AdamW decays the fp32 copies
    once), so the training would not be the single-process one. Its fp32 copies are set back to the parameters
    (whence they were made) and its state emptied: torch's AdamW creates it at the first real step. Other layouts:
    nothing."""
    if layout(engine) != "params":
        return
    copies = [(master, lp) for _, master, lp in stage0_parameters(engine) if master is not lp]
    for master, lp in copies:
        master.data.copy_(lp.data)
    if copies:
        engine.optimizer.optimizer.state.clear()


def _base_state(engine) -> dict:
    """The base optimizer's state, keyed by :func:`flat_partitions`' tensors (ZeRO-0: by the parameters)."""
    optimizer = engine.optimizer
    return optimizer.state if layout(engine) == "params" else optimizer.optimizer.state


def flat_partitions(engine) -> list[torch.Tensor]:
    """This rank's flat fp32 partitions (the tensors the base optimizer steps, one per group / sub-group; ZeRO-0:
    the parameters, whole)."""
    optimizer = engine.optimizer
    if layout(engine) == "params":
        return _stage0_params(engine)
    if layout(engine) == "zero3":
        return list(optimizer.fp32_partitioned_groups_flat)
    if hasattr(optimizer, "single_partition_of_fp32_groups"):
        return list(optimizer.single_partition_of_fp32_groups)
    return list(optimizer.fp32_groups_flat_partition)  # BF16_Optimizer


def _fragments(engine, owned: bool = False) -> Iterable[tuple[str, tuple[int, ...], int, int, int]]:
    """(parameter name, shape, first element of the parameter held here, element count, group, offset in the
    group's flat partition) for each parameter fragment this rank holds (ZeRO-0, ``owned``: only those this
    rank writes, parameter i on rank i mod world size; ZeRO-1/2/3 fragments are each held by one rank)."""
    names = _names(engine)
    optimizer = engine.optimizer
    if layout(engine) == "params":
        import torch.distributed as dist

        rank, world = dist.get_rank(), dist.get_world_size()
        for g, (name, master, _) in enumerate(stage0_parameters(engine)):
            if not owned or g % world == rank:
                yield name, tuple(master.shape), 0, master.numel(), g, 0
        return
    if layout(engine) == "zero3":
        for group in optimizer.fp16_groups:
            for p in group:
                if not p.requires_grad:
                    continue
                g, offset, numel = optimizer.grad_position[optimizer.get_param_id(p)]
                rank = optimizer._get_param_partition_rank(p)
                first = rank * numel
                count = max(0, min(numel, p.ds_numel - first))
                if count:
                    yield names[id(p)], tuple(p.ds_shape), first, count, g, offset
        return
    for g, group in enumerate(_lp_groups(engine)):
        for p in group:
            mapping = getattr(p, "_hp_mapping", None)
            if mapping is None:
                continue
            lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
            yield names[id(p)], tuple(p.shape), lp.start, lp.numel, g, hp.start


def create_optimizer_state(engine, step: float, moments: Iterable[str] = MOMENTS) -> None:
    """Give the base optimizer the state of ``step`` steps for every flat partition (moments uninitialised: a
    load fills every element a parameter covers; the alignment padding beyond them is zeroed), and link it to
    the parameters as DeepSpeed does after its first step."""
    optimizer = engine.optimizer
    base = _base_state(engine)
    for flat in flat_partitions(engine):
        state = {m: torch.zeros_like(flat) for m in moments}
        state["step"] = torch.tensor(float(step), dtype=torch.float32)
        base[flat] = state
    if layout(engine) == "flat":
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()


def engine_pieces(engine, kinds: Iterable[str] = ("master", *MOMENTS), *, master_as: str = "master",
                  gated: bool = False, owned: bool = False) -> list[Piece]:
    """This rank's fragments of the fp32 master weights and Adam moments as pieces viewing DeepSpeed's buffers
    (``kinds`` among ``master``, ``exp_avg``, ``exp_avg_sq``; moments need the optimizer state to exist).
    ``master_as="param"`` names the masters ``param/KEY`` (filled from an fp32 run's weights); ``gated``: the model
    has a gated MLP (``--swiglu``), whose ``linear_fc1`` hetu checkpoints hold as ``(2, F, ...)``; ``owned``:
    what a save writes from this rank (:func:`_fragments`)."""
    flats = flat_partitions(engine)
    state = _base_state(engine)
    pieces: list[Piece] = []
    for name, shape, first, count, g, offset in _fragments(engine, owned):
        for kind in kinds:
            buffer = (flats[g] if kind == "master" else state[flats[g]][kind]).detach().view(-1)
            named = master_as if kind == "master" else kind
            pieces += _fragment_pieces(named, name, shape, first, buffer.narrow(0, offset, count), gated)
    return pieces


def param_pieces(engine, *, gated: bool = False) -> list[Piece]:
    """This rank's model-dtype weights as pieces (``param/KEY``): each fragment of the partitioned copy, so that
    every element is held by exactly one rank (ZeRO-1/2: the module's weights at the rank's fp32 fragments;
    ZeRO-3: ``ds_tensor``)."""
    names = _names(engine)
    pieces: list[Piece] = []
    optimizer = engine.optimizer
    if layout(engine) == "params":  # whole on every rank: parameter i written by rank i mod world size
        by_name = dict(engine.module.named_parameters())
        for name, shape, first, count, _, _ in _fragments(engine, owned=True):
            pieces += _fragment_pieces("param", name, shape, first, by_name[name].data.view(-1), gated)
        return pieces
    if layout(engine) == "zero3":
        by_name = {n: p for n, p in engine.module.named_parameters()}
        for name, shape, first, count, _, _ in _fragments(engine):
            flat = by_name[name].ds_tensor.data.view(-1).narrow(0, 0, count)
            pieces += _fragment_pieces("param", name, shape, first, flat, gated)
        return pieces
    for group in _lp_groups(engine):
        for p in group:
            mapping = getattr(p, "_hp_mapping", None)
            if mapping is not None:
                lp = mapping.lp_fragment_address
                flat = p.data.view(-1).narrow(0, lp.start, lp.numel)
                pieces += _fragment_pieces("param", names[id(p)], tuple(p.shape), lp.start, flat, gated)
    return pieces


def optimizer_step(engine) -> float | None:
    """Adam's step (the same for every partition), or None before the first step."""
    state = _base_state(engine)
    steps = {float(state[f]["step"]) for f in flat_partitions(engine) if f in state and "step" in state[f]}
    if len(steps) > 1:
        raise AssertionError(f"flat partitions at different Adam steps {sorted(steps)}")
    return steps.pop() if steps else None


@torch.no_grad()
def refresh_model_weights(engine) -> None:
    """The model-dtype weights from the fp32 masters, as DeepSpeed's step ends (ZeRO-1/2: copy this rank's
    partition and all-gather, collective; ZeRO-3: copy into each rank's ``ds_tensor`` partitions)."""
    optimizer = engine.optimizer
    if layout(engine) == "params":  # fp32: the parameters are the masters; --bf16: copy the fp32 copies over
        for _, master, lp in stage0_parameters(engine):
            if master is not lp:
                lp.data.copy_(master.data)
        return
    if layout(engine) == "flat":
        optimizer.update_lp_params()
        return
    for lp, fp32 in zip(optimizer.fp16_partitioned_groups_flat, optimizer.fp32_partitioned_groups_flat):
        if lp.data_ptr() != fp32.data_ptr():
            lp.data.copy_(fp32.data)
