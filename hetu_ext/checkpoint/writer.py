"""Save: a short blocking snapshot to host memory, then a background persist and an atomic commit.

Per save, on every rank of the saving group:

1. (collective, blocking: the only time training waits) the ranks agree on the layout and a token, then each
   copies the cells it writes to host memory. Agreeing: every rank all-gathers one small int64 tensor (a digest
   of its piece metadata, the key of the layout it cached from the previous save, rank 0's random token). If
   every rank's cached key is the digest of exactly the gathered digests, each rank reuses its write assignment
   (and rank 0 the manifest's tensor table) from that save. Otherwise (the first save, any rank's pieces
   changed, a rank without a cache) every rank's piece metadata is gathered (``all_gather_object``) and
   :func:`selection.assign_writes` gives each unique element to one holder, deterministically, as before.
2. (background thread) the rank writes ``.tmp_iter_NNNNNNN_<token>/shard_RRRRR.safetensors`` (fsynced), then its
   part record ``part_RRRRR.json`` (entries, checksums, RNG) through a temporary name and a rename.
3. (background, rank 0 of the group) once every part record is there: the manifest is written (last, fsynced),
   the directory is renamed to ``iter_NNNNNNN`` (the commit), then ``latest_checkpointed_iteration.txt`` moves
   through a temporary file and a rename, then retention deletes this run's old checkpoints (the manifest's
   ``run_id``), never the latest and never another run's.

A crash at any point leaves either the previous state (``latest`` untouched, a ``.tmp_*`` directory that the
next commit removes) or the new checkpoint complete. No collective runs in the background: the commit waits
for part files, so the training thread owns the process group.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hetu_ext.errors import HetuExtError
from hetu_ext.runtime.reshard import Piece

from . import manifest as mf
from .selection import TensorId, assign_writes, extent, intersect
from .shardfile import DTYPES, FileRecord, encode
from .storage import Storage

logger = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
"""The ``latest`` pointer (Megatron-LM's name): the iteration of the newest committed checkpoint."""
ITER_DIR = re.compile(r"^iter_(\d{7})$")
"""The name of a committed checkpoint directory (its group: the iteration)."""
_LEFTOVER = re.compile(r"^\.(?:tmp|old)_iter_(\d{7})_")


def checkpoint_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


@dataclass(kw_only=True)
class SaveConfig:
    """How checkpoints are kept and committed."""

    keep: int = 2
    """Complete checkpoints kept (>= 1); the newest is never deleted. 2 lets ``--hetu-ckpt-fallback`` work."""
    commit_timeout_s: float = 600.0
    """How long rank 0 waits for every rank's part record before giving the save up (seconds)."""
    poll_s: float = 0.01
    """How often rank 0 looks for part records (seconds)."""
    run_id: str | None = None
    """The run identity written into every manifest. Retention deletes only checkpoints of this identity, and a
    commit never replaces another run's checkpoint (None: only checkpoints without one, for tools and tests)."""

    def __post_init__(self) -> None:
        if self.keep < 1:
            raise ValueError(f"checkpoint retention keep={self.keep} must be >= 1 (the newest checkpoint is always "
                             "kept); use 2 or more for a fallback")
        if self.commit_timeout_s <= 0 or self.poll_s <= 0:
            raise ValueError(f"commit_timeout_s ({self.commit_timeout_s}) and poll_s ({self.poll_s}) must be > 0")


@dataclass
class Snapshot:
    """One rank's share of a checkpoint, in host memory."""

    iteration: int
    rank: int
    world: int
    token: str
    tensors: dict[str, torch.Tensor]
    """Entry name -> host copy of one cell."""
    cells: list[tuple[TensorId, tuple[tuple[int, int], ...], str]]
    """(tensor, box, entry) for each entry."""
    rng: dict[str, Any]
    info: dict[str, Any] = field(default_factory=dict)
    """Rank 0 only: the manifest's global fields and every tensor's (shape, dtype)."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def _entry_name(tensor: TensorId, box) -> str:
    return f"{tensor[0]}|{','.join(map(str, tensor[1]))}|{','.join(f'{a}:{b}' for a, b in box)}"


def piece_meta(pieces: list[Piece]) -> list[tuple[TensorId, tuple, str, int]]:
    """What the other ranks need to know of this rank's pieces: (tensor, box, dtype name, bytes per element)."""
    return [((p.key, p.index), p.box, DTYPES[p.tensor.dtype], p.tensor.element_size()) for p in pieces]


def meta_digest(meta: list[tuple]) -> int:
    """A 63-bit digest of one rank's :func:`piece_meta` (the same on every process for the same metadata)."""
    return int.from_bytes(hashlib.blake2b(repr(meta).encode(), digest_size=8).digest(), "little") >> 1


def layout_key(digests: list[int]) -> int:
    """The key of a group's layout: a digest of every rank's metadata digest, in rank order (never 0)."""
    return meta_digest([len(digests), *digests]) or 1


@dataclass
class WritePlan:
    """What one rank derives from every rank's piece metadata: the cells it writes, and where each comes from."""

    key: int
    """:func:`layout_key` of the metadata it was made from."""
    rank: int
    """The rank it was made for (a process that changed rank cannot reuse it)."""
    copies: list[tuple[int, tuple[slice, ...], TensorId, tuple[tuple[int, int], ...], str]]
    """(index of the source piece in this rank's piece list, slices of that piece, tensor, cell, entry name)."""
    tensors: dict[TensorId, tuple[tuple[int, ...], str]] | None = None
    """Rank 0 only: every tensor's global (shape, dtype), for the manifest."""


def plan_writes(rank: int, pieces: list[Piece], metas: list[list[tuple]], key: int = 0) -> WritePlan:
    """This rank's :class:`WritePlan` (``metas[r]``: :func:`piece_meta` of rank r; ``pieces`` this rank's;
    ``key``: the :func:`layout_key` of ``metas`` where the caller computed it)."""
    writes = assign_writes({r: [(t, box, size) for t, box, _, size in m] for r, m in enumerate(metas)})[rank]
    mine: dict[TensorId, list[int]] = defaultdict(list)
    for i, p in enumerate(pieces):
        mine[(p.key, p.index)].append(i)
    copies = []
    for tensor, cell in writes:
        i = next(i for i in mine[tensor] if intersect(pieces[i].box, cell) == cell)
        slices = tuple(slice(a - s0, b - s0) for (a, b), (s0, _) in zip(cell, pieces[i].box))
        copies.append((i, slices, tensor, cell, _entry_name(tensor, cell)))
    plan = WritePlan(key=key or layout_key([meta_digest(m) for m in metas]), rank=rank, copies=copies)
    if rank == 0:
        shapes: dict[TensorId, list] = defaultdict(list)
        dtypes: dict[TensorId, str] = {}
        for m in metas:
            for t, box, dtype, _ in m:
                shapes[t].append(box)
                if dtypes.setdefault(t, dtype) != dtype:
                    raise HetuExtError(f"{t[0]}{list(t[1])}: ranks hold it as {dtypes[t]} and {dtype}")
        plan.tensors = {t: (tuple(b for _, b in extent(boxes)), dtypes[t]) for t, boxes in shapes.items()}
    return plan


def copy_cells(plan: WritePlan, pieces: list[Piece], buffers: dict[str, torch.Tensor] | None = None
               ) -> tuple[dict[str, torch.Tensor], list[tuple[TensorId, tuple[tuple[int, int], ...], str]]]:
    """Host copies of the cells ``plan`` gives this rank: (entry name -> tensor, [(tensor, cell, entry)]).

    ``buffers``: host tensors of a previous, fully persisted snapshot, reused where an entry has the same name,
    shape and dtype (periodic saves of one layout then copy into memory that is already mapped)."""
    tensors, cells = {}, []
    for i, slices, tensor, cell, name in plan.copies:
        view = pieces[i].tensor.detach()[slices]
        host = (buffers or {}).get(name)
        if host is None or host.shape != view.shape or host.dtype != view.dtype:
            host = torch.empty(view.shape, dtype=view.dtype, device="cpu")
        host.copy_(view)
        tensors[name] = host
        cells.append((tensor, cell, name))
    return tensors, cells


def take_snapshot(*, iteration: int, rank: int, world: int, token: str, pieces: list[Piece],
                  metas: list[list[tuple]] | None = None, rng: dict[str, Any], info: dict[str, Any] | None = None,
                  buffers: dict[str, torch.Tensor] | None = None, plan: WritePlan | None = None) -> Snapshot:
    """Copy the cells this rank writes to host memory. ``metas[r]``: :func:`piece_meta` of rank r, or ``plan``
    made from them earlier (:func:`plan_writes`); ``buffers`` as in :func:`copy_cells`."""
    if plan is None:
        if metas is None:
            raise ValueError("take_snapshot needs every rank's piece metadata (metas) or a write plan")
        plan = plan_writes(rank, pieces, metas)
    tensors, cells = copy_cells(plan, pieces, buffers)
    snap = Snapshot(iteration=iteration, rank=rank, world=world, token=token, tensors=tensors, cells=cells, rng=rng)
    if rank == 0:
        snap.info = {**(info or {}), "tensors": plan.tensors}
    return snap


def _probe_device(group) -> torch.device:
    """Where the agreement tensor lives: NCCL groups exchange CUDA tensors only."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Checkpointer:
    """Asynchronous, atomic checkpoint saving into one directory (one object per rank, reused across saves)."""

    def __init__(self, storage: Storage, config: SaveConfig | None = None) -> None:
        self.storage = storage
        self.config = config or SaveConfig()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._buffers: dict[str, torch.Tensor] = {}
        """Host memory of the last snapshot, reused by the next one once it is persisted."""
        self._plan: WritePlan | None = None
        """The write plan of the last save, reused while every rank's piece metadata stays the same."""
        self.last: dict[str, float] = {}
        """The latest save on this rank: blocking_s (= agree_s + gather_s + assign_s + copy_s, plus a little
        bookkeeping), its phases (agree_s: the int64 all-gather; gather_s, assign_s: the metadata all-gather and
        the write assignment, 0 when the cached plan was reused; copy_s: the host copies), cached (1.0 if the
        plan was reused, else 0.0), bytes (copied to host memory, written by this rank), then persist_s (the
        background write and, on rank 0, the commit) once persisted."""

    def save(self, *, iteration: int, pieces: list[Piece], rng: dict[str, Any], info: dict[str, Any],
             group=None, blocking: bool = False) -> None:
        """Collective over ``group``: snapshot now, persist in the background (or now if ``blocking``).

        ``info`` (used on the group's rank 0): consumed_samples, plan, config, state for the manifest.
        """
        self.wait()
        start = time.perf_counter()
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        meta = piece_meta(pieces)
        cached = self._plan.key if self._plan is not None and self._plan.rank == rank else 0
        token = uuid.uuid4().int >> 80 if rank == 0 else 0  # 48 random bits, as uuid4().hex[:12] gave
        device = _probe_device(group)
        probe = torch.tensor([meta_digest(meta), cached, token], dtype=torch.int64, device=device)
        rows = [torch.empty_like(probe) for _ in range(world)]
        dist.all_gather(rows, probe, group=group)
        rows = [r.tolist() for r in rows]
        key = layout_key([r[0] for r in rows])
        agreed = time.perf_counter()
        gathered = assigned = agreed
        # the same decision on every rank (it depends on the gathered rows only): reuse the plans only if every
        # rank's cached plan was made from metadata with exactly these digests
        reuse = all(r[1] == key for r in rows)
        if reuse:
            plan = self._plan
        else:
            everyone: list = [None] * world
            dist.all_gather_object(everyone, meta, group=group)
            gathered = time.perf_counter()
            plan = plan_writes(rank, pieces, everyone, key)
            assigned = time.perf_counter()
        self._plan = plan
        snap = take_snapshot(iteration=iteration, rank=rank, world=world, token=f"{rows[0][2]:012x}",
                             pieces=pieces, plan=plan, rng=rng, info=info, buffers=self._buffers)
        self._buffers = snap.tensors  # reused after this snapshot is persisted (the next save waits for that)
        end = time.perf_counter()
        self.last = {"blocking_s": end - start, "agree_s": agreed - start, "gather_s": gathered - agreed,
                     "assign_s": assigned - gathered, "copy_s": end - assigned,
                     "cached": float(reuse), "bytes": float(snap.nbytes)}
        self.persist(snap, blocking=blocking)

    def persist(self, snap: Snapshot, *, blocking: bool = False) -> None:
        """Write a snapshot (in a background thread unless ``blocking``); rank 0 also commits."""
        self.wait()
        if blocking:
            self._persist(snap)
            self.wait()
            return
        # a daemon: a crashed job must exit at once (the commit protocol leaves nothing half-written); the last
        # save of a run is blocking, so a normal exit never cuts a write short
        self._thread = threading.Thread(target=self._persist, args=(snap,), name="hetu-ckpt-persist", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Block until the previous save is persisted (and, on rank 0, committed); re-raise its failure."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise HetuExtError(f"checkpoint save failed: {error}") from error

    def _persist(self, snap: Snapshot) -> None:
        try:
            start = time.perf_counter()
            tmp = f".tmp_{checkpoint_name(snap.iteration)}_{snap.token}"
            self.storage.makedirs(tmp)
            write_part(self.storage, tmp, snap)
            if snap.rank == 0:
                commit(self.storage, tmp, snap, self.config)
            self.last["persist_s"] = time.perf_counter() - start
        except BaseException as e:  # noqa: BLE001 - reported by wait() on the training thread
            logger.error("checkpoint save of iteration %d failed on rank %d: %s", snap.iteration, snap.rank, e)
            self._error = e


def write_part(storage: Storage, tmp: str, snap: Snapshot) -> None:
    """This rank's shard file, then its part record (renamed into place, so it is never seen half-written)."""
    file = f"shard_{snap.rank:05d}.safetensors"
    chunks, entries, size, head_crc = encode(snap.tensors, {"iteration": str(snap.iteration)})
    written = storage.write(f"{tmp}/{file}", chunks)
    assert written == size, (written, size)
    part = {"file": {"name": file, "size": size, "header_crc32": head_crc},
            "entries": [{"name": t[0], "index": list(t[1]), "box": [list(b) for b in box], "entry": e.entry,
                         "crc32": e.crc32} for (t, box, _), e in zip(snap.cells, entries)],
            "rng": snap.rng}
    name = f"part_{snap.rank:05d}.json"
    storage.write(f"{tmp}/{name}.tmp", [json.dumps(part).encode()])
    storage.rename(f"{tmp}/{name}.tmp", f"{tmp}/{name}")


def commit(storage: Storage, tmp: str, snap: Snapshot, config: SaveConfig) -> None:
    """Rank 0: wait for every part, write the manifest, rename the directory, move ``latest``, retain."""
    wanted = {f"part_{r:05d}.json" for r in range(snap.world)}
    deadline = time.monotonic() + config.commit_timeout_s
    while not wanted <= set(storage.list(tmp)):
        if time.monotonic() > deadline:
            missing = sorted(wanted - set(storage.list(tmp)))
            raise HetuExtError(f"iteration {snap.iteration}: no part record from {missing} after "
                               f"{config.commit_timeout_s:.0f} s; those ranks died or hang; nothing was committed")
        time.sleep(config.poll_s)
    parts = [json.loads(storage.read(f"{tmp}/part_{r:05d}.json")) for r in range(snap.world)]
    shards: dict[TensorId, list[mf.ShardRecord]] = defaultdict(list)
    for part in parts:
        for e in part["entries"]:
            shards[(e["name"], tuple(e["index"]))].append(mf.ShardRecord(
                file=part["file"]["name"], entry=e["entry"], box=mf._box(e["box"]), crc32=e["crc32"]))
    info = snap.info
    tensors = tuple(mf.TensorRecord(name=t[0], index=t[1], shape=shape, dtype=dtype,
                                    shards=tuple(sorted(shards[t], key=lambda s: s.box)))
                    for t, (shape, dtype) in sorted(info["tensors"].items()))
    manifest = mf.Manifest(
        iteration=snap.iteration, consumed_samples=info.get("consumed_samples", 0), world_size=snap.world,
        plan=info.get("plan"), config=info.get("config", {}), state=info.get("state", {}),
        rng={str(r): p["rng"] for r, p in enumerate(parts)}, tensors=tensors,
        files=tuple(FileRecord(**p["file"]) for p in parts), run_id=config.run_id)
    storage.write(f"{tmp}/{mf.MANIFEST}", [mf.to_bytes(manifest)])
    for r in range(snap.world):  # the manifest holds all they said
        storage.remove(f"{tmp}/part_{r:05d}.json")
    final = checkpoint_name(snap.iteration)
    if final in storage.list(""):  # a re-save of this iteration (after a fallback): replace this run's old one
        owner = run_of(storage, snap.iteration)
        if owner not in (config.run_id, UNREADABLE):
            raise HetuExtError(f"{storage.local_path(final)} holds a checkpoint of another run (run identity "
                               f"{owner}, this run's is {config.run_id}), which is never replaced; iteration "
                               f"{snap.iteration} was not committed; save into another directory")
        storage.rename(final, f".old_{final}_{snap.token}")
    storage.rename(tmp, final)
    storage.write(f"{TRACKER}.tmp", [str(snap.iteration).encode()])
    storage.rename(f"{TRACKER}.tmp", TRACKER)
    retain(storage, config.keep, snap.iteration, config.run_id)
    logger.info("checkpoint of iteration %d committed (%d ranks, %.1f MiB)", snap.iteration, snap.world,
                manifest.total_bytes / 2**20)


def complete_iterations(storage: Storage) -> list[int]:
    """Iterations of committed checkpoints (a directory ``iter_NNNNNNN`` holding a manifest), ascending."""
    out = []
    for name in storage.list(""):
        m = ITER_DIR.match(name)
        if m and mf.MANIFEST in storage.list(name):
            out.append(int(m.group(1)))
    return sorted(out)


UNREADABLE = "<unreadable manifest>"
"""What :func:`run_of` says of a checkpoint whose manifest cannot be read (corrupt): no run's, so retention keeps
it, while a re-save of its iteration (after a fallback) may replace it."""


def run_of(storage: Storage, iteration: int) -> str | None:
    """The run identity in a committed checkpoint's manifest: None if it has none, :data:`UNREADABLE`."""
    try:
        return mf.from_bytes(storage.read(f"{checkpoint_name(iteration)}/{mf.MANIFEST}"), "").run_id
    except (OSError, mf.CheckpointError):
        return UNREADABLE


def retain(storage: Storage, keep: int, latest: int, run_id: str | None = None) -> None:
    """Delete all but the ``keep`` newest complete checkpoints of run ``run_id`` (never ``latest``, never a
    checkpoint of another run or with an unreadable manifest) and leftover temporaries of iterations up to
    ``latest``."""
    mine = [it for it in complete_iterations(storage) if run_of(storage, it) == run_id]
    keep_set = set(mine[-keep:]) | {latest}
    for it in mine:
        if it not in keep_set:
            storage.remove(checkpoint_name(it))
    remove_leftovers(storage, latest)


def remove_leftovers(storage: Storage, latest: int) -> None:
    """Delete ``.tmp_iter_*`` / ``.old_iter_*`` directories of iterations up to ``latest`` (a failed or replaced
    save; a temporary directory of a later iteration may belong to a save in flight, so it stays)."""
    for name in storage.list(""):
        m = _LEFTOVER.match(name)
        if m and int(m.group(1)) <= latest:
            storage.remove(name)


def save_offline(storage: Storage, *, iteration: int, pieces_by_rank: list[list[Piece]], info: dict[str, Any],
                 rng_by_rank: list[dict[str, Any]] | None = None, config: SaveConfig | None = None) -> None:
    """Write and commit the checkpoint that ranks holding ``pieces_by_rank`` would write, from one process.

    The format does not depend on who writes it, so a checkpoint of any layout (an 8-rank plan, say) can be
    made here, by tools and tests, bit-identical to a distributed save of the same pieces.
    """
    token = uuid.uuid4().hex[:12]
    metas = [piece_meta(p) for p in pieces_by_rank]
    world = len(pieces_by_rank)
    tmp = f".tmp_{checkpoint_name(iteration)}_{token}"
    storage.makedirs(tmp)
    for rank in reversed(range(world)):
        snap = take_snapshot(iteration=iteration, rank=rank, world=world, token=token,
                             pieces=pieces_by_rank[rank], metas=metas,
                             rng=(rng_by_rank or [{}] * world)[rank], info=info)
        write_part(storage, tmp, snap)
        if rank == 0:
            commit(storage, tmp, snap, config or SaveConfig())
