"""``--save`` / ``--load``: hetu_ext's layout-agnostic format (default) or Megatron-core's ``dist_checkpointing``.

**hetu** (``--hetu-ckpt-format hetu``, hetu_ext/checkpoint/): every rank's parameters, fp32 master weights (with
``--bf16``) and Adam moments become pieces with global offsets; each unique element is written once, spread over
its holders, after a short blocking copy to host memory, while training goes on; the commit is atomic and
``latest_checkpointed_iteration.txt`` moves only after it. Loading reshards the stored pieces into the running
plan, whatever it is (another TP / PP / DP, heterogeneous pipelines, another rank count), on either runtime.
The manifest also keeps Adam's step, the LR schedule, the losses so far, the data position (the iteration, from
which both the unpacked and the packed data derive each step's samples, plus consumed samples and the settings
that fix the samples: global batch, seed, sequence length, split, packing; a resume that changes them is refused)
and each rank's RNG states (restored when the plan is the same; under another plan ranks have no counterpart, so
each keeps the RNG its seed gives).

**torch_dist** (Megatron-LM's layout, uniform runtime only): ``DIR/iter_0000004/`` with Megatron's shards and
``hetu_common.pt``; the tracker written last by rank 0 after every rank finished.

``auto`` (the default) saves hetu, except with ``--use-distributed-optimizer`` (ZeRO-1's flat shards are not
expressed as pieces yet), where it saves torch_dist. ``--load`` recognises either format by its files.
"""

from __future__ import annotations

import base64
import logging
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hetu_ext.checkpoint import CheckpointError, LocalStorage
from hetu_ext.checkpoint.load import LoadReport, load_pieces
from hetu_ext.checkpoint.manifest import MANIFEST, Manifest
from hetu_ext.checkpoint.writer import Checkpointer, SaveConfig, checkpoint_name
from hetu_ext.data.assign import global_batch_size
from hetu_ext.plan import PlanError, plan_to_dict
from hetu_ext.runtime.reshard import Piece

from .weights import local_shards

logger = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
MOMENTS = ("exp_avg", "exp_avg_sq", "momentum_buffer")
"""Optimizer state tensors shaped like their parameter (Adam's two moments, SGD's momentum)."""
_CHECKPOINTERS: dict[str, Checkpointer] = {}
"""One asynchronous checkpointer per save directory in this process (its background save outlives a call)."""


def save_format(args) -> str:
    """The format ``--save`` writes: ``hetu`` or ``torch_dist`` (``auto`` resolved)."""
    fmt = getattr(args, "hetu_ckpt_format", "auto")
    if fmt == "auto":
        return "torch_dist" if args.use_distributed_optimizer else "hetu"
    return fmt


def check_plan_runtime(args) -> None:
    """The plan runtime saves the hetu format only (dist_checkpointing needs parallel_state's uniform grid)."""
    if args.save and save_format(args) == "torch_dist":
        raise PlanError("--hetu-ckpt-format torch_dist runs on Megatron's uniform runtime only; this plan runs on "
                        "the plan runtime, so save with --hetu-ckpt-format hetu (or auto)")


# ---------------------------------------------------------------- pieces of the training state


def _optimizers(optimizer) -> list:
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]


def state_pieces(placement, *, moments: set[str] | None = None, step: float | None = None) -> list[Piece]:
    """This rank's parameters, fp32 master weights and optimizer moments as pieces (empty on idle ranks).

    Names: ``param/KEY`` (model dtype), ``master/KEY`` (fp32 copy kept by the optimizer under --bf16),
    ``exp_avg/KEY``, ``exp_avg_sq/KEY``. With ``moments`` given (loading), the optimizer state of every parameter
    is first created with those moments (zeros, to be filled) and Adam's ``step``.
    """
    if not placement.active:
        return []
    states = {}
    for opt in _optimizers(placement.optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                if moments is not None:
                    state = {m: torch.zeros_like(p.data) for m in moments}
                    if step is not None:
                        state["step"] = torch.tensor(float(step), dtype=torch.float32)
                    opt.state[p] = state
                states[id(p)] = opt.state.get(p, {})
    pieces = []
    for s in local_shards(placement.model, **placement.shard_kwargs):
        box = tuple((sl.start, sl.stop) for sl in s.slices)
        pieces.append(Piece(f"param/{s.key}", s.index, box, s.data.data))
        main = getattr(s.data, "main_param", None)
        if main is not None:
            pieces.append(Piece(f"master/{s.key}", s.index, box, main.data))
        state = states.get(id(main if main is not None else s.data), {})
        pieces.extend(Piece(f"{m}/{s.key}", s.index, box, state[m]) for m in MOMENTS if m in state)
    return pieces


def optimizer_step(placement) -> float | None:
    """Adam's step count (the same for every parameter), or None before the first step / without Adam."""
    steps = {float(st["step"]) for opt in _optimizers(placement.optimizer) for st in opt.state.values()
             if "step" in st}
    if len(steps) > 1:
        raise AssertionError(f"parameters are at different optimizer steps {sorted(steps)}")
    return steps.pop() if steps else None


# ---------------------------------------------------------------- RNG states


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.contiguous().view(torch.uint8).numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state(rank: int) -> dict[str, Any]:
    """Python, NumPy, torch and Megatron's model-parallel RNG states of this rank, JSON-able."""
    from megatron.core import tensor_parallel

    version, state, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    tracker = tensor_parallel.get_cuda_rng_tracker().get_states()
    return {"rank": rank, "python": [version, list(state), gauss],
            "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
            "torch": _b64(torch.get_rng_state()),
            "cuda": [_b64(s) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
            "tracker": {k: _b64(v) for k, v in tracker.items() if isinstance(v, torch.Tensor)}}


def set_rng_state(saved: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    version, state, gauss = saved["python"]
    random.setstate((version, tuple(state), gauss))
    name, keys, pos, has_gauss, cached = saved["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(saved["torch"]))
    if saved["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in saved["cuda"]])
    if saved["tracker"]:
        tensor_parallel.get_cuda_rng_tracker().set_states({k: _unb64(v) for k, v in saved["tracker"].items()})


# ---------------------------------------------------------------- hetu format


def _json_safe(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    return str(value)


def data_settings(trainer) -> dict[str, Any]:
    """What fixes the samples of step g (the data position is the iteration): changing any of them on resume
    would skip or repeat samples."""
    args = trainer.args
    return {"global_batch_size": global_batch_size(trainer.plan, args.micro_batch_size), "seed": args.seed,
            "seq_length": args.seq_length, "split": args.split,
            "mock_data": bool(args.mock_data), "packing": getattr(args, "hetu_packing", None),
            "global_batch_tokens": getattr(args, "hetu_global_batch_tokens", None)}


def _checkpointer(trainer, directory: str) -> Checkpointer:
    key = os.path.abspath(directory)
    if key not in _CHECKPOINTERS:
        Path(key).mkdir(parents=True, exist_ok=True)
        keep = getattr(trainer.args, "hetu_ckpt_keep", 2)
        _CHECKPOINTERS[key] = Checkpointer(LocalStorage(key), SaveConfig(keep=keep))
    return _CHECKPOINTERS[key]


def save_hetu(trainer, directory: str, *, blocking: bool | None = None) -> Checkpointer:
    """Collective over the plan's used ranks: snapshot now, write in the background (blocking at the end of
    training, so the last checkpoint is committed before the job exits)."""
    placement = trainer.placement
    if blocking is None:
        blocking = trainer.iteration >= trainer.args.train_iters
    data = data_settings(trainer)
    packed = data["packing"] not in (None, "off")
    info = {"consumed_samples": None if packed else trainer.iteration * data["global_batch_size"],
            "plan": plan_to_dict(trainer.plan), "config": _json_safe(vars(trainer.args)),
            "state": {"scheduler": _json_safe(trainer.scheduler.state_dict()), "losses": list(trainer.losses),
                      "optimizer_step": optimizer_step(placement), "data": data}}
    ckpt = _checkpointer(trainer, directory)
    ckpt.save(iteration=trainer.iteration, pieces=state_pieces(placement), rng=rng_state(trainer.host.rank),
              info=info, group=placement.report_group, blocking=blocking)
    if trainer.host.rank == trainer.log_rank:
        logger.info("checkpoint of iteration %d: %.1f ms blocking, %.2f MiB on this rank (%s)", trainer.iteration,
                    ckpt.last["blocking_s"] * 1e3, ckpt.last["bytes"] / 2**20,
                    "committed" if blocking else "persisting in the background")
    return ckpt


def load_hetu(trainer, directory: str) -> LoadReport:
    """Collective over every rank (idle ones take part with nothing to fill); returns what was read."""
    storage = LocalStorage(directory)
    placement = trainer.placement
    fallback = bool(getattr(trainer.args, "hetu_ckpt_fallback", False))

    def destinations(manifest: Manifest) -> list[Piece]:
        kinds = {t.name.split("/", 1)[0] for t in manifest.tensors}
        step = manifest.state.get("optimizer_step")
        moments = {m for m in MOMENTS if m in kinds} if step is not None else None
        return state_pieces(placement, moments=moments, step=step)

    report = load_pieces(storage, destinations, fallback=fallback, read=getattr(trainer.args, "hetu_ckpt_read", "node"))
    manifest = report.manifest
    saved, now = manifest.state.get("data", {}), data_settings(trainer)
    changed = {k: (saved.get(k), v) for k, v in now.items() if saved.get(k) != v}
    if changed:
        raise CheckpointError(f"checkpoint iteration {manifest.iteration} was trained with other data settings "
                              f"(saved, now): {changed}; resume with the saved values so that step "
                              f"{manifest.iteration + 1} reads the samples that follow, none skipped or repeated")
    trainer.iteration = manifest.iteration
    trainer.losses = list(manifest.state.get("losses", []))
    if trainer.scheduler is not None:
        trainer.scheduler.load_state_dict(manifest.state["scheduler"])
    if manifest.plan == plan_to_dict(trainer.plan):
        mine = [r for r in manifest.rng.values() if r.get("rank") == trainer.host.rank]
        if mine:
            set_rng_state(mine[0])
    elif trainer.host.rank == 0:
        logger.info("the plan differs from the saved one: RNG states stay as the seed sets them")
    if trainer.host.rank == 0:
        logger.info("loaded checkpoint of iteration %d from %s (%.2f MiB mapped by rank 0, %.2f s)%s",
                    manifest.iteration, directory, report.bytes_read / 2**20, report.seconds,
                    "".join(f"; skipped: {s}" for s in report.skipped))
    return report


# ---------------------------------------------------------------- dispatch


def save(trainer, directory: str) -> None:
    """Save in the format of ``--hetu-ckpt-format`` (collective over the plan's used ranks)."""
    if save_format(trainer.args) == "hetu":
        save_hetu(trainer, directory)
    else:
        save_torch_dist(trainer, directory)


def _is_hetu(directory: str) -> bool:
    root = Path(directory)
    tracker = root / TRACKER
    text = tracker.read_text().strip() if tracker.exists() else ""
    if text.isdigit() and (root / checkpoint_name(int(text)) / MANIFEST).exists():
        return True
    return any(root.glob(f"iter_*/{MANIFEST}"))


def load(trainer, directory: str) -> bool:
    """Load the latest checkpoint under ``directory`` (hetu, torch_dist or DeepSpeed ZeRO); False if there is
    none."""
    from hetu_ext.checkpoint.deepspeed_zero import is_deepspeed

    if is_deepspeed(directory):
        from hetu_ext.deepspeed.resume import load_deepspeed

        load_deepspeed(trainer, directory)
        return True
    if latest_iteration(directory) is None:
        if trainer.host.rank == 0:
            logger.warning("--load %s: no checkpoint found, starting from scratch", directory)
        return False
    if _is_hetu(directory):
        load_hetu(trainer, directory)
        return True
    if trainer.placement.grad_sync is not None or not trainer.placement.active:  # the plan runtime
        load_torch_dist_resharded(trainer, directory)
        return True
    return load_torch_dist(trainer, directory)


def load_torch_dist_resharded(trainer, directory: str) -> None:
    """A dist_checkpointing checkpoint into any plan (collective over every rank): its global tensors are read
    once each and resharded into this plan's layout (hetu_ext/checkpoint/torch_dist.py)."""
    from hetu_ext.checkpoint.torch_dist import load_resharded

    iteration = latest_iteration(directory)
    path = Path(directory) / f"iter_{iteration:07d}"
    common = torch.load(path / "common.pt", weights_only=False)
    step = common.get("optimizer", {}).get("state", {}).get("common_step")
    step = float(step) if step is not None else None

    def destinations(names: set[str]) -> list[Piece]:
        moments = {m for m in MOMENTS if any(n.startswith(m + "/") for n in names)} if step is not None else None
        return state_pieces(trainer.placement, moments=moments, step=step)

    report = load_resharded(str(path), destinations)
    extra = path / "hetu_common.pt"  # written by hetu_ext's torch_dist save; Megatron-LM keeps these in common.pt
    extra = torch.load(extra, weights_only=False) if extra.exists() else {
        "iteration": common.get("iteration", iteration), "scheduler": common.get("opt_param_scheduler"),
        "losses": []}
    trainer.iteration = extra["iteration"]
    trainer.losses = list(extra["losses"])
    if trainer.scheduler is not None and extra["scheduler"] is not None:
        trainer.scheduler.load_state_dict(extra["scheduler"])
    if trainer.host.rank == 0:
        logger.info("loaded dist_checkpointing checkpoint %s at iteration %d into the plan (%.2f MiB sent by rank "
                    "0)", path, trainer.iteration, report.bytes_sent / 2**20)


# ---------------------------------------------------------------- torch_dist format (Megatron-core)


def _state(trainer, is_loading: bool) -> dict:
    model_sd = trainer.model.module.sharded_state_dict()
    return {"model": model_sd,
            "optimizer": trainer.optimizer.sharded_state_dict(model_sd, is_loading=is_loading)}


def save_torch_dist(trainer, directory: str) -> Path:
    from megatron.core import dist_checkpointing

    root = Path(directory)
    path = root / f"iter_{trainer.iteration:07d}"
    if trainer.host.rank == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(_state(trainer, is_loading=False), str(path))
    if trainer.host.rank == 0:
        torch.save({"iteration": trainer.iteration, "scheduler": trainer.scheduler.state_dict(),
                    "losses": trainer.losses}, path / "hetu_common.pt")
    dist.barrier()
    if trainer.host.rank == 0:
        tmp = root / f".{TRACKER}.tmp"
        tmp.write_text(str(trainer.iteration))
        os.replace(tmp, root / TRACKER)
        logger.info("saved checkpoint at iteration %d to %s", trainer.iteration, path)
    dist.barrier()
    return path


def latest_iteration(directory: str) -> int | None:
    tracker = Path(directory) / TRACKER
    if not tracker.exists():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{tracker}: expected an iteration number, found {text!r}; fix or delete the file")
    return int(text)


def load_torch_dist(trainer, directory: str) -> bool:
    """Load the latest checkpoint under ``directory`` into the trainer; False if there is none."""
    from megatron.core import dist_checkpointing

    iteration = latest_iteration(directory)
    if iteration is None:
        if trainer.host.rank == 0:
            logger.warning("--load %s: no checkpoint found, starting from scratch", directory)
        return False
    path = Path(directory) / f"iter_{iteration:07d}"
    loaded = dist_checkpointing.load(_state(trainer, is_loading=True), str(path))
    trainer.model.module.load_state_dict(loaded["model"])
    trainer.optimizer.load_state_dict(loaded["optimizer"])
    common = torch.load(path / "hetu_common.pt", weights_only=False)
    trainer.scheduler.load_state_dict(common["scheduler"])
    trainer.iteration = common["iteration"]
    trainer.losses = list(common["losses"])
    if trainer.host.rank == 0:
        logger.info("loaded checkpoint from %s at iteration %d", path, iteration)
    return True
