"""Per-rank memory of a placement: parameters, gradients and optimizer state, in bytes, as a table."""

from __future__ import annotations

import torch
import torch.distributed as dist

# fp32 values the optimizer keeps per parameter element: Adam's two moments, SGD's momentum
_STATE_VALUES = {"adam": 2, "sgd": 1}


def optimizer_bytes_per_element(optimizer_name: str, bf16: bool) -> int:
    """fp32 bytes the optimizer keeps per element it steps: the moments, plus the master under --bf16."""
    return 4 * (_STATE_VALUES[optimizer_name] + (1 if bf16 else 0))


def rank_memory(model: torch.nn.Module | None, optimizer_name: str, bf16: bool, optimizer=None) -> dict[str, int]:
    """Bytes of this rank's parameters, gradient buffers and optimizer state (0s for an idle rank).

    Optimizer state is what the optimizer holds once the first step has allocated it: the moments in fp32, plus
    fp32 master weights when the model is bf16; with the plan runtime's sharded optimizer (``optimizer`` given),
    for the elements this rank owns only.
    """
    if model is None:
        return {"params": 0, "grads": 0, "optimizer": 0}
    params = [p for p in model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in params)
    sharded = getattr(optimizer, "hetu_sharded", None)
    if sharded is not None:
        numel = sharded.owned_numel()
    grads = sum(p.main_grad.numel() * p.main_grad.element_size() for p in params if hasattr(p, "main_grad"))
    state = numel * optimizer_bytes_per_element(optimizer_name, bf16)
    return {"params": sum(p.numel() * p.element_size() for p in params), "grads": grads, "optimizer": state}


def memory_table(model, optimizer_name: str, bf16: bool, where: str, optimizer=None) -> str | None:
    """Gather every rank's memory (collective); the text of the table on the first rank, None elsewhere."""
    mine = (dist.get_rank(), where, rank_memory(model, optimizer_name, bf16, optimizer),
            getattr(optimizer, "hetu_sharded", None) is not None)
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, mine)
    if dist.get_rank() != 0:
        return None
    mib = 1 << 20
    sharded = "; sharded: the elements the rank owns" if any(row[3] for row in rows) else ""
    lines = [f"memory per rank (MiB, optimizer state as allocated by the first step{sharded}):",
             "rank  placement             params     grads  optimizer      total"]
    for rank, place, mem, _ in sorted(rows):
        total = sum(mem.values())
        lines.append(f"{rank:>4}  {place:<18} {mem['params'] / mib:9.2f} {mem['grads'] / mib:9.2f} "
                     f"{mem['optimizer'] / mib:10.2f} {total / mib:10.2f}")
    return "\n".join(lines)
