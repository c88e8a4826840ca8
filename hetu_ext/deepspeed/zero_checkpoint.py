"""DeepSpeed ZeRO-0/1/2/3 checkpoints as a reshard source, with no offline step (no ``ds_to_universal``).

A DeepSpeed checkpoint ``DIR/<tag>/`` (``DIR/latest`` names the tag) holds the model states (the module's
weights for ZeRO-1/2, placeholders for ZeRO-3; ``param_shapes``: parameter names and shapes in flattening order;
``global_steps``; the client state) and one ``*_optim_states.pt`` per data-parallel rank with that rank's
partition of each flattened fp32 parameter group and of Adam's moments. DeepSpeed's own reconstruction
(``deepspeed.utils.zero_to_fp32``: concatenate the ZeRO-1/2 partitions and cut them by ``param_shapes`` and
the alignment paddings; zip the ZeRO-3 per-parameter partitions) is applied here to the fp32 groups and, in the
same way, to the ``exp_avg`` / ``exp_avg_sq`` flat groups, in-process. Each kind (``param``, ``master``,
``exp_avg``, ``exp_avg_sq``) is rebuilt by one rank (the optimizer files are memory-mapped, so a rank reads
only the kind it rebuilds), cut into per-layer pieces named as the hetu format names them
(``decoder.layers.3.X`` -> ``decoder.layers.X`` at index (3,)), and handed to the reshard engine, which
delivers every rank the boxes its plan holds. Rebuilding moves bytes only: values are bit-exact, except
``param`` of ZeRO-3 with a 16-bit model, which is the fp32 master rounded to the model dtype.

This module lives in the DeepSpeed adapter because it uses DeepSpeed's reconstruction and Megatron-core's layer
spec (the checkpoint key names); both are imported on first use, so importing it stays cheap.
:data:`ZERO_CHECKPOINTS` is the format ``python -m hetu_ext.checkpoint`` reads DeepSpeed folders through
(hetu_ext/checkpoint/formats.py).
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hetu_ext.checkpoint.manifest import CheckpointError
from hetu_ext.runtime.reshard import Piece, ReshardReport, reshard

logger = logging.getLogger(__name__)

LATEST = "latest"
KINDS = ("param", "master", "exp_avg", "exp_avg_sq")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class DeepSpeedInfo:
    """What the model states of a DeepSpeed checkpoint say (rank 0's model states file)."""

    path: Path
    """The tag directory (``DIR/global_stepN``)."""
    zero_stage: int
    world_size: int
    global_steps: int
    shapes: dict[str, torch.Size]
    """Trainable parameter name -> shape, in DeepSpeed's flattening order."""
    client_state: dict[str, Any] = field(default_factory=dict)
    """Entries saved through ``save_checkpoint(client_state=...)`` (hetu_ext's DeepSpeed path: ``hetu_ext``)."""
    optimizer_step: float | None = None


MODEL_STATES = "mp_rank_00_model_states.pt"
"""Rank 0's model states; a ZeRO-0 tag holds only this file (the optimizer's state dict inside it)."""


def _is_tag(root: Path) -> bool:
    return any(root.glob("*_optim_states.pt")) or (root / MODEL_STATES).is_file()


def is_deepspeed(directory: str) -> bool:
    """A ``DIR`` with DeepSpeed's ``latest`` tag file and no hetu / Megatron tracker (whether the tag it names is
    complete is checked on reading, with an error naming the missing files), or a DeepSpeed tag directory."""
    root = Path(directory)
    if _is_tag(root):
        return True
    return (root / LATEST).is_file() and not (root / "latest_checkpointed_iteration.txt").exists()


def tag_path(directory: str) -> Path:
    """``DIR/<latest tag>``, or ``DIR`` itself when given a tag directory."""
    root = Path(directory)
    if _is_tag(root):
        return root
    latest = root / LATEST
    if not latest.is_file():
        raise CheckpointError(f"{directory}: no DeepSpeed checkpoint (no '{LATEST}' file and no *_optim_states.pt); "
                              "give the save_checkpoint directory or one of its tag directories")
    path = root / latest.read_text().strip()
    if not _is_tag(path):
        raise CheckpointError(f"{path}: named by {latest} but holds no *_optim_states.pt and no {MODEL_STATES}; "
                              "the save did not finish or the files were moved; point 'latest' at a complete tag")
    return path


def _unwrapped(name: str) -> str:
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def _module_weight(module: dict[str, torch.Tensor], name: str, path: str) -> torch.Tensor:
    """A parameter's entry in the saved module state (a wrapper's state_dict may drop its ``module.``)."""
    for key in (name, _unwrapped(name)):
        if key in module:
            return module[key]
    raise CheckpointError(f"{path}: the model states hold no weight for parameter {name!r} (param_shapes names it); "
                          "the files come from different saves")


@functools.cache
def layer_keys_map() -> tuple[tuple[str, str], ...]:
    """Megatron-core's renaming of a layer's parameter names into its checkpoint keys for the local layer spec
    (``input_layernorm.`` -> ``self_attention.linear_qkv.layer_norm_``, ...): hetu keys are those keys."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return tuple(get_gpt_layer_local_spec().submodules.sharded_state_dict_keys_map.items())


def hetu_name(kind: str, name: str) -> tuple[str, tuple[int, ...]]:
    """A GPTModel parameter name as a hetu (name, index): ``decoder.layers.3.X`` -> (``KIND/decoder.layers.X'``,
    (3,)) with X' the key Megatron's checkpoints use; other names -> (``KIND/NAME``, ()). Wrappers' ``module.``
    prefixes (Megatron's Float16Module under --bf16, DDP) are dropped."""
    name = _unwrapped(name)
    m = _LAYER.match(name)
    if m:
        rest = m.group(2)
        for old, new in layer_keys_map():
            if rest.startswith(old):
                rest = new + rest[len(old):]
                break
        return f"{kind}/decoder.layers.{rest}", (int(m.group(1)),)
    return f"{kind}/{name}", ()


def _zero_to_fp32():
    import os

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.utils import zero_to_fp32

    return zero_to_fp32


def _quiet() -> contextlib.ExitStack:
    """zero_to_fp32 reports with print() and tqdm bars: keep them out of the training log."""
    stack = contextlib.ExitStack()
    stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
    stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
    return stack


def _optim_files(path: Path) -> list[str]:
    return _zero_to_fp32().get_optim_files(str(path))


def read_info(directory: str) -> DeepSpeedInfo:
    """Parse the model states and the optimizer files' headers (memory-mapped; no partition is read)."""
    z = _zero_to_fp32()
    path = tag_path(directory)
    try:
        model_files = z.get_model_state_files(str(path))
        states = torch.load(model_files[0], map_location="cpu", mmap=True, weights_only=False)
        if not any(path.glob("*_optim_states.pt")) and _saved_stage(states) == 0:
            return _stage0_info(path, states)
        optim = torch.load(_optim_files(path)[0], map_location="cpu", mmap=True, weights_only=False)
    except (FileNotFoundError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable DeepSpeed ZeRO checkpoint ({e})") from None
    osd = optim["optimizer_state_dict"]
    if "zero_stage" not in osd and "single_partition_of_fp32_groups" in osd:
        osd = {**osd, "zero_stage": 1}  # ZeRO-0 with bf16 (DeepSpeed's BF16_Optimizer): ZeRO-1's flat layout
    if "zero_stage" not in osd:
        raise CheckpointError(f"{path}: the optimizer files hold no ZeRO state (zero_stage); only ZeRO-1/2/3 "
                              "checkpoints load (a stage-0 checkpoint is a plain state dict: load it as such)")
    world = osd["partition_count"]
    world = max(world) if isinstance(world, list) else int(world)
    inner = osd.get("base_optimizer_state", osd.get("optimizer_state_dict", {}))
    steps = {float(s["step"]) for s in inner.get("state", {}).values() if "step" in s}
    if len(steps) > 1:
        raise CheckpointError(f"{path}: parameter groups are at different Adam steps {sorted(steps)}")
    shapes = {name: torch.Size(shape) for group in states["param_shapes"] for name, shape in group.items()}
    client = {"hetu_ext": states["hetu_ext"]} if "hetu_ext" in states else {}  # hetu_ext.deepspeed.engine's
    return DeepSpeedInfo(path=path, zero_stage=int(osd["zero_stage"]), world_size=world,
                         global_steps=int(states.get("global_steps", 0)), shapes=shapes, client_state=client,
                         optimizer_step=steps.pop() if steps else None)


def _saved_stage(states: dict[str, Any]) -> int | None:
    zero = (states.get("ds_config") or {}).get("zero_optimization") or {}
    return int(zero.get("stage", 0)) if isinstance(zero, dict) else None


def _stage0_info(path: Path, states: dict[str, Any]) -> DeepSpeedInfo:
    """ZeRO-0 (DeepSpeed without ZeRO): the module's weights and torch's optimizer state dict, in rank 0's model
    states. The state dict numbers the parameters in the optimizer's order, which hetu_ext's DeepSpeed path saves
    as ``parameter_order`` in its client state (DeepSpeed records no names for it at stage 0)."""
    client = states.get("hetu_ext") or {}
    order = client.get("parameter_order")
    if not order:
        raise CheckpointError(f"{path}: a ZeRO-0 DeepSpeed checkpoint whose optimizer state names no parameters "
                              "(DeepSpeed numbers them; hetu_ext's DeepSpeed path saves their names); load one saved "
                              "by launch/pretrain_gpt_deepspeed.py, or save under ZeRO-1")
    optimizer = _stage0_optimizer(states)
    steps = {float(s["step"]) for s in optimizer.get("state", {}).values() if "step" in s}
    if len(steps) > 1:
        raise CheckpointError(f"{path}: parameters at different Adam steps {sorted(steps)}")
    module = states["module"]
    shapes = {name: _module_weight(module, name, str(path)).shape for name in order}
    return DeepSpeedInfo(path=path, zero_stage=0, world_size=int(states.get("dp_world_size", 1)),
                         global_steps=int(states.get("global_steps", 0)), shapes=shapes,
                         client_state={"hetu_ext": client}, optimizer_step=steps.pop() if steps else None)


def _stage0_optimizer(states: dict[str, Any]) -> dict[str, Any]:
    """ZeRO-0's torch optimizer state dict: the saved one, or under --bf16 the one inside DeepSpeed's
    FP16_UnfusedOptimizer's (beside its ``fp32_groups``, the masters)."""
    optimizer = states.get("optimizer") or {}
    return optimizer.get("optimizer_state_dict", optimizer)


def _rebuild_stage0(info: DeepSpeedInfo, kind: str) -> dict[str, torch.Tensor]:
    """ZeRO-0: the module's weights (fp32: the masters too; --bf16: the masters are FP16_UnfusedOptimizer's
    ``fp32_groups``), or the moments, by the saved parameter order."""
    states = torch.load(info.path / MODEL_STATES, map_location="cpu", mmap=True, weights_only=False)
    order = info.client_state["hetu_ext"]["parameter_order"]
    masters = (states.get("optimizer") or {}).get("fp32_groups")
    if kind == "master" and masters is not None:
        return {name: t.clone() for name, t in zip(order, [t for group in masters for t in group])}
    if kind in ("param", "master"):
        return {n: _module_weight(states["module"], n, str(info.path)).clone() for n in info.shapes}
    state = _stage0_optimizer(states)["state"]
    return {name: state[i][kind].clone() for i, name in enumerate(order)}


def hetu_names(info: DeepSpeedInfo) -> set[str]:
    """The hetu names (``KIND/KEY``) of every tensor the checkpoint holds (moments only after a step)."""
    kinds = KINDS if info.optimizer_step is not None else KINDS[:2]
    return {hetu_name(k, n)[0] for k in kinds for n in info.shapes}


def rebuild(info: DeepSpeedInfo, kind: str) -> dict[str, torch.Tensor]:
    """Full tensors of one kind by DeepSpeed parameter name, through DeepSpeed's own reconstruction."""
    if info.zero_stage == 0:
        return _rebuild_stage0(info, kind)
    z = _zero_to_fp32()
    path = str(info.path)
    with _quiet():
        model_states = z.parse_model_states(z.get_model_state_files(path))
    module = torch.load(z.get_model_state_files(path)[0], map_location="cpu", mmap=True,
                        weights_only=False)["module"]
    if kind == "param" and info.zero_stage <= 2:
        return {n: _module_weight(module, n, path).clone() for n in info.shapes}
    files = _optim_files(info.path)
    if len(files) != info.world_size:
        raise CheckpointError(f"{path}: {len(files)} *_optim_states.pt files for a ZeRO world size of "
                              f"{info.world_size}; a rank's file is missing or left over from another save")
    optims = [torch.load(f, map_location="cpu", mmap=True, weights_only=False)["optimizer_state_dict"]
              for f in files]
    fp32_key = "single_partition_of_fp32_groups" if info.zero_stage <= 2 else "fp32_flat_groups"
    if kind in ("param", "master"):
        flat = [o[fp32_key] for o in optims]
    else:
        inner = "base_optimizer_state" if info.zero_stage <= 2 else "optimizer_state_dict"
        flat = [[o[inner]["state"][g][kind] for g in sorted(o[inner]["state"])] for o in optims]
    out: dict[str, Any] = {}
    with _quiet():
        if info.zero_stage <= 2:
            z._zero2_merge_trainable_params(out, info.world_size, flat, model_states,
                                            optims[0].get("param_alignment_paddings"))
        else:
            z._zero3_merge_trainable_params(out, info.world_size, flat, model_states)
            out = z.to_torch_tensor(out)
    if kind == "param":  # ZeRO-3 keeps placeholders of the model's dtype: the fp32 master in that dtype
        return {n: out[n].detach().to(_module_weight(module, n, path).dtype) for n in info.shapes}
    return {n: out[n].detach().clone() for n in info.shapes}


def _gated_key(key: str) -> bool:
    from hetu_ext.checkpoint.gated import GATED_SUFFIXES

    return key.endswith(GATED_SUFFIXES)


def _wants_gated(mine: list[Piece]) -> bool:
    """This rank's destinations hold a gated MLP's ``linear_fc1`` with the gate axis (``(2, F, ...)``, --swiglu):
    DeepSpeed stores Megatron's ``[gate; up]`` ``(2F, ...)``, the same bytes in the same order."""
    return any(_gated_key(p.key) and len(p.box) == (3 if p.key.endswith("weight") else 2) for p in mine)


def _pieces(kind: str, full: dict[str, torch.Tensor], gated: bool = False) -> list[Piece]:
    from hetu_ext.checkpoint.gated import from_megatron

    pieces = []
    for name, t in full.items():
        key, index = hetu_name(kind, name)
        if gated and _gated_key(key):
            t = from_megatron(t)
        pieces.append(Piece(key, index, tuple((0, d) for d in t.shape), t))
    return pieces


def _shape_error(info: DeepSpeedInfo, mine: list[Piece]) -> str | None:
    """The first destination piece that does not fit the stored tensor's shape (another model configuration)."""
    shapes = {}
    gated = _wants_gated(mine)
    for name, shape in info.shapes.items():
        key, index = hetu_name("param", name)
        if gated and _gated_key(key):
            shape = (2, shape[0] // 2, *shape[1:])
        shapes[(key.split("/", 1)[1], index)] = tuple(shape)
    for p in mine:
        shape = shapes.get((p.key.split("/", 1)[1], p.index))
        if shape is not None and (len(shape) != len(p.box) or any(b > s for (_, b), s in zip(p.box, shape))):
            return (f"{p.key}{list(p.index)}: the model holds box {p.box} but the DeepSpeed checkpoint stores "
                    f"{list(shape)}; the model configuration differs from the saved one")
    return None


def load_resharded(directory: str, destinations: list[Piece] | Callable[[set[str]], list[Piece]], *,
                   group=None) -> tuple[DeepSpeedInfo, ReshardReport]:
    """Fill this rank's destination pieces from the DeepSpeed checkpoint under ``directory`` (collective).

    ``destinations`` may be a function of the set of hetu names the checkpoint holds. Raises
    :class:`CheckpointError` on every rank if some rank wants a tensor the checkpoint lacks.
    """
    info = read_info(directory)
    names = hetu_names(info)
    mine = destinations(names) if callable(destinations) else destinations
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    missing = sorted({p.key for p in mine} - names)
    error = (f"{info.path}: the DeepSpeed checkpoint has no {missing[:3]} ({len(missing)} missing; it holds e.g. "
             f"{sorted(names)[:3]}); it was saved from another model or optimizer") if missing else None
    error = error or _shape_error(info, mine)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (sorted({p.key.split('/', 1)[0] for p in mine}), error, _wants_gated(mine)),
                           group=group)
    errors = sorted({e for _, e, _ in everyone if e})
    if errors:
        raise CheckpointError("; ".join(errors))
    wanted = sorted({kind for kinds, _, _ in everyone for kind in kinds}, key=KINDS.index)
    gated = any(g for _, _, g in everyone)  # the rank rebuilding a kind may hold no fc1 itself
    sources: list[Piece] = []
    for i, kind in enumerate(wanted):
        if i % world == rank:
            sources += _pieces(kind, rebuild(info, kind), gated)
    report = reshard(sources, mine, group=group)
    if rank == 0:
        logger.info("loaded DeepSpeed ZeRO-%d checkpoint %s (world size %d, step %d): %s", info.zero_stage,
                    info.path, info.world_size, info.global_steps, ", ".join(wanted))
    return info, report


def read_full(directory: str, kinds: tuple[str, ...] = KINDS) -> dict[tuple[str, tuple[int, ...]], torch.Tensor]:
    """Every tensor of the given kinds, by (hetu name, index), in this process (no process group): the CLI."""
    info = read_info(directory)
    if info.optimizer_step is None:
        kinds = tuple(k for k in kinds if k in KINDS[:2])
    return {(p.key, p.index): p.tensor for kind in kinds for p in _pieces(kind, rebuild(info, kind))}


def cli_lines(command: str, path: str, output: str | None = None, kind: str = "param",
              to: str = "safetensors") -> list[str]:
    """``python -m hetu_ext.checkpoint inspect|convert`` on a DeepSpeed checkpoint (:data:`ZERO_CHECKPOINTS`)."""
    info = read_info(path)
    if command == "inspect":
        lines = [(f"DeepSpeed ZeRO-{info.zero_stage} checkpoint {info.path}: saved by {info.world_size} rank(s), "
                  f"global step {info.global_steps}, Adam step {info.optimizer_step}, {len(info.shapes)} parameters"),
                 "", f"{'tensor (hetu name)':<60} {'index':<6} shape"]
        for name, shape in info.shapes.items():
            key, index = hetu_name("param", name)
            lines.append(f"{key:<60} {','.join(map(str, index)):<6} {'x'.join(map(str, shape))}")
        return lines
    if command == "verify":
        raise CheckpointError(f"{path}: a DeepSpeed checkpoint carries no checksums to verify; 'inspect' reads "
                              "its structure, 'convert' rebuilds every tensor")
    if to == "torch_dist":
        from hetu_ext.checkpoint.torch_dist import export

        full = read_full(path, ("param", "exp_avg", "exp_avg_sq"))
        count = export(full, output, iteration=info.global_steps, optimizer_step=info.optimizer_step)
        return [f"wrote a dist_checkpointing checkpoint ({count} tensors, iteration {info.global_steps}) to {output}"]
    if to != "safetensors":
        raise CheckpointError(f"--to {to}: DeepSpeed checkpoints convert to safetensors or torch_dist (the GPT-2 "
                              "layout needs the attention head count, which DeepSpeed does not record)")
    if kind not in KINDS:
        raise CheckpointError(f"--kind {kind}: a DeepSpeed checkpoint holds {list(KINDS)}; pick one of them")
    from safetensors.torch import save_file

    tensors = {}
    for (key, index), t in read_full(path, (kind,)).items():
        name = key.split("/", 1)[1]
        tensors[f"decoder.layers.{index[0]}.{name[len('decoder.layers.'):]}" if index else name] = t.contiguous()
    save_file(tensors, output, metadata={"iteration": str(info.global_steps), "kind": kind})
    return [f"wrote {len(tensors)} tensors ({kind}, iteration {info.global_steps}) to {output}"]


@dataclass(frozen=True)
class ZeroCheckpoints:
    """DeepSpeed ZeRO-0/1/2/3 folders as a format of the checkpoint CLI (hetu_ext/checkpoint/formats.py) and of the
    trainer's ``--load`` (hetu_ext/megatron/checkpointing.py)."""

    name: str = "DeepSpeed ZeRO"

    def recognises(self, path: str) -> bool:
        """:func:`is_deepspeed`: file names only, DeepSpeed is not imported."""
        return is_deepspeed(path)

    def cli_lines(self, command: str, path: str, output: str | None, kind: str, to: str) -> list[str]:
        """:func:`cli_lines`."""
        return cli_lines(command, path, output, kind, to)

    def load_into(self, target, path: str):
        """``--load`` of hetu_ext's trainer (hetu_ext.megatron.checkpointing.TrainerCheckpoints): the checkpoint
        resharded into ``target``'s plan (a hetu_ext.megatron.checkpoint_target.CheckpointTarget: its placement and
        rank); its run state, which the trainer's parts restore."""
        from .resume import load_deepspeed

        return load_deepspeed(target, path)


ZERO_CHECKPOINTS = ZeroCheckpoints()
"""The DeepSpeed format ``python -m hetu_ext.checkpoint`` reads (hetu_ext/checkpoint/__main__.py)."""
