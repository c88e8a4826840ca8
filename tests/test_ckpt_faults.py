"""kill -9 during saves: whatever instant a writer dies, the job resumes from the checkpoint the tracker names with
exactly the state that was saved, and nothing half-written is ever taken for a checkpoint.

60 trials, 3 writer processes (forked, a small state), continuing one checkpoint directory from trial to trial
as a restarted job would. Half the trials kill a random writer from inside a random storage operation (the
k-th makedirs / write / rename / remove of the run; a write killed halfway leaves a truncated file): every
point of the commit protocol is hit. In the other half the writers save until a random instant (0-0.3 s) when
the victim is killed from outside. The other
writers are then killed too (the job is torn down). A checkpoint resumed with another iteration's data, a
tracker ahead of its directory, or a leftover directory taken as complete fails here."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time

import torch

from hetu_ext.checkpoint.reader import ShardReader, candidates, latest_iteration, read_manifest
from hetu_ext.checkpoint.storage import LocalStorage
from hetu_ext.checkpoint.writer import Checkpointer, SaveConfig, complete_iterations, piece_meta, take_snapshot
from hetu_ext.runtime.reshard import Piece

WRITERS = 3
TRIALS = 60
SAVES_PER_TRIAL = 3


def _state(iteration: int) -> dict:
    g = torch.Generator().manual_seed(iteration)
    return {("param/w", (0,)): torch.randn(12, 8, generator=g), ("exp_avg/w", (0,)): torch.randn(12, 8, generator=g),
            ("param/norm", ()): torch.randn(8, generator=g)}


def _pieces(rank: int, iteration: int) -> list[Piece]:
    """Rank 0 holds rows 0-5 of the matrices, rank 1 rows 6-11, rank 2 all of them; everyone holds the norm."""
    rows = [(0, 6), (6, 12), (0, 12)][rank]
    out = []
    for (name, index), t in _state(iteration).items():
        box = (rows, (0, 8)) if t.dim() == 2 else ((0, 8),)
        out.append(Piece(name, index, box, t[tuple(slice(a, b) for a, b in box)].clone()))
    return out


class _KillAt:
    """A storage that SIGKILLs its own process at its ``kill_at``-th mutating operation (mid-file for writes)."""

    def __init__(self, inner: LocalStorage, kill_at: int | None) -> None:
        self.inner, self.kill_at, self.ops = inner, kill_at, 0

    def _tick(self) -> bool:
        self.ops += 1
        return self.ops == self.kill_at

    def write(self, path, chunks):
        if self._tick():
            data = b"".join(bytes(c) for c in chunks)
            with open(self.inner.local_path(path), "wb") as f:
                f.write(data[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        return self.inner.write(path, chunks)

    def rename(self, src, dst):
        if self._tick():
            os.kill(os.getpid(), signal.SIGKILL)
        self.inner.rename(src, dst)

    def makedirs(self, path):
        if self._tick():
            os.kill(os.getpid(), signal.SIGKILL)
        self.inner.makedirs(path)

    def remove(self, path):
        if self._tick():
            os.kill(os.getpid(), signal.SIGKILL)
        self.inner.remove(path)

    def read(self, path):
        return self.inner.read(path)

    def list(self, path):
        return self.inner.list(path)

    def local_path(self, path):
        return self.inner.local_path(path)


def _writer(root: str, rank: int, trial: int, start: int, kill_at: int | None, saves: int) -> None:
    """One rank of a job that resumed at ``start`` and saves iterations start+1, ..., start+saves."""
    storage = _KillAt(LocalStorage(root), kill_at)
    saver = Checkpointer(storage, SaveConfig(keep=2, commit_timeout_s=30, poll_s=0.001))
    for it in range(start + 1, start + 1 + saves):
        metas = [piece_meta(_pieces(r, it)) for r in range(WRITERS)]
        snap = take_snapshot(iteration=it, rank=rank, world=WRITERS, token=f"t{trial}", pieces=_pieces(rank, it),
                             metas=metas, rng={"rank": rank, "iteration": it},
                             info={"consumed_samples": 8 * it, "state": {"iteration": it}})
        saver.persist(snap, blocking=True)
        while it not in complete_iterations(storage):  # the next save's collective waits for rank 0's commit
            time.sleep(0.001)


def _resume(root) -> int:
    """What a restarted job loads: the checkpoint the tracker names (the newest complete one without a tracker;
    a kill between a commit's rename and its tracker move leaves the tracker on the previous one, as in
    Megatron-LM), checked against the state of its iteration."""
    storage = LocalStorage(root)
    order = candidates(storage, fallback=False)
    if not order:
        return 0
    manifest = read_manifest(storage, order[0])
    it = manifest.iteration
    tracked = latest_iteration(storage)
    assert it == (tracked if tracked is not None else max(complete_iterations(storage)))
    assert tracked is None or tracked in complete_iterations(storage)  # the pointer names only committed ones
    assert manifest.consumed_samples == 8 * it and manifest.state == {"iteration": it}
    assert manifest.rng == {str(r): {"rank": r, "iteration": it} for r in range(WRITERS)}
    back = ShardReader(storage, manifest).read_full()
    want = _state(it)
    assert back.keys() == want.keys() and all(torch.equal(back[k], v) for k, v in want.items()), it
    return it


def test_kill_minus_9_at_random_points_of_saving(tmp_path):
    ctx = mp.get_context("fork")
    rng = random.Random(2026)
    root = str(tmp_path)
    latest, modes, progressed = 0, {"inside": 0, "outside": 0}, 0
    for trial in range(TRIALS):
        victim = rng.randrange(WRITERS)
        inside = trial % 2 == 0
        kill_at = rng.randint(1, (12 if victim == 0 else 4) * SAVES_PER_TRIAL) if inside else None
        saves = SAVES_PER_TRIAL if inside else 10**6  # killed from outside: saving until then
        procs = [ctx.Process(target=_writer, args=(root, r, trial, latest, kill_at if r == victim else None, saves))
                 for r in range(WRITERS)]
        for p in procs:
            p.start()
        if inside:
            procs[victim].join(timeout=60)
        else:
            time.sleep(rng.uniform(0.0, 0.3))
            os.kill(procs[victim].pid, signal.SIGKILL)
            procs[victim].join()
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join()
        assert procs[victim].exitcode == -signal.SIGKILL or (inside and procs[victim].exitcode == 0)
        modes["inside" if inside else "outside"] += procs[victim].exitcode == -signal.SIGKILL
        resumed = _resume(root)
        assert resumed >= latest  # the resume point never moves back
        progressed += resumed > latest
        latest = resumed
    assert modes["inside"] >= TRIALS // 4 and modes["outside"] == TRIALS // 2, modes
    assert progressed >= 5, progressed  # the kills did not all land before the first commit
