"""Checkpoint save and load-and-reshard: hetu_ext's format against Megatron-core's dist_checkpointing and DeepSpeed.

    python -m benchmarks.checkpoint [--hidden-size 1024 --num-layers 8] [--save-ranks 2 --load-ranks 3] [--loads 3]

Every system gets its strongest settings and the same repeats: six saves each (the first printed apart, the table
shows the median of the other five), ``--loads`` cold loads per load route (median in the table), routes
interleaved (a rotating order per round).

Same model (Megatron-core GPT after one Adam step: parameters and both moments, fp32), same disk, side by side:

1. Disk bandwidth first: write a 1 GiB file with fsync (write), drop it from the page cache (posix_fadvise), read it.
2. Save on N ranks (Megatron's uniform DP grid). hetu: a blocking snapshot to host memory, then a background
   write and commit; six saves of one layout, the first printed apart (it gathers every rank's piece metadata,
   assigns the writes and allocates the host buffers), the table shows the median of the five after it (the
   steady state of periodic saving: the write plan is reused after one int64 all-gather, the host buffers are
   reused), every one printed with Checkpointer.save's phases per rank (agree, gather, assign, copy). "blocking
   s" is the wall time of the whole ``save_hetu`` call on the slowest rank (what the training loop waits for:
   collecting the pieces, RNG states and manifest fields, then Checkpointer.save); "total s" is until the commit.
   "host copy s": a plain ``copy_`` of as many bytes as each rank snapshots, into already mapped memory, all ranks
   at once after a barrier (as in a save, they share the memory bandwidth), timed right before each steady save
   (the same moment's load of a shared machine), slowest rank, median of five. The
   background write rate printed below the save (bytes of the committed checkpoint's files / median of total -
   blocking) is the one to hold against the measured disk write bandwidth. Megatron (``async``: true): what
   Megatron-LM runs with ``--async-save --ckpt-fully-parallel-save --ckpt-assume-constant-structure
   --use-persistent-ckpt-worker`` (:class:`MegatronSaver`): the torch_dist strategy with cached metadata, wrapped in
   FullyParallelSaveStrategyWrapper with a cached distribution, built once; ``dist_checkpointing.save(...,
   async_sharded_save=True)`` on a persistent AsyncCallsQueue worker; blocking until the request is scheduled,
   total until ``maybe_finalize_async_calls(blocking=True)`` returns.
3. Load-and-reshard N -> M ranks (another DP degree), every load cold: before each one the checkpoint's files are
   fsynced and dropped from the page cache (posix_fadvise DONTNEED), and what mincore(2) still finds resident is
   printed. hetu with --hetu-ckpt-read node (each host reads what its ranks need through its page cache) and
   once (each shard read by one rank, then sent point to point over gloo), and Megatron's dist_checkpointing load
   (non-distributed optimizer: its format is already reshardable), plain and fully parallel
   (FullyParallelLoadStrategyWrapper over the data-parallel group, Megatron-LM's --ckpt-fully-parallel-load).
   Each load is checked against the saving ranks (sums of |parameters| and |Adam moments|, Adam's step).
   Bytes, for every load row:
   * "GB read" (``bytes_read``): bytes fetched from the storage layer, i.e. the disk: the delta of ``read_bytes``
     in /proc/self/io over the load (from the barrier after the model is built to the barrier after the load),
     summed over the loading processes (and, for DeepSpeed's converter, its child processes). Page-cache hits
     add nothing; the readahead of the kernel, file headers, metadata files and any other file the processes
     read during the load (first imports) are included.
   * "GB needed" (``bytes_needed``): the unique bytes of state the M ranks of the new plan hold on each host
     (the union of their boxes of every tensor; data-parallel replicas on one host counted once), summed over
     hosts; one host here, so the whole state. DeepSpeed's route gets the figure of the same model and M-rank plan.
   * "GB mapped" (``bytes_mapped``, hetu only): the bytes hetu's ranks read through their memory maps of the shard
     files (LoadReport.bytes_read: whole shards a rank checks plus the boxes it reads; page-cache hits included):
     under "node" the data-parallel replicas of one host each read the whole state, but the disk serves it once.

4. DeepSpeed, the same model through hetu_ext/deepspeed/engine.py (ZeRO-2: fp32 module weights, fp32 partitions
   of the master weights and both Adam moments), same N ranks, same disk: ``engine.save_checkpoint`` (synchronous:
   blocking = total). Its other writers (``"checkpoint": {"writer": {...}}``: the fast and the decoupled
   asynchronous engine) fail in DeepSpeed 0.19.8 before writing (``'UniversalParallelInfo' object has no attribute
   'dp_rank'``), and ZeRO-2 refuses to load optimizer states into another DP size without the universal route
   (``Automatic adjustment of ZeRO's optimizer state partitioning with a new world size is not currently
   supported``), so the default engine and the universal route are DeepSpeed's best here. Load-and-reshard
   N -> M the DeepSpeed way: its
   universal-checkpoint conversion (``python -m deepspeed.checkpoint.ds_to_universal --inject_missing_state``,
   a subprocess, timed with its interpreter start, started cold) then ``engine.load_checkpoint`` into an M-rank
   engine with ``"checkpoint": {"load_universal": true}`` (started cold: the converted files are dropped from the
   page cache first); its total is conversion + load, its bytes read those of both. If a step of that route fails,
   the error text is printed and no number is made up. DeepSpeed 0.19.8's converter fails on this model: it
   saves every entry of the module's state dict as a tensor, and Megatron-core's state dict holds ``_extra_state``
   entries that are None. The script then applies a workaround and says so ("universal + workaround": drop those
   entries from the model states file, convert again, load with ``load_module_strict=False``; the rewrite (load,
   filter, save of the model states file) and the second conversion are timed, from a cold page cache; the failed
   first attempt is printed but not counted), and checks the load against the saving engine (sums of |module
   weights|, |fp32 partitions|, |Adam moments|, Adam's step). Beside it, hetu_ext's direct load of the same
   DeepSpeed checkpoint into M ranks (``--load`` route, hetu_ext/deepspeed/resume.py), cold: system "hetu",
   from "deepspeed".
Prints the configuration, a table, and a final JSON line.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import ROOT, Table, print_result


def disk_bandwidth(directory: Path, nbytes: int) -> tuple[float, float]:
    """(write, read) bytes per second of one file, written with fsync and read back from the disk."""
    path = directory / "bandwidth.bin"
    block = os.urandom(16 * 2**20)
    start = time.perf_counter()
    with open(path, "wb") as f:
        f.writelines(block for _ in range(max(nbytes // len(block), 1)))
        f.flush()
        os.fsync(f.fileno())
    write = path.stat().st_size / (time.perf_counter() - start)
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    start = time.perf_counter()
    while os.read(fd, 16 * 2**20):
        pass
    os.close(fd)
    read = path.stat().st_size / (time.perf_counter() - start)
    path.unlink()
    return write, read


def storage_read_bytes() -> int:
    """``read_bytes`` of /proc/self/io: bytes this process (all its threads, and its children once reaped) made
    the kernel fetch from the storage layer (disk reads; page-cache hits add nothing)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no read_bytes line")


def _files(directory: Path) -> list[Path]:
    return [f for f in Path(directory).rglob("*") if f.is_file()] if Path(directory).exists() else []


def drop_page_cache(directory: Path) -> None:
    """Evict every file under ``directory`` from the page cache (fsync first: dirty pages cannot be dropped),
    so that the next load reads from the disk (cold), whichever system wrote the files."""
    for path in _files(directory):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_bytes(directory: Path) -> tuple[int, int]:
    """(bytes of the files under ``directory`` in the page cache, bytes of those files), by mincore(2)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = os.sysconf("SC_PAGE_SIZE")
    resident = total = 0
    for path in _files(directory):
        size = path.stat().st_size
        total += size
        if not size:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
            if addr in (None, ctypes.c_void_p(-1).value):
                continue
            pages = (size + page - 1) // page
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vec) == 0:
                resident += min(sum(b & 1 for b in vec) * page, size)
            libc.munmap(addr, size)
        finally:
            os.close(fd)
    return resident, total


def cold(directory: Path, what: str) -> None:
    """Drop ``directory`` from the page cache and print what is left resident (expected: nothing)."""
    drop_page_cache(directory)
    resident, total = resident_bytes(directory)
    print(f"{what}: page cache dropped for {Path(directory).name} ({total / 1e9:.3f} GB of files, "
          f"{resident / 1e6:.1f} MB still resident)")


def needed_per_host(held: list[tuple[str, list[tuple]]]) -> int:
    """``held``: (host, [(tensor name, index, box, bytes per element)]) per loading rank. The unique bytes of
    state the ranks of each host hold (replicas on one host counted once), summed over hosts."""
    from collections import defaultdict

    from hetu_ext.checkpoint.selection import extent, intersect, numel
    from hetu_ext.plan.core.layout import split_box

    boxes: dict[tuple, list] = defaultdict(list)
    for host, pieces in held:
        for name, index, box, itemsize in pieces:
            boxes[(host, name, tuple(index), itemsize)].append(tuple(tuple(b) for b in box))
    total = 0
    for (_, _, _, itemsize), bs in boxes.items():
        bs = list(set(bs))
        cells = [bs[0]] if len(bs) == 1 else split_box(extent(bs), bs)
        total += itemsize * sum(numel(c) for c in cells if any(intersect(b, c) == c for b in bs))
    return total


def held_state(trainer) -> tuple[str, list[tuple]]:
    """This rank's host and the state it holds after a load (its pieces under the new plan)."""
    import socket

    from hetu_ext.megatron.state import state_pieces

    return socket.gethostname(), [(p.key, p.index, p.box, p.tensor.element_size())
                                  for p in state_pieces(trainer.placement)]


def _trainer(argv: list[str]):
    from hetu_ext.cli.args import parse_run_config
    from hetu_ext.train.trainer import build_trainer

    return build_trainer(parse_run_config(argv))


HETU_STEADY_SAVES = 5
"""hetu saves after the first (the steady state of periodic saving: cached write plan, reused host buffers); the
table shows their median, every one is printed; a plain host copy is timed right before each (median in the
table)."""


def save_body(rank: int, world: int, argv: list[str], directory: str, system: str) -> dict:
    import torch
    import torch.distributed as dist

    from hetu_ext.megatron import checkpointing
    from hetu_ext.megatron.state import state_pieces

    trainer = _trainer(argv)
    trainer.train(log=lambda line: None)  # one step: Adam's moments exist
    pieces = state_pieces(trainer.placement)
    dist.barrier()
    start = time.perf_counter()
    if system == "hetu":
        first, steady, copies, flat, target = None, [], [], None, None
        for _ in range(1 + HETU_STEADY_SAVES):  # the first save, then periodic saves of one layout
            if first is not None:
                # the baseline, right before each steady save (the same moment's load on a shared machine): a
                # plain host copy of as many bytes as this rank snapshots, into mapped memory (like a reused
                # buffer), all ranks at once (as in a save, they share the memory bandwidth)
                dist.barrier()
                copy_start = time.perf_counter()
                target.copy_(flat)
                copies.append(time.perf_counter() - copy_start)
                dist.barrier()
            start = time.perf_counter()
            ckpt = checkpointing.save_hetu(trainer.checkpoint_target(), directory, blocking=False)
            blocking = time.perf_counter() - start  # what the training loop waits for: the whole call
            phases = dict(ckpt.last)
            ckpt.wait()
            total = time.perf_counter() - start
            if first is None:
                first = {"first_blocking_s": blocking, "first_total_s": total, "first_phases": phases}
                flat = torch.cat([p.tensor.reshape(-1) for p in pieces])[: int(phases["bytes"]) // 4]
                target = torch.empty_like(flat)
                target.copy_(flat)  # map the memory first
            else:
                steady.append({"blocking_s": blocking, "total_s": total, "phases": phases})
            dist.barrier()
        return {"steady": steady, "host_copies": copies, **first, "fingerprint": fingerprint(trainer),
                "state_bytes": sum(p.tensor.numel() * p.tensor.element_size() for p in pieces)}
    saver = MegatronSaver(trainer, directory)
    first, steady = None, []
    for it in range(1, 2 + HETU_STEADY_SAVES):  # as many saves as hetu's, the first apart
        dist.barrier()
        start = time.perf_counter()
        saver.save(it)
        blocking = time.perf_counter() - start  # what the training loop waits for
        saver.finalize()
        total = time.perf_counter() - start  # until every rank's write is done and the metadata is written
        if first is None:
            first = {"first_blocking_s": blocking, "first_total_s": total}
        else:
            steady.append({"blocking_s": blocking, "total_s": total})
        dist.barrier()
        saver.drop_older(it)
    saver.close()
    return {"steady": steady, **first, "fingerprint": fingerprint(trainer),
            "state_bytes": sum(p.tensor.numel() * p.tensor.element_size() for p in pieces)}


class MegatronSaver:
    """Megatron-core 0.16.1's fastest save of this state, as Megatron-LM sets it up with ``--async-save
    --ckpt-fully-parallel-save --ckpt-assume-constant-structure``: the torch_dist strategy with cached metadata
    (``use_cached_ckpt_structure``), wrapped in FullyParallelSaveStrategyWrapper (writes spread over the
    data-parallel replicas) with its distribution cached, built once and reused; ``dist_checkpointing.save(...,
    async_sharded_save=True)`` (integrity validated on the first save only, as the structure is constant)
    scheduled on an AsyncCallsQueue (a forked writer process per save, Megatron-LM's default; its persistent
    worker is a spawned process that calls ``torch.cuda.set_device`` and cannot start without CUDA). Blocking:
    until ``save`` returns and the request is scheduled; total: until ``maybe_finalize_async_calls(blocking=True)``
    (the write done on every rank, the global metadata written)."""

    def __init__(self, trainer, directory: str) -> None:
        from megatron.core import parallel_state
        from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
        from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

        self.trainer, self.directory = trainer, Path(directory)
        base = get_default_save_sharded_strategy()
        base.use_cached_ckpt_structure = True
        self.strategy = FullyParallelSaveStrategyWrapper(
            base, parallel_state.get_data_parallel_group(with_context_parallel=True), do_cache_distribution=True)
        _ckpt_modules_without_cuda()
        self.queue = AsyncCallsQueue(persistent=False)
        self.saves = 0

    def save(self, iteration: int) -> None:
        import torch.distributed as dist
        from megatron.core import dist_checkpointing

        path = self.directory / f"iter_{iteration:07d}"
        if self.trainer.host.rank == 0:
            path.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        model_sd = self.trainer.model.module.sharded_state_dict()
        state = {"model": model_sd, "optimizer": self.trainer.optimizer.sharded_state_dict(model_sd,
                                                                                            is_loading=False)}
        request = dist_checkpointing.save(state, str(path), sharded_strategy=self.strategy,
                                          validate_access_integrity=self.saves == 0, async_sharded_save=True)
        self.queue.schedule_async_request(request)
        self.saves += 1
        self.last = (iteration, path)

    def finalize(self) -> None:
        self.queue.maybe_finalize_async_calls(blocking=True)
        iteration, path = self.last
        if self.trainer.host.rank == 0:
            torch_save_common(self.trainer, path)
            (self.directory / "latest_checkpointed_iteration.txt").write_text(str(iteration))

    def drop_older(self, iteration: int) -> None:
        """Delete the checkpoints before ``iteration`` (untimed; keeps the disk from filling)."""
        if self.trainer.host.rank == 0:
            for old in self.directory.glob("iter_*"):
                if int(old.name[5:]) < iteration:
                    shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        self.queue.close()


def _ckpt_modules_without_cuda() -> None:
    """On CPU, Megatron-core's async_utils (completion flags on ``torch.cuda.current_device()``,
    ``torch.cuda.synchronize()``) and fully_parallel (``torch.cuda.synchronize()`` after a load) address CUDA,
    modules patches/megatron_cpu.py does not cover: give them a torch whose ``cuda`` answers with the CPU device,
    as those patches do for the modules they list. Nothing on CUDA."""
    import types

    import torch
    from megatron.core.dist_checkpointing.strategies import async_utils, fully_parallel

    if torch.cuda.is_available():
        return
    cuda = types.SimpleNamespace(current_device=lambda: torch.device("cpu"), synchronize=lambda *a, **k: None,
                                 is_available=lambda: False)
    for module in (async_utils, fully_parallel):
        if not isinstance(module.torch, types.SimpleNamespace):
            module.torch = types.SimpleNamespace(**{k: getattr(torch, k) for k in dir(torch)
                                                    if not k.startswith("__")})
            module.torch.cuda = cuda


def fingerprint(trainer) -> dict:
    """What a load must restore, in float64: sum |x| of this rank's parameters and Adam moments, and Adam's steps
    (a replicated model: every rank holds all of it)."""
    import torch

    opt = trainer.optimizer
    inner = getattr(opt, "optimizer", opt)
    params = [p for g in inner.param_groups for p in g["params"]]
    out = {"params": sum(float(p.detach().double().abs().sum()) for p in params)}
    for kind in ("exp_avg", "exp_avg_sq"):
        out[kind] = sum(float(inner.state[p][kind].double().abs().sum()) for p in params if p in inner.state
                        and kind in inner.state[p])
    out["steps"] = sorted({float(torch.as_tensor(inner.state[p]["step"])) for p in params
                           if p in inner.state and "step" in inner.state[p]})
    return out


def same_fingerprint(saved: dict, loaded: dict) -> str:
    diffs = {k: abs(saved[k] - loaded[k]) / max(abs(saved[k]), 1e-30) for k in ("params", "exp_avg", "exp_avg_sq")}
    return (", ".join(f"{k} sum |x| rel diff {v:.1e}" for k, v in diffs.items())
            + f"; Adam steps saved/loaded {saved['steps']}/{loaded['steps']}")


def _load_megatron(trainer, directory: str, fully_parallel: bool) -> None:
    """Megatron-core's own load of the latest checkpoint into this (uniform) model and optimizer; with
    ``fully_parallel`` through FullyParallelLoadStrategyWrapper (Megatron-LM's --ckpt-fully-parallel-load: each
    data-parallel replica reads a share of the tensors, then they are exchanged; on CPU by ``gather_object``, as
    its default ``broadcast`` and ``gather_rounds`` exchanges move tensors with ``.cuda()``)."""
    import torch
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    iteration = int((Path(directory) / "latest_checkpointed_iteration.txt").read_text())
    path = str(Path(directory) / f"iter_{iteration:07d}")
    strategy = None
    _ckpt_modules_without_cuda()
    if fully_parallel:
        strategy = FullyParallelLoadStrategyWrapper(
            get_default_load_sharded_strategy(path), parallel_state.get_data_parallel_group(with_context_parallel=True),
            exchange_algo="broadcast" if torch.cuda.is_available() else "gather_object")
    model_sd = trainer.model.module.sharded_state_dict()
    state = {"model": model_sd, "optimizer": trainer.optimizer.sharded_state_dict(model_sd, is_loading=True)}
    loaded = dist_checkpointing.load(state, path, sharded_strategy=strategy)
    trainer.model.module.load_state_dict(loaded["model"])
    with torch.no_grad():
        trainer.optimizer.load_state_dict(loaded["optimizer"])


def torch_save_common(trainer, path: Path) -> None:
    import torch

    torch.save({"iteration": trainer.iteration, "scheduler": trainer.scheduler.state_dict(),
                "losses": trainer.losses}, path / "hetu_common.pt")


def load_body(rank: int, world: int, argv: list[str], directory: str, system: str) -> dict:
    import torch.distributed as dist


    trainer = _trainer(argv)
    dist.barrier()
    io_start = storage_read_bytes()
    start = time.perf_counter()
    if system == "hetu":
        report = _load_hetu_with_report(trainer, directory)
        mapped = report.bytes_read
        phases = {"read_s": report.read_s, "reshard_s": report.reshard_s}
    else:
        _load_megatron(trainer, directory, fully_parallel=system == "megatron_fully_parallel")
        mapped, phases = None, {}
    dist.barrier()
    took = time.perf_counter() - start
    return {"total_s": took, "bytes_read": storage_read_bytes() - io_start, "bytes_mapped": mapped,
            "held": held_state(trainer), "fingerprint": fingerprint(trainer), **phases}


def _load_hetu_with_report(trainer, directory: str):
    """``checkpointing.load_hetu`` as training runs it; returns the LoadReport of its load (bytes mapped, read and
    reshard seconds), which load_hetu itself does not return."""
    from hetu_ext.checkpoint.load import recorded_loads
    from hetu_ext.megatron import checkpointing

    with recorded_loads() as reports:
        checkpointing.load_hetu(trainer.checkpoint_target(), directory)
    return reports[-1]


def _ds_run(argv: list[str], extra: dict | None = None):
    from hetu_ext.config import from_namespace
    from hetu_ext.deepspeed.engine import ZeroConfig, add_deepspeed_args, build
    from hetu_ext.cli.args import build_parser, validate_args

    args = add_deepspeed_args(build_parser()).parse_args(argv)
    validate_args(args)
    return build(from_namespace(args), ZeroConfig(stage=2, extra=extra or {}))


def ds_fingerprint(engine) -> dict:
    """What a load must restore, summed in float64: |module weights| (replicated under ZeRO-2, rank 0's), this
    rank's |fp32 partitions| and |Adam moments| (summed over ranks by the caller), and Adam's steps."""
    opt = engine.optimizer.optimizer
    out = {"module": sum(float(p.detach().double().abs().sum()) for p in engine.module.parameters()),
           "steps": sorted({float(s["step"]) for s in opt.state.values() if "step" in s})}
    out["master"] = sum(float(p.detach().double().abs().sum()) for g in opt.param_groups for p in g["params"])
    for kind in ("exp_avg", "exp_avg_sq"):
        out[kind] = sum(float(s[kind].double().abs().sum()) for s in opt.state.values() if kind in s)
    return out


def _same_state(saved: list[dict], loaded: list[dict]) -> str:
    a, b = ({k: sum(r["fp"][k] for r in rs) for k in ("master", "exp_avg", "exp_avg_sq")} for rs in (saved, loaded))
    a["module"], b["module"] = saved[0]["fp"]["module"], loaded[0]["fp"]["module"]
    diffs = {k: abs(a[k] - b[k]) / max(abs(a[k]), 1e-30) for k in a}
    steps = (saved[0]["fp"]["steps"], loaded[0]["fp"]["steps"])
    return ", ".join(f"{k} sum |x| rel diff {v:.1e}" for k, v in diffs.items()) + f"; Adam steps saved/loaded {steps}"


def ds_save_body(rank: int, world: int, argv: list[str], directory: str) -> dict:
    import torch.distributed as dist

    run = _ds_run(argv)
    run.train()  # one step: Adam's moments exist
    times = []
    for it in range(1 + HETU_STEADY_SAVES):  # as many saves as hetu's and Megatron's, the first apart
        dist.barrier()
        start = time.perf_counter()
        if it < HETU_STEADY_SAVES:
            run.engine.save_checkpoint(directory, tag=f"bench_save_{it}")
        else:
            tag = run.save(directory)  # engine.save_checkpoint with hetu_ext's client state: the one loaded
        dist.barrier()
        times.append(time.perf_counter() - start)
        if rank == 0:
            shutil.rmtree(Path(directory) / f"bench_save_{it}", ignore_errors=True)  # untimed: the disk fills
    written = sum(f.stat().st_size for f in (Path(directory) / tag).iterdir() if f.is_file())
    return {"first_s": times[0], "steady_s": times[1:], "tag": tag, "bytes_written": written,
            "fp": ds_fingerprint(run.engine)}


def ds_universal_load_body(rank: int, world: int, argv: list[str], directory: str, strict: bool) -> dict:
    import torch.distributed as dist

    run = _ds_run(argv, {"checkpoint": {"load_universal": True}})
    dist.barrier()
    io_start = storage_read_bytes()
    start = time.perf_counter()
    path, _ = run.engine.load_checkpoint(directory, load_optimizer_states=True, load_lr_scheduler_states=False,
                                         load_module_strict=strict)
    dist.barrier()
    if path is None:
        raise RuntimeError(f"engine.load_checkpoint({directory!r}) with load_universal found no checkpoint")
    took = time.perf_counter() - start
    return {"total_s": took, "bytes_read": storage_read_bytes() - io_start, "path": path,
            "fp": ds_fingerprint(run.engine)}


def hetu_from_ds_load_body(rank: int, world: int, argv: list[str], directory: str) -> dict:
    import torch.distributed as dist

    from hetu_ext.deepspeed.resume import load_deepspeed

    trainer = _trainer(argv)
    dist.barrier()
    io_start = storage_read_bytes()
    start = time.perf_counter()
    load_deepspeed(trainer, directory)
    dist.barrier()
    return {"total_s": time.perf_counter() - start, "bytes_read": storage_read_bytes() - io_start,
            "held": held_state(trainer)}


def _deepspeed_rows(args, root: Path) -> list[dict]:
    """DeepSpeed ZeRO-2 save on N ranks (1 + HETU_STEADY_SAVES saves); then ``args.loads`` rounds, each a cold
    ds_to_universal + universal load into M and a cold hetu direct load into M, in alternating order."""
    import subprocess
    import traceback

    import torch

    from hetu_ext.testing.multiproc import run_ranks

    directory = root / "deepspeed"
    saved = run_ranks(ds_save_body, args.save_ranks, model_argv(args, args.save_ranks), str(directory),
                      timeout=1800)
    tag = saved[0]["tag"]
    written = sum(r["bytes_written"] for r in saved[:1])  # a shared directory: every rank sees the same files
    steady = [max(r["steady_s"][i] for r in saved) for i in range(len(saved[0]["steady_s"]))]
    print(f"deepspeed first save: {max(r['first_s'] for r in saved):.3f} s; steady saves (synchronous: blocking = "
          f"total) {', '.join(f'{s:.3f}' for s in steady)} s (median in the table); {tag}: {written / 1e9:.3f} GB "
          "written")
    rows = [{"system": "deepspeed", "op": "save", "from": args.save_ranks, "to": args.save_ranks,
             "blocking_s": statistics.median(steady), "total_s": statistics.median(steady), "host_copy_s": None,
             "bytes_read": None, "bytes_needed": None, "bytes_written": written, "total_all_s": steady}]
    universal = directory / f"{tag}_universal"
    states = directory / tag / "mp_rank_00_model_states.pt"
    original = directory / "model_states.original.pt"
    shutil.copyfile(states, original)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
               str(directory / tag), "--output_folder", str(universal), "--inject_missing_state",
               "--num_extract_workers", str(args.ds_workers), "--num_merge_workers", str(args.ds_workers)]
    odd: dict | None = None  # the non-tensor module entries the workaround drops (None: not needed / not known)

    def convert_route(label: str) -> tuple[subprocess.CompletedProcess, float, int]:
        """DeepSpeed's checkpoint as it saved it, a cold page cache, then ds_to_universal (after the workaround, when
        ``odd`` is known): the process, its seconds and the bytes it read."""
        shutil.rmtree(universal, ignore_errors=True)
        shutil.copyfile(original, states)
        cold(directory, label)
        io_start = storage_read_bytes()  # the converter is a child process: its reads count once it is reaped
        start = time.perf_counter()
        if odd:  # Workaround (not DeepSpeed's route as shipped), timed as part of the route
            content = torch.load(states, map_location="cpu", weights_only=False)
            content["module"] = {n: v for n, v in content["module"].items() if n not in odd}
            torch.save(content, states)
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        return done, time.perf_counter() - start, storage_read_bytes() - io_start

    needed = None
    hetu_runs, ds_runs = [], []
    for k in range(args.loads):
        for route in (("hetu", "deepspeed") if k % 2 == 0 else ("deepspeed", "hetu")):
            if route == "hetu":
                cold(directory, f"hetu load (from deepspeed) {k + 1}/{args.loads}")
                loaded = run_ranks(hetu_from_ds_load_body, args.load_ranks, model_argv(args, args.load_ranks),
                                   str(directory), timeout=1800)
                needed = needed_per_host([r["held"] for r in loaded])  # the same model and M-rank plan as DS's
                hetu_runs.append((max(r["total_s"] for r in loaded), sum(r["bytes_read"] for r in loaded)))
                print(f"hetu load (from deepspeed) {k + 1}: {hetu_runs[-1][0]:.3f} s")
                continue
            done, convert, convert_read = convert_route(f"deepspeed ds_to_universal {k + 1}/{args.loads}")
            if done.returncode and odd is None:
                print(f"deepspeed ds_to_universal FAILED (exit {done.returncode}) after {convert:.3f} s: "
                      f"{' '.join(command)}\n{done.stderr[-1500:]}")
                content = torch.load(states, map_location="cpu", weights_only=False)
                odd = {n: type(v).__name__ for n, v in content["module"].items() if not isinstance(v, torch.Tensor)}
                print(f"{states.name}['module'] holds {len(odd)} non-tensor entries, e.g. "
                      f"{dict(list(odd.items())[:3])}; from now on the route drops them from the model states "
                      "first (load, filter, save: timed), converts and loads with load_module_strict=False; this "
                      "failed attempt is not counted")
                if not odd:
                    return rows
                done, convert, convert_read = convert_route("deepspeed ds_to_universal after the workaround")
            if done.returncode:
                print(f"deepspeed ds_to_universal FAILED (exit {done.returncode}):\n{done.stderr[-3000:]}")
                return rows
            cold(directory, f"deepspeed load_universal {k + 1}/{args.loads}")
            try:
                loaded = run_ranks(ds_universal_load_body, args.load_ranks, model_argv(args, args.load_ranks),
                                   str(directory), not odd, timeout=1800)
            except Exception:  # noqa: BLE001 - report DeepSpeed's own error text, make up no number
                print(f"deepspeed load_universal into {args.load_ranks} ranks FAILED (conversion took "
                      f"{convert:.3f} s):\n{traceback.format_exc()[-4000:]}")
                return rows
            load = max(r["total_s"] for r in loaded)
            load_read = sum(r["bytes_read"] for r in loaded)
            ds_runs.append((convert + load, convert, load, convert_read, load_read))
            print(f"deepspeed universal route {k + 1}: ds_to_universal {convert:.3f} s ({convert_read / 1e9:.3f} GB "
                  f"read) + load_checkpoint {load:.3f} s ({load_read / 1e9:.3f} GB read); check against the saving "
                  f"engine: {_same_state(saved, loaded)}")
    t, b = zip(*hetu_runs)
    mid = sorted(range(len(t)), key=t.__getitem__)[(len(t) - 1) // 2]
    rows.append({"system": "hetu", "op": "reshard_load", "read": "from deepspeed", "from": args.save_ranks,
                 "to": args.load_ranks, "blocking_s": statistics.median(t), "total_s": statistics.median(t),
                 "total_all_s": list(t), "bytes_read": b[mid], "bytes_mapped": None, "bytes_needed": needed,
                 "source": "deepspeed"})
    if ds_runs:
        totals = [r[0] for r in ds_runs]
        mid = sorted(range(len(totals)), key=totals.__getitem__)[(len(totals) - 1) // 2]
        _, convert, load, convert_read, load_read = ds_runs[mid]
        rows.append({"system": "deepspeed", "op": "reshard_load",
                     "read": "universal" + (" + workaround" if odd else ""),
                     "workaround": f"{len(odd)} non-tensor module entries dropped" if odd else None,
                     "from": args.save_ranks, "to": args.load_ranks, "blocking_s": statistics.median(totals),
                     "total_s": statistics.median(totals), "total_all_s": totals, "convert_s": convert,
                     "load_s": load, "bytes_read": convert_read + load_read, "convert_bytes_read": convert_read,
                     "load_bytes_read": load_read, "bytes_mapped": None, "bytes_needed": needed})
    shutil.rmtree(directory, ignore_errors=True)
    return rows


def model_argv(args, ranks: int, extra: tuple[str, ...] = ()) -> list[str]:
    return ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size), "--num-attention-heads",
            "8", "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", str(args.global_batch),
            "--train-iters", "1", "--lr", "1e-4", "--mock-data", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--hetu-runtime", "megatron", *extra]


def _hetu_save_row(args, saved: list[dict], directory: str, write_bps: float) -> dict:
    """The steady-state save (median over the saves after the first of the slowest rank) and what it wrote."""
    n = len(saved[0]["steady"])
    blocking = [max(r["steady"][i]["blocking_s"] for r in saved) for i in range(n)]
    total = [max(r["steady"][i]["total_s"] for r in saved) for i in range(n)]
    copies = [max(r["host_copies"][i] for r in saved) for i in range(len(saved[0]["host_copies"]))]
    written = sum(f.stat().st_size for f in Path(directory).glob("iter_*/*") if f.is_file())
    background = [t - b for t, b in zip(total, blocking)]
    print(f"hetu first save: blocking {max(r['first_blocking_s'] for r in saved):.3f} s, total "
          f"{max(r['first_total_s'] for r in saved):.3f} s (write plan gathered and assigned)")
    for i in range(n):
        print(f"hetu steady save {i + 1}: blocking {blocking[i]:.3f} s, total {total[i]:.3f} s; Checkpointer.save "
              "phases per rank: " + ", ".join(
                  "agree {agree_s:.4f} + gather {gather_s:.4f} + assign {assign_s:.4f} + copy {copy_s:.4f} = "
                  "{blocking_s:.4f} s (plan {how})".format(**r["steady"][i]["phases"],
                                                           how="cached" if r["steady"][i]["phases"]["cached"]
                                                           else "gathered") for r in saved))
    for r, rank in zip(saved, range(len(saved))):
        ph = r["first_phases"]
        print(f"hetu first save, rank {rank}: agree {ph['agree_s']:.4f} + gather {ph['gather_s']:.4f} + assign "
              f"{ph['assign_s']:.4f} + copy {ph['copy_s']:.4f} = {ph['blocking_s']:.4f} s")
    print("hetu plain host copy of the same bytes right before each steady save (all ranks at once, slowest rank): "
          + ", ".join(f"{c:.3f} s" for c in copies) + "; blocking / host copy per save: "
          + ", ".join(f"{b / c:.2f}" for b, c in zip(blocking, copies))
          + f"; medians: {statistics.median(blocking) / statistics.median(copies):.2f}")
    bps = written / statistics.median(background)
    print(f"hetu background write (total - blocking, median): {written / 1e9:.3f} GB in "
          f"{statistics.median(background):.3f} s = {bps / 1e9:.2f} GB/s, {100 * bps / write_bps:.0f}% of the "
          "measured disk write bandwidth "
          f"({', '.join(f'{b:.3f}' for b in background)} s)")
    return {"system": "hetu", "op": "save", "from": args.save_ranks, "to": args.save_ranks,
            "blocking_s": statistics.median(blocking), "total_s": statistics.median(total),
            "host_copy_s": statistics.median(copies),
            "bytes_read": None, "bytes_needed": None, "state_bytes": saved[0]["state_bytes"],
            "bytes_written": written, "write_bps": bps, "blocking_all_s": blocking, "total_all_s": total,
            "host_copy_all_s": copies}


def _save_rows(args, root: Path, system: str, write_bps: float) -> tuple[list[dict], dict]:
    """Save on N ranks (1 + HETU_STEADY_SAVES saves); the save row and the saving ranks' fingerprint."""
    from hetu_ext.testing.multiproc import run_ranks

    directory = str(root / system)
    saved = run_ranks(save_body, args.save_ranks, model_argv(args, args.save_ranks), directory, system,
                      timeout=1800)
    if system == "hetu":
        return [_hetu_save_row(args, saved, directory, write_bps)], saved[0]["fingerprint"]
    n = len(saved[0]["steady"])
    blocking = [max(r["steady"][i]["blocking_s"] for r in saved) for i in range(n)]
    total = [max(r["steady"][i]["total_s"] for r in saved) for i in range(n)]
    written = sum(f.stat().st_size for f in Path(directory).glob("iter_*/**/*") if f.is_file())
    print(f"{system} first save (async, fully parallel, structure cached from then on): blocking "
          f"{max(r['first_blocking_s'] for r in saved):.3f} s, total {max(r['first_total_s'] for r in saved):.3f} s; "
          f"steady saves: blocking {', '.join(f'{b:.3f}' for b in blocking)} s, total "
          f"{', '.join(f'{t:.3f}' for t in total)} s (medians in the table); {written / 1e9:.3f} GB written")
    return [{"system": system, "op": "save", "async": True, "from": args.save_ranks, "to": args.save_ranks,
             "blocking_s": statistics.median(blocking), "total_s": statistics.median(total), "host_copy_s": None,
             "bytes_read": None, "bytes_needed": None, "state_bytes": saved[0]["state_bytes"],
             "bytes_written": written, "blocking_all_s": blocking, "total_all_s": total}], saved[0]["fingerprint"]


LOADS = (("hetu", "node"), ("hetu", "once"), ("megatron", "plain"), ("megatron", "fully_parallel"))
"""The load routes of hetu's and Megatron's checkpoints: (checkpoint of system, read)."""


def _load_rows(args, root: Path, fingerprints: dict) -> list[dict]:
    """Load-and-reshard N -> M of every route of :data:`LOADS` whose checkpoint exists, ``args.loads`` cold loads
    each, the routes interleaved (a rotating order per round); the median load per route, checked against the
    saving ranks' fingerprint."""
    from hetu_ext.testing.multiproc import run_ranks

    routes = [(s, read) for s, read in LOADS if s in fingerprints]
    if not routes:  # --systems deepspeed: its own routes are in _deepspeed_rows
        return []
    runs: dict[tuple, list[dict]] = {r: [] for r in routes}
    for k in range(args.loads):
        shift = k % len(routes)
        for system, read in routes[shift:] + routes[:shift]:
            directory = str(root / system)
            extra = ("--hetu-ckpt-read", read) if system == "hetu" else ()
            kind = system if system == "hetu" or read == "plain" else "megatron_fully_parallel"
            cold(Path(directory), f"{system} load ({read}) {k + 1}/{args.loads}")
            loaded = run_ranks(load_body, args.load_ranks, model_argv(args, args.load_ranks, extra), directory,
                               kind, timeout=1800)
            if system == "hetu":
                print(f"hetu load ({read}) per rank: " + ", ".join(
                    f"read {r['read_s']:.2f} s + reshard {r['reshard_s']:.2f} s, {r['bytes_read'] / 1e9:.3f} GB "
                    f"from the disk, {r['bytes_mapped'] / 1e9:.3f} GB through the maps" for r in loaded))
            print(f"{system} load ({read}) {k + 1}: {max(r['total_s'] for r in loaded):.3f} s; check against the "
                  f"saving ranks: {same_fingerprint(fingerprints[system], loaded[0]['fingerprint'])}")
            runs[(system, read)].append(loaded)
    rows = []
    for (system, read), loads in runs.items():
        totals = [max(r["total_s"] for r in loaded) for loaded in loads]
        loaded = loads[totals.index(sorted(totals)[(len(totals) - 1) // 2])]  # the median run's bytes
        rows.append({"system": system, "op": "reshard_load", "read": read, "from": args.save_ranks,
                     "to": args.load_ranks, "blocking_s": statistics.median(totals),
                     "total_s": statistics.median(totals), "total_all_s": totals,
                     "bytes_read": sum(r["bytes_read"] for r in loaded),
                     "bytes_mapped": sum(r["bytes_mapped"] for r in loaded) if system == "hetu" else None,
                     "bytes_needed": needed_per_host([r["held"] for r in loaded])})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--save-ranks", type=int, default=2)
    p.add_argument("--load-ranks", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=6, help="divisible by both rank counts")
    p.add_argument("--systems", default="hetu,megatron,deepspeed", help="comma-separated subset")
    p.add_argument("--loads", type=int, default=3, help="cold loads per load route (median in the table)")
    p.add_argument("--ds-workers", type=int, default=2, help="ds_to_universal extract and merge workers")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    args = p.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="hetu_ckpt_bench_"))
    root.mkdir(parents=True, exist_ok=True)
    write_bps, read_bps = disk_bandwidth(root, 1 << 30)
    print(f"model: {args.num_layers} layers, hidden {args.hidden_size}; save on {args.save_ranks} ranks, load on "
          f"{args.load_ranks}; dir {root}\ndisk: write {write_bps / 1e9:.2f} GB/s, read {read_bps / 1e9:.2f} GB/s")
    systems = args.systems.split(",")
    rows, fingerprints = [], {}
    for system in ("hetu", "megatron"):
        if system in systems:
            saved, fingerprints[system] = _save_rows(args, root, system, write_bps)
            rows += saved
    rows += _load_rows(args, root, fingerprints)
    for system in fingerprints:
        shutil.rmtree(root / system, ignore_errors=True)
    if "deepspeed" in systems:
        rows += _deepspeed_rows(args, root)
    table = Table.of(("system", "<9"), ("op", "<40"), ("from->to", "<9"), ("blocking s", ">10.3f"),
                     ("total s", ">8.3f"), ("host copy s", ">11"), ("GB read", ">8"), ("GB needed", ">9"),
                     ("GB mapped", ">9"))
    print()
    table.print_header()

    def gb(v):
        return f"{v / 1e9:.3f}" if v is not None else "-"

    for r in rows:
        copy = f"{r['host_copy_s']:.3f}" if r.get("host_copy_s") else "-"
        op = r["op"] + (f" ({r['read']})" if r.get("read") else "") + (" (async)" if r.get("async") else "")
        table.print_row([r["system"], op, f"{r['from']}->{r['to']}", r["blocking_s"], r["total_s"], copy,
                         gb(r["bytes_read"]), gb(r["bytes_needed"]), gb(r.get("bytes_mapped"))])
    summary = _summary(rows)
    print_result({"disk_write_bps": write_bps, "disk_read_bps": read_bps, "loads_per_route": args.loads,
                  "saves_per_system": 1 + HETU_STEADY_SAVES, "summary": summary, "rows": rows})


def _summary(rows: list[dict]) -> dict:
    """The targets' ratios, each against the strongest baseline row (printed with its name)."""
    def best(system: str, op: str, exclude: str | None = None) -> dict | None:
        found = [r for r in rows if r["system"] == system and r["op"] == op
                 and (exclude is None or r.get("read") != exclude)]
        return min(found, key=lambda r: r["total_s"]) if found else None

    out = {}
    hetu_load = best("hetu", "reshard_load", exclude="from deepspeed")
    hetu_save = best("hetu", "save")
    for name, other in (("megatron", best("megatron", "reshard_load")), ("deepspeed", best("deepspeed",
                                                                                            "reshard_load"))):
        if hetu_load and other:
            out[f"hetu_load_over_{name}_best"] = round(other["total_s"] / hetu_load["total_s"], 3)
            print(f"hetu reshard load ({hetu_load['read']}, {hetu_load['total_s']:.3f} s) vs {name}'s best "
                  f"({other.get('read')}, {other['total_s']:.3f} s): {other['total_s'] / hetu_load['total_s']:.2f}x")
    if hetu_save:
        out["hetu_blocking_over_host_copy"] = round(hetu_save["blocking_s"] / hetu_save["host_copy_s"], 3)
        print(f"hetu save blocking / host copy: {hetu_save['blocking_s'] / hetu_save['host_copy_s']:.2f}")
        megatron_save = best("megatron", "save")
        if megatron_save:
            out["megatron_async_blocking_over_hetu"] = round(megatron_save["blocking_s"] / hetu_save["blocking_s"], 3)
            print(f"megatron async save blocking / hetu's: {out['megatron_async_blocking_over_hetu']:.2f}")
    return out


if __name__ == "__main__":
    main()
