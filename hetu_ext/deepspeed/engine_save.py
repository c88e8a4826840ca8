"""``--hetu-ckpt-format hetu`` on the DeepSpeed path: the engine's state saved in hetu_ext's layout-agnostic format.

The same writer as hetu_ext's trainer (hetu_ext/checkpoint/writer.py: a snapshot to host memory, the writing in
a background thread into a temporary directory, the manifest last, an atomic rename, then the tracker;
``--hetu-ckpt-keep N`` retention of this run's checkpoints only). The pieces are the engine's own fragments
(engine_state.py): every element of every tensor is held by exactly one rank, so each rank writes its share and
no rank gathers anything. Names as the trainer saves them: ``param/`` (the model-dtype weights; in an fp32 run the
fp32 masters, which DeepSpeed keeps equal to them), ``master/`` (bf16 runs only), ``exp_avg/``, ``exp_avg_sq/``; the
manifest's state has the trainer's keys (iteration, losses, LR schedule, data settings, Adam step), so
``launch/pretrain_gpt.py --load`` resumes it under any plan and this path under any world size.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hetu_ext.checkpoint import CheckpointError

from . import engine_state

logger = logging.getLogger(__name__)

ENGINE_MARK = "deepspeed_zero_stage"
"""Key of the manifest's config naming the ZeRO stage of the DeepSpeed run that saved (its ranks are ours)."""


class HetuSaver:
    """One per run and ``--save`` directory: the run identity, decided once, and the asynchronous writer."""

    def __init__(self, run, directory: str, *, loaded_run_id: str | None, resumed_here: bool) -> None:
        from hetu_ext.checkpoint.storage import LocalStorage
        from hetu_ext.checkpoint.writer import Checkpointer, SaveConfig

        self.run, self.directory = run, directory
        self.run_id = self._decide_run_id(loaded_run_id, resumed_here)
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.checkpointer = Checkpointer(LocalStorage(directory),
                                         SaveConfig(keep=run.config.checkpoint.keep, run_id=self.run_id))

    def _decide_run_id(self, loaded: str | None, resumed_here: bool) -> str | None:
        """Rank 0 decides (a resumed run keeps the loaded checkpoint's identity) and checks the directory; every
        rank raises the same one-line error."""
        from hetu_ext.checkpoint.ownership import check_save_dir, new_run_id, planned_saves

        decision: list = [None, None]
        if dist.get_rank() == 0:
            ckpt = self.run.config.checkpoint
            run_id = loaded if loaded is not None or resumed_here else new_run_id()
            planned = planned_saves(self.run.iteration, self.run.config.training.train_iters, ckpt.save_interval)
            error, _ = check_save_dir(self.directory, run_id, resumed=loaded is not None, reuse=ckpt.reuse_dir,
                                      planned=planned)
            decision = [run_id, error]
        dist.broadcast_object_list(decision, src=0)
        if decision[1] is not None:
            raise CheckpointError(decision[1])
        return decision[0]

    def save(self, *, blocking: bool) -> None:
        """Collective: snapshot this rank's fragments now; write in the background unless ``blocking``."""
        from hetu_ext.megatron.state import rng_state

        run = self.run
        engine = run.engine
        bf16 = engine.bfloat16_enabled()
        gated = run.config.model.swiglu
        pieces = engine_state.engine_pieces(engine, master_as="master" if bf16 else "param", gated=gated, owned=True)
        if bf16:
            pieces += engine_state.param_pieces(engine, gated=gated)
        data = run.data_settings()
        state = {"iteration": run.iteration, "losses": list(run.losses), "scheduler": run.scheduler.state_dict(),
                 "data": data, "optimizer_step": engine_state.optimizer_step(engine), "assumed": None}
        info = {"consumed_samples": None if run.packed is not None else run.iteration * data["global_batch_size"],
                "plan": _plan_dict(run), "config": {**_flat_config(run), ENGINE_MARK: engine_state.zero_stage(engine)},
                "state": state}
        self.checkpointer.save(iteration=run.iteration, pieces=pieces, rng=rng_state(dist.get_rank()), info=info,
                               blocking=blocking)
        if dist.get_rank() == 0:
            last = self.checkpointer.last
            logger.info("hetu checkpoint of iteration %d: %.1f ms blocking, %.2f MiB on this rank (%s)",
                        run.iteration, last["blocking_s"] * 1e3, last["bytes"] / 2**20,
                        "committed" if blocking else "persisting in the background")

    def wait(self) -> None:
        self.checkpointer.wait()


def _plan_dict(run) -> dict[str, Any]:
    from hetu_ext.plan import plan_to_dict

    return plan_to_dict(run.plan)


def _flat_config(run) -> dict[str, Any]:
    """The run's flags, JSON-able (values JSON cannot hold as their text, as the trainer's manifests do)."""
    import json

    return json.loads(json.dumps(run.config.to_flat_dict(), default=str))


def is_ours(config: dict[str, Any]) -> bool:
    """A hetu checkpoint written by this path (its per-rank RNG states belong to the same rank numbers)."""
    return ENGINE_MARK in config
