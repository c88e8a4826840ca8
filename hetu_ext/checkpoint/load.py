"""Load a checkpoint into any layout: the file layout is the source of a reshard (collective).

Every rank states the pieces it wants (its layout under the new plan: any TP / PP / DP, any rank count). Each stored
shard is read whole and checked by one rank (:func:`selection.assign_reads`): one per job (policy ``once``: the
reshard engine then sends every rank its boxes point to point) or one per host (policy ``node``, the default: the
host's other ranks read just the byte ranges they need from the memory-mapped file, which the host's page cache
serves, and the reshard only copies locally). Measured on 2 -> 3 CPU ranks sharing one host, each load from a cold
page cache (benchmarks/results/checkpoint_cpu_2026-12-04_b.txt, a 1.214 GB state, medians of 7 loads), ``node``
loads in 1.50 s, ``once`` in 2.7 s (gloo over loopback), Megatron's dist_checkpointing in 2.27 s and DeepSpeed's
ds_to_universal + load_universal route in 13.7 s; both policies fetch 1.215 GB from the disk (/proc/self/io); under
``node`` the three replicas each read the whole state through their memory maps (3.6 GB, the page cache serving all
but the first). Ranks agree on failure: if any rank finds a corrupt file, every rank learns it, and with
``fallback`` all move to the previous complete checkpoint together; nothing is written into the model before the
whole checkpoint has read cleanly.
"""

from __future__ import annotations

import gc
import logging
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch.distributed as dist

from hetu_ext.runtime.reshard import Piece, reshard

from .manifest import CheckpointError, Manifest
from .reader import ShardReader, candidates, latest_iteration, read_manifest
from .selection import assign_reads, intersect
from .shardfile import BY_NAME, DTYPES
from .storage import Storage

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadReport:
    manifest: Manifest
    iteration: int
    bytes_read: int
    """Bytes of shard data this rank read through its memory maps of the shard files (whole shards it checks,
    plus the boxes it reads under ``node``): logical bytes, page-cache hits included, not what the disk served.
    Under ``node`` every data-parallel replica on a host counts its copy, though the host's page cache fetches
    the file from the disk once; benchmarks/checkpoint.py measures the disk's bytes (/proc/self/io) beside it."""
    bytes_sent: int
    """Bytes this rank sent to other ranks in the reshard."""
    seconds: float
    read_s: float = 0.0
    """Seconds this rank spent reading and checking its shards."""
    reshard_s: float = 0.0
    """Seconds of the reshard (plan, exchange, copies)."""
    skipped: tuple[str, ...] = ()
    """Errors of newer checkpoints that were skipped (with fallback)."""


def _check_wanted(manifest: Manifest, destinations: list[Piece]) -> None:
    tensors = manifest.tensor_map()
    for p in destinations:
        record = tensors.get((p.key, p.index))
        if record is None:
            raise CheckpointError(f"checkpoint iteration {manifest.iteration} has no tensor {p.key}{list(p.index)}; "
                                  "it was saved from another model or another optimizer; load a matching checkpoint")
        if DTYPES[p.tensor.dtype] != record.dtype or any(b > s for (_, b), s in zip(p.box, record.shape)) \
                or len(p.box) != len(record.shape):
            raise CheckpointError(f"{p.key}{list(p.index)}: the model holds {DTYPES[p.tensor.dtype]} box {p.box} "
                                  f"but the checkpoint stores {record.dtype}{list(record.shape)}; the model "
                                  "configuration differs from the saved one")


def _read_sources(reader: ShardReader, rank: int, wants_by_rank: dict[int, list],
                  hosts: list[str] | None) -> list[Piece]:
    """This rank's source pieces. ``hosts`` None ("once"): each shard is read, whole and checked, by one rank of
    the job, which the reshard then sends to the others. ``hosts`` given ("node"): on each host the rank needing
    most of a shard reads it whole and checks it; the host's other ranks read just the boxes they need from the
    same file (served by the host's page cache), so the reshard only copies locally."""
    manifest = reader.manifest
    shards, where = [], {}
    for t in manifest.tensors:
        for s in t.shards:
            where[len(shards)] = (t, s)
            shards.append((len(shards), (t.name, t.index), s.box, BY_NAME[t.dtype].itemsize))
    if hosts is None:
        checkers = assign_reads(shards, wants_by_rank)
    else:
        mine = {r: w for r, w in wants_by_rank.items() if hosts[r] == hosts[rank]}
        checkers = assign_reads(shards, mine)
    sources = []
    for shard_id, checker in checkers.items():
        t, s = where[shard_id]
        if checker == rank:
            sources.append(Piece(t.name, t.index, s.box, reader.read(t, s)))
        elif hosts is not None:
            for tensor, box in wants_by_rank[rank]:
                common = intersect(s.box, box) if tensor == (t.name, t.index) else None
                if common is not None:
                    sources.append(Piece(t.name, t.index, common, reader.read_box(t, s, common)))
    return sources


def _agree(error: str | None, world: int, group) -> list[str]:
    """Every rank's error (None if fine), gathered: all ranks take the same decision."""
    errors: list = [None] * world
    dist.all_gather_object(errors, error, group=group)
    return sorted({e for e in errors if e})


def _failure(storage: Storage, order: list[int], errors: list[str], fallback: bool) -> str:
    """The one error of a load that found no usable checkpoint, with the fallback hint only where it helps."""
    if fallback:
        if len(order) == 1:
            return f"{errors[0]}; no older complete checkpoint of this run to fall back to"
        tried = ", ".join(map(str, order))
        return f"no usable checkpoint (tried iterations {tried}): " + "; ".join(errors)
    older = candidates(storage, fallback=True)[1:]
    hint = f"; --hetu-ckpt-fallback loads the previous complete one (iteration {older[0]})" if older else ""
    return errors[0] + hint


READ_POLICIES = ("node", "once")
"""How shards are read on load: ``node`` (each host reads what its ranks need, no network traffic) or ``once``
(each shard read by one rank of the job, then sent point to point: the least filesystem traffic)."""


def load_pieces(storage: Storage, destinations: list[Piece] | Callable[[Manifest], list[Piece]], *,
                fallback: bool = False, read: str = "node", group=None) -> LoadReport:
    """Fill this rank's destination pieces (its layout under its plan; [] on idle ranks) from the latest
    checkpoint. ``destinations`` may be a function of the manifest (to create optimizer state to fill).

    Collective over ``group``. Raises :class:`CheckpointError` (on every rank) if there is no checkpoint, or it
    is corrupt and no fallback is allowed or left.
    """
    if read not in READ_POLICIES:
        raise ValueError(f"read={read!r}: choose one of {READ_POLICIES}")
    with _no_cyclic_gc():
        report = _load_pieces(storage, destinations, fallback=fallback, read=read, group=group)
    for reports in _RECORDERS.get():
        reports.append(report)
    return report


_RECORDERS: ContextVar[tuple[list[LoadReport], ...]] = ContextVar("hetu_load_recorders", default=())


@contextmanager
def recorded_loads() -> Iterator[list[LoadReport]]:
    """The reports of every :func:`load_pieces` call made inside the block (this thread's), in order: for callers
    that load through a function returning something else, e.g. ``hetu_ext.megatron.checkpointing.load_hetu``,
    which returns the run state (benchmarks/checkpoint.py reads bytes mapped and reshard seconds this way). Blocks
    nest; each sees the loads made inside it."""
    reports: list[LoadReport] = []
    token = _RECORDERS.set(_RECORDERS.get() + (reports,))
    try:
        yield reports
    finally:
        _RECORDERS.reset(token)


@contextmanager
def _no_cyclic_gc():
    """Python's cyclic garbage collector off for the duration of a load. A load creates tens of thousands of
    short-lived tuples (the gathered boxes, the reshard's transfer list), each burst of them triggers collections,
    and a full collection walks every object the process holds (torch's and Megatron's modules, the model):
    with it on, the reshard phase of benchmarks/checkpoint.py's 1.2 GB load on 3 CPU ranks took 0.9-1.3 s,
    without it 0.55-0.7 s (2026-12-04, three loads each). Reference counting still frees everything the load
    drops; cycles wait for the next collection after it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _load_pieces(storage: Storage, destinations, *, fallback: bool, read: str, group) -> LoadReport:
    start = time.perf_counter()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    order = candidates(storage, fallback=fallback)
    if not order:
        raise CheckpointError(f"{storage.local_path('')}: no committed checkpoint (no "
                              "latest_checkpointed_iteration.txt); check the --load directory")
    if rank == 0 and latest_iteration(storage) is None:
        logger.warning("%s has no latest_checkpointed_iteration.txt: loading the newest committed checkpoint, "
                       "iteration %d", storage.local_path(""), order[0])
    skipped: list[str] = []
    for iteration in order:
        error, sources, reader, mine = None, [], None, []
        try:
            reader = ShardReader(storage, read_manifest(storage, iteration))
            mine = destinations(reader.manifest) if callable(destinations) else destinations
            _check_wanted(reader.manifest, mine)
        except CheckpointError as e:
            error = str(e)
        everyone: list = [None] * world
        dist.all_gather_object(everyone, (error, [((p.key, p.index), p.box) for p in mine], socket.gethostname()),
                               group=group)
        bad = sorted({e for e, _, _ in everyone if e})
        read_start = time.perf_counter()
        if not bad:
            try:
                hosts = [h for _, _, h in everyone] if read == "node" else None
                sources = _read_sources(reader, rank, {r: w for r, (_, w, _) in enumerate(everyone)}, hosts)
            except CheckpointError as e:
                error = str(e)
            bad = _agree(error, world, group)
        if bad:
            skipped.append("; ".join(bad))
            if fallback and iteration != order[-1]:
                if rank == 0:
                    logger.warning("checkpoint of iteration %d is unusable (%s); falling back to an older one",
                                   iteration, "; ".join(bad))
                continue
            raise CheckpointError(_failure(storage, order, skipped, fallback))
        reshard_start = time.perf_counter()
        report = reshard(sources, mine, group=group)
        end = time.perf_counter()
        return LoadReport(manifest=reader.manifest, iteration=iteration, bytes_read=reader.bytes_read,
                          bytes_sent=report.bytes_sent, seconds=end - start, read_s=reshard_start - read_start,
                          reshard_s=end - reshard_start, skipped=tuple(skipped))
    raise AssertionError("unreachable")
