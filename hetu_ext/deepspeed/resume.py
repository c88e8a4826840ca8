"""``--load`` of a DeepSpeed ZeRO-1/2/3 checkpoint into hetu_ext's Megatron trainer, under any plan.

The tensors go through zero_checkpoint.py (DeepSpeed's reconstruction, then the reshard engine); the rest of the
state (iteration, losses, LR schedule, data settings from hetu_ext's client state) is returned as a
:class:`~hetu_ext.megatron.state.RunState` that checkpointing.load restores as it does every format's. DeepSpeed
itself is imported only for its ``zero_to_fp32`` helpers.
"""

from __future__ import annotations

import logging

from hetu_ext.megatron.state import MOMENTS, RunState, state_pieces
from hetu_ext.runtime.reshard import Piece

logger = logging.getLogger(__name__)


def load_deepspeed(target, directory: str) -> RunState:
    """A DeepSpeed ZeRO-1/2/3 checkpoint (``DIR/latest`` -> ``DIR/global_stepN``) into any plan (collective over
    every rank): DeepSpeed's flat partitions are rebuilt into full tensors and resharded into this plan's layout
    (zero_checkpoint.py). The iteration is DeepSpeed's ``global_steps``; losses, LR schedule
    and data settings come from hetu_ext's client state when the DeepSpeed path of hetu_ext saved it, else the
    schedule is replayed to the iteration (the LR schedule part). ``target``: what the load fills (a
    hetu_ext.megatron.checkpoint_target.CheckpointTarget: its placement and host)."""
    from .zero_checkpoint import load_resharded as load_ds
    from .zero_checkpoint import read_info

    step = read_info(directory).optimizer_step

    def destinations(names: set[str]) -> list[Piece]:
        moments = {m for m in MOMENTS if any(n.startswith(m + "/") for n in names)} if step is not None else None
        return state_pieces(target.placement, moments=moments, step=step)

    info, report = load_ds(directory, destinations)
    client = info.client_state.get("hetu_ext", {})
    if target.host.rank == 0:
        logger.info("loaded DeepSpeed ZeRO-%d checkpoint %s (saved by %d rank(s)) at iteration %d into the plan "
                    "(%.2f MiB sent by rank 0)", info.zero_stage, info.path, info.world_size,
                    int(client.get("iteration", info.global_steps)), report.bytes_sent / 2**20)
    return RunState(iteration=int(client.get("iteration", info.global_steps)), source=str(info.path),
                    losses=client.get("losses", []), scheduler=client.get("scheduler"), data=client.get("data"))
