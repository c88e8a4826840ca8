"""``--save`` / ``--load`` through Megatron-core's ``dist_checkpointing`` (torch_dist format), Megatron-LM style.

Layout: ``DIR/iter_0000004/`` holds the model and optimizer shards and a ``common.pt`` with the iteration,
the LR scheduler and the RNG state; ``DIR/latest_checkpointed_iteration.txt`` names the newest complete one and
is written last, after every rank has finished, through a temporary file and a rename. Because the shards carry
global offsets, a checkpoint loads under another TP / PP / DP layout (Megatron's ShardedTensor reshard).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"


def _state(trainer, is_loading: bool) -> dict:
    model_sd = trainer.model.module.sharded_state_dict()
    return {"model": model_sd,
            "optimizer": trainer.optimizer.sharded_state_dict(model_sd, is_loading=is_loading)}


def save(trainer, directory: str) -> Path:
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


def load(trainer, directory: str) -> bool:
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
