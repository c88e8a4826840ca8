"""Resume a DeepSpeed ZeRO job at another world size: hetu_ext's in-process load against DeepSpeed's best route.

    python -m benchmarks.deepspeed_resume [--hidden-size 512 --num-layers 8] [--pairs 4:3,2:3] [--repeats 3]

The same model (Megatron-core GPT through hetu_ext/deepspeed/engine.py, ZeRO-2 by default: fp32 module weights,
fp32 master partitions, both Adam moments, after one step) is saved by DeepSpeed's ``engine.save_checkpoint`` on N
ranks once per pair, then resumed on M ranks by two routes, each started from a cold page cache (the checkpoint's
files evicted with posix_fadvise), routes interleaved (the order alternates per repeat), ``--repeats`` times:

* hetu: a DeepSpeed engine on M ranks ``--load``s the checkpoint in process (hetu_ext/deepspeed/engine_load.py:
  DeepSpeed's own reconstruction of each kind on one rank, the reshard engine into the engine's ZeRO fragments,
  the LR schedule, iteration and data position). Nothing is written.
* deepspeed: ``python -m deepspeed.checkpoint.ds_to_universal --inject_missing_state`` (a subprocess, timed with its
  interpreter start; ``--ds-workers`` extract and merge workers), then a DeepSpeed engine on M ranks with
  ``"checkpoint": {"load_universal": true}`` and ``engine.load_checkpoint`` (the converted files evicted first).
  DeepSpeed 0.19.8's converter fails on Megatron-core's module state (``_extra_state`` entries that are None, see
  benchmarks/checkpoint.py); the route then drops those entries from the model states file (timed, part of the
  route) and loads with ``load_module_strict=False``, and says so.

Wall time: from the start of the load (ranks built, barrier) to its end (barrier); for the universal route the
conversion plus the load. Building the M-rank engine is needed by both routes and not counted. Peak memory: the
largest process's peak resident set during the route (VmHWM, reset through /proc/self/clear_refs before the load;
for the converter, the largest of its processes by getrusage(RUSAGE_CHILDREN)), and its growth during the route (a
rank's peak minus its resident set before the load, whose ~0.4 GB of imports and engine both routes pay; the
converter's whole peak, a fresh process). Temp disk: bytes the route writes beside the checkpoint (the universal
folder; hetu writes none, checked by listing the checkpoint directory before and after). Each load is checked
against the saving engine (sums of |x| of module weights, fp32 partitions and Adam moments; Adam's step). Prints its
configuration, a table and one JSON line.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import checkpoint as checkpoint_bench  # its page-cache and I/O helpers and DeepSpeed fingerprint
from benchmarks.common import ROOT, Table, print_result


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def model_argv(args, ranks: int) -> list[str]:
    return ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size), "--num-attention-heads",
            "8", "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", str(args.global_batch),
            "--train-iters", "1", "--lr", "1e-4", "--mock-data", "--hidden-dropout", "0", "--attention-dropout", "0"]


def _run(argv: list[str], stage: int, extra: dict | None = None):
    from hetu_ext.config import from_namespace
    from hetu_ext.deepspeed.engine import ZeroConfig, add_deepspeed_args, build
    from hetu_ext.cli.args import build_parser, validate_args

    args = add_deepspeed_args(build_parser()).parse_args(argv)
    validate_args(args)
    return build(from_namespace(args), ZeroConfig(stage=stage, extra=extra or {}))


def check(saved: list[dict], loaded: list[dict]) -> float:
    """Largest relative difference of the fingerprints (0.0: the same bytes summed in another order can differ
    by rounding only); raises if Adam's step differs."""
    a, b = ({k: sum(r["fp"][k] for r in rs) for k in ("master", "exp_avg", "exp_avg_sq")} for rs in (saved, loaded))
    a["module"], b["module"] = saved[0]["fp"]["module"], loaded[0]["fp"]["module"]
    if saved[0]["fp"]["steps"] != loaded[0]["fp"]["steps"]:
        raise RuntimeError(f"Adam steps saved {saved[0]['fp']['steps']} loaded {loaded[0]['fp']['steps']}")
    return max(abs(a[k] - b[k]) / max(abs(a[k]), 1e-30) for k in a)


def save_body(rank: int, world: int, argv: list[str], stage: int, directory: str) -> dict:
    run = _run(argv, stage)
    run.train()  # one step: Adam's moments exist
    run.save(directory)
    return {"fp": checkpoint_bench.ds_fingerprint(run.engine)}


def _timed_load(load, engine) -> dict:
    import torch.distributed as dist

    bench = checkpoint_bench
    dist.barrier()
    rss_before = _status_kb("VmRSS")
    _reset_peak()
    io_start = bench.storage_read_bytes()
    start = time.perf_counter()
    load()
    dist.barrier()
    took = time.perf_counter() - start
    return {"s": took, "peak_kb": _status_kb("VmHWM"), "before_kb": rss_before,
            "read": bench.storage_read_bytes() - io_start, "fp": bench.ds_fingerprint(engine)}


def hetu_load_body(rank: int, world: int, argv: list[str], stage: int, directory: str) -> dict:
    run = _run(argv, stage)
    return _timed_load(lambda: run.load(directory), run.engine)


def universal_load_body(rank: int, world: int, argv: list[str], stage: int, directory: str, strict: bool) -> dict:
    run = _run(argv, stage, {"checkpoint": {"load_universal": True}})

    def load():
        path, _ = run.engine.load_checkpoint(directory, load_optimizer_states=True, load_lr_scheduler_states=False,
                                             load_module_strict=strict)
        if path is None:
            raise RuntimeError(f"load_checkpoint({directory!r}) with load_universal found no checkpoint")

    return _timed_load(load, run.engine)


def _tree(directory: Path) -> dict[str, int]:
    return {str(p.relative_to(directory)): p.stat().st_size for p in directory.rglob("*") if p.is_file()}


def _children_peak_kb() -> int:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss


def one_pair(args, bench, root: Path, n: int, m: int) -> list[dict]:
    import torch

    from hetu_ext.testing.multiproc import run_ranks

    directory = root / f"ckpt_{n}to{m}"
    saved = run_ranks(save_body, n, model_argv(args, n), args.zero_stage, str(directory), timeout=1800)
    tag = (directory / "latest").read_text().strip()
    size = sum(_tree(directory / tag).values())
    print(f"saved ZeRO-{args.zero_stage} on {n} ranks: {directory / tag} ({size / 1e9:.3f} GB)")
    universal = directory / f"{tag}_universal"
    states = directory / tag / "mp_rank_00_model_states.pt"
    original = root / f"model_states_{n}to{m}.original.pt"
    shutil.copyfile(states, original)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(directory / tag),
               "--output_folder", str(universal), "--inject_missing_state", "--num_extract_workers",
               str(args.ds_workers), "--num_merge_workers", str(args.ds_workers)]
    odd: dict | None = None
    rows: dict[str, list[dict]] = {"hetu": [], "deepspeed": []}

    def convert() -> tuple[subprocess.CompletedProcess, float]:
        shutil.rmtree(universal, ignore_errors=True)
        shutil.copyfile(original, states)
        bench.cold(directory, f"{n}->{m} ds_to_universal")
        start = time.perf_counter()
        if odd:  # the workaround, timed as part of the route
            content = torch.load(states, map_location="cpu", weights_only=False)
            content["module"] = {k: v for k, v in content["module"].items() if k not in odd}
            torch.save(content, states)
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        return done, time.perf_counter() - start

    for k in range(args.repeats):
        for route in (("hetu", "deepspeed") if k % 2 == 0 else ("deepspeed", "hetu")):
            if route == "hetu":
                before = _tree(directory)
                bench.cold(directory, f"{n}->{m} hetu in-process load {k + 1}/{args.repeats}")
                loaded = run_ranks(hetu_load_body, m, model_argv(args, m), args.zero_stage, str(directory),
                                   timeout=1800)
                temp = sum(v for p, v in _tree(directory).items() if p not in before)
                rows["hetu"].append({"s": max(r["s"] for r in loaded), "peak_kb": max(r["peak_kb"] for r in loaded),
                                     "growth_kb": max(r["peak_kb"] - r["before_kb"] for r in loaded),
                                     "peak_sum_kb": sum(r["peak_kb"] for r in loaded), "temp": temp,
                                     "diff": check(saved, loaded)})
                print(f"{n}->{m} hetu {k + 1}: {rows['hetu'][-1]}")
                continue
            done, conv_s = convert()
            if done.returncode and odd is None:
                print(f"ds_to_universal FAILED (exit {done.returncode}) as shipped:\n{done.stderr[-1200:]}")
                content = torch.load(states, map_location="cpu", weights_only=False)
                odd = {key: type(v).__name__ for key, v in content["module"].items()
                       if not isinstance(v, torch.Tensor)}
                print(f"{len(odd)} non-tensor module entries (e.g. {dict(list(odd.items())[:2])}) are dropped from "
                      "now on (timed), loads use load_module_strict=False; the failed attempt is not counted")
                done, conv_s = convert()
            if done.returncode:
                raise RuntimeError(f"ds_to_universal failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
            conv_peak = _children_peak_kb()
            temp = sum(_tree(universal).values())
            bench.cold(directory, f"{n}->{m} load_universal {k + 1}/{args.repeats}")
            loaded = run_ranks(universal_load_body, m, model_argv(args, m), args.zero_stage, str(directory), not odd,
                               timeout=1800)
            load_s = max(r["s"] for r in loaded)
            rows["deepspeed"].append({"s": conv_s + load_s, "convert_s": conv_s, "load_s": load_s,
                                      "peak_kb": max([conv_peak] + [r["peak_kb"] for r in loaded]),
                                      "growth_kb": max([conv_peak] + [r["peak_kb"] - r["before_kb"] for r in loaded]),
                                      "convert_peak_kb": conv_peak, "peak_sum_kb": sum(r["peak_kb"] for r in loaded),
                                      "temp": temp, "diff": check(saved, loaded)})
            print(f"{n}->{m} deepspeed {k + 1}: {rows['deepspeed'][-1]}")
            shutil.rmtree(universal, ignore_errors=True)
    shutil.rmtree(directory, ignore_errors=True)
    out = []
    for route, runs in rows.items():
        times = [r["s"] for r in runs]
        mid = sorted(range(len(runs)), key=times.__getitem__)[(len(runs) - 1) // 2]
        row = {"route": route, "from": n, "to": m, "checkpoint_bytes": size, "median_s": statistics.median(times),
               "all_s": times, **{key: runs[mid][key] for key in runs[mid] if key != "s"},
               "workaround": f"{len(odd)} non-tensor module entries dropped" if route == "deepspeed" and odd else None}
        out.append(row)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--zero-stage", type=int, default=2, choices=(1, 2, 3))
    p.add_argument("--pairs", default="4:3,2:3", help="N:M resumes (saved on N ranks, loaded on M)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ds-workers", type=int, default=2, help="ds_to_universal extract and merge workers")
    p.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import deepspeed  # noqa: F401 - its version below
    import torch

    bench = checkpoint_bench
    pairs = [tuple(int(x) for x in pair.split(":")) for pair in args.pairs.split(",")]
    print(f"config: ZeRO-{args.zero_stage}, {args.num_layers} layers, hidden {args.hidden_size}, pairs {pairs}, "
          f"{args.repeats} repeats per route (interleaved, cold page cache), ds_to_universal workers "
          f"{args.ds_workers}; {platform.node()} {os.cpu_count()} cpus, python {platform.python_version()}, torch "
          f"{torch.__version__}, deepspeed {sys.modules['deepspeed'].__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="ds_resume_", dir=args.dir) as tmp:
        for n, m in pairs:
            rows += one_pair(args, bench, Path(tmp), n, m)
    print()
    table = Table.of(("resume", "<7"), ("route", "<42"), ("wall s (median)", ">15.3f"), ("all s", ">22"),
                     ("peak RSS MB", ">12.0f"), ("+MB in load", ">12.0f"), ("temp disk MB", ">13.1f"),
                     ("state diff", ">10.1e"))
    table.print_header()
    for r in rows:
        label = ("hetu_ext in-process --load" if r["route"] == "hetu"
                 else "ds_to_universal + load_universal" + (" (+fix)" if r["workaround"] else ""))
        table.print_row([f"{r['from']}->{r['to']}", label, r["median_s"], ",".join(f"{t:.2f}" for t in r["all_s"]),
                         r["peak_kb"] / 1024, r["growth_kb"] / 1024, r["temp"] / 1e6, r["diff"]])
    speedups = {}
    for n, m in pairs:
        h = next(r for r in rows if r["route"] == "hetu" and (r["from"], r["to"]) == (n, m))
        d = next(r for r in rows if r["route"] == "deepspeed" and (r["from"], r["to"]) == (n, m))
        speedups[f"{n}->{m}"] = d["median_s"] / h["median_s"]
        print(f"{n}->{m}: hetu_ext in-process {d['median_s'] / h['median_s']:.1f}x faster than ds_to_universal + "
              f"load_universal (conversion {d['convert_s']:.2f} s + load {d['load_s']:.2f} s); temp disk "
              f"{h['temp']} B vs {d['temp'] / 1e6:.1f} MB; peak RSS of the largest process {h['peak_kb'] / 1024:.0f} "
              f"vs {d['peak_kb'] / 1024:.0f} MB, its growth during the route {h['growth_kb'] / 1024:.0f} vs "
              f"{d['growth_kb'] / 1024:.0f} MB")
    print_result({"benchmark": "deepspeed_resume", "zero_stage": args.zero_stage, "speedup": speedups,
                  "rows": rows})


if __name__ == "__main__":
    main()
