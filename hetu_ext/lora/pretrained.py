"""LobRA's pretrained base (issue 16): ``--pretrained-checkpoint DIR`` fills the frozen base from a checkpoint.

As Megatron-LM's flag of that name: the model's weights only (no master copies, no Adam moments, no iteration,
LR schedule, losses or RNG) from the latest committed checkpoint under ``DIR``, which a pretraining run saved
with ``--save`` in hetu_ext's format, under any layout (the pieces are resharded into the running plan by
hetu_ext.checkpoint.load.load_pieces; destinations: this rank's base shards, hetu_ext.megatron.weights.
local_shards, which do not include the adapters). It happens before ``--load`` resumes the adapters: the base
always comes from ``DIR``, the adapters (and the run's iteration, schedule, losses) from ``--load``.

The adapters checkpoint records the base it was trained on (:func:`base_record`: the pretrained checkpoint's
run identity and iteration, or the seed); a resume on another base is refused with one line (check_tenants).
A torch_dist checkpoint, a LoRA adapters checkpoint, or one of another model shape is refused with one line.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from hetu_ext.checkpoint import CheckpointError, LocalStorage
from hetu_ext.checkpoint.manifest import MANIFEST, Manifest

logger = logging.getLogger(__name__)

FLAG = "--pretrained-checkpoint"


# ---------------------------------------------------------------- which base (pure)


def seed_base(seed: int) -> dict[str, Any]:
    """The base of a run without a pretrained checkpoint: the layout-independent initialisation of ``seed``."""
    return {"kind": "seed", "seed": int(seed)}


def base_record(manifest: Manifest | None, *, seed: int, directory: str | None = None) -> dict[str, Any]:
    """What identifies the frozen base: the pretrained checkpoint (run identity, iteration) or the seed."""
    if manifest is None:
        return seed_base(seed)
    return {"kind": "pretrained", "run_id": manifest.run_id, "iteration": manifest.iteration,
            "path": None if directory is None else str(Path(directory).resolve())}


def saved_base(lora: dict[str, Any]) -> dict[str, Any]:
    """The base an adapters checkpoint's ``state["lora"]`` records (checkpoints written before bases were
    recorded were always trained on the seed's base)."""
    base = lora.get("base")
    return base if isinstance(base, dict) else seed_base(lora.get("seed", -1))


def describe(base: dict[str, Any]) -> str:
    if base.get("kind") == "pretrained":
        return f"the pretrained checkpoint {base.get('path')} (run {base.get('run_id')}, iteration " \
               f"{base.get('iteration')})"
    return f"the base initialised from seed {base.get('seed')} (no {FLAG})"


def same_base(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The same base weights: the same pretrained checkpoint (run and iteration; the folder may have moved), or
    the same seed."""
    if a.get("kind") != b.get("kind"):
        return False
    if a.get("kind") == "pretrained":
        return (a.get("run_id"), a.get("iteration")) == (b.get("run_id"), b.get("iteration"))
    return a.get("seed") == b.get("seed")


SHAPE = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "max_position_embeddings",
         "untie_embeddings_and_output_weights")


def _shape(config: dict[str, Any]) -> dict[str, Any]:
    out = {k: config.get(k) for k in SHAPE}
    if out["ffn_hidden_size"] is None and out["hidden_size"] is not None:
        out["ffn_hidden_size"] = 4 * out["hidden_size"]
    if out["max_position_embeddings"] is None:
        out["max_position_embeddings"] = config.get("seq_length")
    out["untie_embeddings_and_output_weights"] = bool(out["untie_embeddings_and_output_weights"])
    return out


def check_shape(saved: dict[str, Any], now: dict[str, Any], *, where: str) -> None:
    """The checkpoint's model settings (``manifest.config``, flag destinations) are this run's: else one line."""
    a, b = _shape(saved), _shape(now)
    for key in SHAPE:
        if a[key] != b[key]:
            flag = "--" + key.replace("_", "-")
            if isinstance(a[key], bool):
                raise CheckpointError(f"{FLAG} {where} holds a model {'with' if a[key] else 'without'} {flag}, this "
                                      f"run is {'with' if b[key] else 'without'} it: the base must have the pretrained "
                                      f"model's shape; run {'with' if a[key] else 'without'} {flag}")
            raise CheckpointError(f"{FLAG} {where} holds a model with {flag} {a[key]}, this run has {b[key]}: the "
                                  f"base must have the pretrained model's shape; run with {flag} {a[key]}")


def pretrained_manifest(directory: str) -> Manifest:
    """The manifest of the latest committed hetu checkpoint under ``directory`` (pure), or one-line
    CheckpointError: no such folder, no committed checkpoint, a torch_dist one, a LoRA adapters one."""
    from .checkpoint import FORMAT, latest_manifest

    root = Path(directory)
    if not root.is_dir():
        raise CheckpointError(f"{FLAG} {directory}: no such directory; give the --save directory of a pretraining "
                              "run")
    tracker = root / "latest_checkpointed_iteration.txt"
    if not tracker.exists() and not any(root.glob(f"iter_*/{MANIFEST}")):
        raise CheckpointError(f"{FLAG} {directory}: holds no committed checkpoint (no latest_checkpointed_iteration"
                              ".txt, no iter_NNNNNNN/manifest.json); give the --save directory of a pretraining run "
                              "that saved at least once")
    text = tracker.read_text().strip() if tracker.exists() else ""
    if text.isdigit() and not (root / f"iter_{int(text):07d}" / MANIFEST).exists() \
            and (root / f"iter_{int(text):07d}").is_dir():
        raise CheckpointError(f"{FLAG} {directory}: iteration {int(text)} is a torch_dist checkpoint; a pretrained "
                              "base is read from hetu_ext's format only: save the pretraining run with "
                              "--hetu-ckpt-format hetu (the default without --use-distributed-optimizer)")
    manifest = latest_manifest(directory)
    if manifest is None:  # pragma: no cover - checked above
        raise CheckpointError(f"{FLAG} {directory}: holds no committed checkpoint")
    if (manifest.state.get("lora") or {}).get("format") == FORMAT:
        raise CheckpointError(f"{FLAG} {directory} (iteration {manifest.iteration}) is a LoRA adapters checkpoint "
                              "(no base weights); give the pretraining run's --save directory, and the adapters' "
                              "directory to --load")
    return manifest


# ---------------------------------------------------------------- load (collective)


def load_base(trainer, directory: str) -> dict[str, Any]:
    """Collective over every rank: the frozen base's weights from the latest checkpoint under ``directory`` into
    this plan (``param/KEY`` pieces only); returns the base's record."""
    from hetu_ext.checkpoint.load import load_pieces
    from hetu_ext.checkpoint.shardfile import BY_NAME
    from hetu_ext.megatron.weights import local_shards
    from hetu_ext.runtime.reshard import Piece

    placement, config = trainer.placement, trainer.config
    start = time.perf_counter()

    casts: list = []  # (parameter, tensor read in the stored dtype) of the last destinations
    first = pretrained_manifest(directory)  # every rank reads the same files: all agree, no collective needed
    check_shape(first.config, config.to_flat_dict(), where=f"{directory} (iteration {first.iteration})")

    def destinations(manifest: Manifest) -> list:
        where = f"{directory} (iteration {manifest.iteration})"
        if manifest.iteration != first.iteration:  # pragma: no cover - a save into DIR while this run starts
            raise CheckpointError(f"{FLAG} {directory}: its latest checkpoint changed while loading")
        if not placement.active:
            return []
        stored = {(t.name, tuple(t.index)): tuple(t.shape) for t in manifest.tensors}
        dtypes = {(t.name, tuple(t.index)): BY_NAME.get(t.dtype) for t in manifest.tensors}
        pieces, casts[:] = [], []
        for s in local_shards(placement.model, **placement.shard_kwargs):
            if ".lora_" in s.key:  # adapters are not part of the base (they are excluded from sharded_state_dict)
                raise AssertionError(f"adapter {s.key} among the base's shards")
            key = f"param/{s.key}"
            shape = stored.get((key, s.index))
            if shape is None:
                raise CheckpointError(f"{FLAG} {where} has no tensor {key}{list(s.index)}; it was saved from "
                                      "another model; give a checkpoint of this model")
            if shape != s.shape:
                raise CheckpointError(f"{FLAG} {where}: {key} is {list(shape)} there, {list(s.shape)} in this "
                                      "model; the base must have the pretrained model's shape (vocabulary, sizes)")
            target, dtype = s.data.data, dtypes[(key, s.index)]
            if dtype is not None and dtype != target.dtype and dtype.is_floating_point:
                # a --bf16 pretraining run's model weights into this fp32 base: read as stored, then cast (exact)
                target = torch.empty(s.data.shape, dtype=dtype)
                casts.append((s.data.data, target))
            pieces.append(Piece(key, s.index, tuple((sl.start, sl.stop) for sl in s.slices), target))
        return pieces

    try:
        report = load_pieces(LocalStorage(directory), destinations, fallback=False, read=config.checkpoint.read)
    except CheckpointError as exc:  # the resume hint (--hetu-ckpt-fallback) does not apply to a base
        raise CheckpointError(str(exc).split("; --hetu-ckpt-fallback")[0]) from None
    manifest = report.manifest
    with torch.no_grad():
        for param, value in casts:
            param.copy_(value)
    if trainer.host.rank == 0:
        logger.info("loaded the pretrained base of iteration %d from %s (weights only, %.2f s)", manifest.iteration,
                    directory, time.perf_counter() - start)
    return base_record(manifest, seed=config.training.seed, directory=directory)
