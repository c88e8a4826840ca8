"""``--load`` on the DeepSpeed path: a checkpoint saved on any number of ranks, into the engine on this number, in
process (no ``ds_to_universal``, no temporary files).

Sources: a DeepSpeed ZeRO-0/1/2/3 checkpoint (``DIR/latest`` -> ``DIR/global_stepN``; zero_checkpoint.py rebuilds
each kind of tensor on one rank with DeepSpeed's own reconstruction) or a hetu checkpoint (hetu_ext's trainer under
any plan, or this path's ``--hetu-ckpt-format hetu``; hetu_ext/checkpoint/load.py). Destinations: this rank's
fragments of DeepSpeed's flat fp32 partitions and Adam moments (engine_state.py), filled in place by the reshard
engine; then Adam's step is set, the model-dtype weights are derived from the masters as DeepSpeed's step does,
and the rest is restored: iteration (the data position: global batch g is samples [gB, (g + 1)B) at any world
size), losses, the LR schedule by Megatron-LM's rule, the engine's step counters, and each rank's RNG when the
world size is the one that saved (other world sizes have no saved counterpart per rank: the seed's stand).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hetu_ext.checkpoint import CheckpointError
from hetu_ext.runtime.reshard import Piece

from . import engine_state

logger = logging.getLogger(__name__)

DATA_KEYS = ("global_batch_size", "seed", "seq_length", "split", "mock_data", "packing", "global_batch_tokens")


@dataclass(frozen=True)
class Loaded:
    """What a load restored, for the log and the tests."""

    source: str
    """``deepspeed`` or ``hetu``."""
    path: str
    iteration: int
    saved_world_size: int
    optimizer_step: float | None
    seconds: float
    bytes_sent: int
    rng_restored: bool
    run_id: str | None = None
    """The identity of the run that wrote a hetu checkpoint (a resumed run keeps it); None for DeepSpeed's."""


def checkpoint_kind(directory: str) -> str | None:
    """``deepspeed``, ``hetu``, or None (an existing directory with no checkpoint). A missing directory, or a
    DeepSpeed ``latest`` naming a tag that is not there, is a :class:`CheckpointError`."""
    from hetu_ext.checkpoint.reader import latest_iteration
    from hetu_ext.checkpoint.storage import LocalStorage

    from .zero_checkpoint import is_deepspeed, tag_path

    root = Path(directory)
    if not root.is_dir():
        raise CheckpointError(f"--load {directory}: no such directory; give the --save directory of the run to "
                              "resume (DeepSpeed's save_checkpoint folder or a hetu checkpoint directory)")
    if is_deepspeed(directory):
        tag_path(directory)  # a 'latest' naming a missing or incomplete tag: one error naming it
        return "deepspeed"
    if latest_iteration(LocalStorage(directory)) is not None or any(root.glob("iter_*/manifest.json")):
        return "hetu"
    if (root / "latest_checkpointed_iteration.txt").exists() or any(root.glob("iter_*")):
        raise CheckpointError(f"--load {directory}: a Megatron torch_dist checkpoint; the DeepSpeed path loads "
                              "DeepSpeed ZeRO and hetu checkpoints: convert it with launch/pretrain_gpt.py "
                              "--load DIR --save NEW --hetu-ckpt-format hetu")
    return None


def _destinations(engine, names: set[str], step: float | None, gated: bool) -> list[Piece]:
    """Create Adam's state for ``step`` and return the engine's pieces to fill; the masters come from
    ``master/`` when the checkpoint has it, else from ``param/`` (an fp32 run keeps no separate master)."""
    have = {n.split("/", 1)[0] for n in names}
    if step is None or not set(engine_state.MOMENTS) <= have:
        raise CheckpointError(f"the checkpoint holds no Adam moments ({sorted(have)}, optimizer step {step}); "
                              "the DeepSpeed path resumes Adam's state: load a checkpoint saved after a step")
    engine_state.create_optimizer_state(engine, step)
    master = "master" if "master" in have else "param"
    return engine_state.engine_pieces(engine, ("master", *engine_state.MOMENTS), master_as=master, gated=gated)


def step_directory(directory: str, kind: str, step: int) -> str:
    """``--ckpt-step``: the checkpoint of ``step`` under ``directory`` (DeepSpeed's ``global_stepN`` tag, or a hetu
    ``iter_N`` directory); a :class:`CheckpointError` listing the saved steps when there is none."""
    from hetu_ext.checkpoint.writer import checkpoint_name

    root = Path(directory)
    name = f"global_step{step}" if kind == "deepspeed" else checkpoint_name(step)
    if not (root / name).is_dir():
        pattern = "global_step*" if kind == "deepspeed" else "iter_*"
        saved = sorted(int("".join(c for c in p.name if c.isdigit())) for p in root.glob(pattern) if p.is_dir())
        raise CheckpointError(f"--ckpt-step {step}: {directory} has no checkpoint of step {step} ({root / name}); "
                              f"its saved steps are {saved}: pass one of them, or drop --ckpt-step for the newest")
    return str(root / name)


class _StepStorage:
    """A hetu checkpoint directory whose tracker reads ``step`` (``--ckpt-step``), other reads unchanged."""

    def __init__(self, storage, step: int) -> None:
        self._storage, self._step = storage, step

    def __getattr__(self, name: str):
        return getattr(self._storage, name)

    def list(self, path: str) -> list[str]:
        from hetu_ext.checkpoint.writer import TRACKER

        names = self._storage.list(path)
        return names if path or TRACKER in names else [*names, TRACKER]

    def read(self, path: str) -> bytes:
        from hetu_ext.checkpoint.writer import TRACKER

        return str(self._step).encode() if path == TRACKER else self._storage.read(path)


def _load_deepspeed(run, directory: str, step: int | None = None
                    ) -> tuple[dict[str, Any], int, float | None, int, str]:
    from .zero_checkpoint import load_resharded, read_info

    if step is not None:
        directory = step_directory(directory, "deepspeed", step)

    info = read_info(directory)
    gated = run.config.model.swiglu
    _, report = load_resharded(directory, lambda names: _destinations(run.engine, names, info.optimizer_step, gated))
    client = dict(info.client_state.get("hetu_ext", {}))
    client.setdefault("iteration", info.global_steps)
    return client, info.world_size, info.optimizer_step, report.bytes_sent, str(info.path)


def _load_hetu(run, directory: str, step: int | None = None) -> tuple[dict[str, Any], int, float | None, int, str]:
    from hetu_ext.checkpoint.load import load_pieces
    from hetu_ext.checkpoint.storage import LocalStorage

    checkpoint = run.config.checkpoint
    storage = LocalStorage(directory)
    if step is not None:
        step_directory(directory, "hetu", step)
        storage = _StepStorage(storage, step)

    def destinations(manifest) -> list[Piece]:
        names = {t.name for t in manifest.tensors}
        return _destinations(run.engine, names, manifest.state.get("optimizer_step"), run.config.model.swiglu)

    report = load_pieces(storage, destinations, fallback=checkpoint.fallback, read=checkpoint.read)
    m = report.manifest
    state = dict(m.state)
    state["iteration"] = m.iteration
    from .engine_save import is_ours

    # saved by hetu_ext's trainer, its ranks are not this path's ranks: the seed's RNG stands
    state["rng"] = [r for _, r in sorted(m.rng.items(), key=lambda kv: int(kv[0]))] if is_ours(m.config) else None
    state["run_id"] = m.run_id
    return state, m.world_size, state.get("optimizer_step"), report.bytes_sent, f"{directory} iteration {m.iteration}"


def load(run, directory: str, step: int | None = None) -> Loaded | None:
    """Load the checkpoint under ``directory`` into ``run`` (a :class:`~hetu_ext.deepspeed.engine.DeepSpeedGPT`;
    collective over every rank): the newest, or that of ``step`` (``--ckpt-step``). None, with a warning, when the
    directory holds no checkpoint yet (with ``step``: an error)."""
    from hetu_ext.checkpoint.schedule import resolve_schedule
    from hetu_ext.megatron.state import schedule_policy, scheduler_settings, set_rng_state

    start = time.perf_counter()
    kind = checkpoint_kind(directory)
    if kind is None and step is not None:
        raise CheckpointError(f"--ckpt-step {step}: {directory} holds no checkpoint; drop --ckpt-step or give the "
                              "--save directory of the run to resume")
    if kind is None:
        if dist.get_rank() == 0:
            logger.warning("--load %s: no checkpoint found, starting from scratch", directory)
        return None
    reader = _load_deepspeed if kind == "deepspeed" else _load_hetu
    state, saved_world, opt_step, sent, where = reader(run, directory, step)
    engine = run.engine
    engine_state.refresh_model_weights(engine)
    data, now = state.get("data"), run.data_settings()
    changed = {k: (data[k], now[k]) for k in DATA_KEYS if data and k in data and data[k] != now[k]}
    if changed:
        raise CheckpointError(f"{where} was trained with other data settings (saved, now): {changed}; resume "
                              f"with the saved values so that step {state['iteration'] + 1} reads the samples "
                              "that follow, none skipped or repeated")
    iteration = int(state["iteration"])
    unit = run.schedule_unit  # the LR schedule's unit: samples per step (1 with --hetu-packing)
    run.iteration, run.losses = iteration, list(state.get("losses") or [])
    training = run.config.training
    if state.get("scheduler") is not None:
        run.scheduler.load_state_dict(resolve_schedule(state["scheduler"], scheduler_settings(training, unit),
                                                       policy=schedule_policy(training), unit=unit, where=where))
    else:  # a user's own DeepSpeed script: replay the flags' schedule to the iteration
        run.scheduler.step(increment=iteration * unit)
    engine.global_steps, engine.global_samples = iteration, iteration * engine.train_batch_size()
    rng = state.get("rng")
    restored = bool(rng) and saved_world == dist.get_world_size() and len(rng) == saved_world
    if restored:
        set_rng_state(rng[dist.get_rank()])
    loaded = Loaded(source=kind, path=where, iteration=iteration, saved_world_size=saved_world,
                    optimizer_step=opt_step, seconds=time.perf_counter() - start, bytes_sent=sent, rng_restored=restored,
                    run_id=state.get("run_id"))
    if dist.get_rank() == 0:
        logger.info("loaded %s checkpoint %s (saved on %d rank(s)) into ZeRO-%d on %d rank(s) at iteration %d in "
                    "%.2f s%s", kind, where, saved_world, engine_state.zero_stage(engine), dist.get_world_size(),
                    iteration, loaded.seconds, "" if restored else "; RNG states stay as the seed sets them")
    return loaded
