"""A straggler in a DeepSpeed ZeRO job: straggler weighting against doing nothing and against dropping the slow rank.

    python -m benchmarks.deepspeed_straggler [--zero-stage 3] [--slowdowns 3,1.5] [--steps 8] [--layer-ms 40]

One DeepSpeed job (hetu_ext/deepspeed/engine.py: Megatron-core GPT, ZeRO-3 and --bf16 by default, CPU gloo ranks
forked from a preloaded forkserver) of ``--ranks`` ranks, the last one emulated ``x`` times slower from step 1 (each
transformer layer's forward takes ``--layer-ms`` of emulated device time for a full microbatch of micro-batch size
x seq-length tokens, proportionally less for fewer tokens, backward twice that, times ``x`` on the slow rank), in
one process run per row:

* none: every rank keeps its share of the global batch; every step waits for the slow rank.
* weighted: ``--hetu-straggler-interval 1``: the monitor measures the layer times after each step and moves samples
  from the slow rank to the others (the same microbatch count on every rank, hetu_ext/deepspeed/weighting.py);
  the time is that of the steps after the first change.
* dropped: what a DeepSpeed user can do without weighting: stop the job after step 2 (a DeepSpeed checkpoint on
  ``--ranks`` ranks), start it on the healthy ranks and resume there (hetu_ext's in-process load at the new world size: no
  ds_to_universal). The time is the healthy job's steady step; the restart cost (save, the new job's engine build
  and load; not the interpreter start and imports, which a forkserver here pays once) is reported beside it, with
  the steps after which dropping has caught up with weighting.

A step's time is rank 0's wall time between the ends of consecutive steps (every rank ends a step in the same
collective); a row's figure is the median over the steady steps (after the first two, or after the first change).
The emulated time dominates the real compute only on an idle machine: the load average before and after each run
is printed, and figures taken beside other jobs are the machine's, not the method's. Prints its configuration, a
table and one JSON line.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import Table, print_result


def model_argv(args, ranks: int, slowdown: float | None, weighted: bool, steps: int) -> list[str]:
    """The job's flags to step ``steps``: ``slowdown`` on the last of ``ranks`` ranks (None: healthy), the monitor
    acting when ``weighted``."""
    argv = ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size), "--num-attention-heads",
            "4", "--seq-length", str(args.seq_length), "--micro-batch-size", str(args.micro_batch_size),
            "--global-batch-size", str(args.global_batch_size), "--train-iters", str(steps), "--lr", "1e-4",
            "--lr-decay-style", "constant", "--mock-data", "--seed", "7", "--log-interval", "1000",
            "--hetu-emulate-layer-ms", str(args.layer_ms)]
    if args.bf16:
        argv.append("--bf16")
    if slowdown is not None and slowdown != 1.0:
        argv += ["--hetu-emulate-slowdown", f"step=1:rank={ranks - 1}:x={slowdown}"]
    argv += ["--hetu-straggler-interval", "1", "--hetu-straggler-window", "1"]  # the emulation runs in the monitor
    if not weighted:
        argv += ["--hetu-straggler-threshold", "1e9"]  # which then never finds a straggler
    return argv


def job_body(rank: int, world: int, argv: list[str], stage: int, load: str | None, save: str | None) -> dict:
    """Build (and ``load``), train, (``save``); rank 0 returns its step end times, the counts' history and the
    build, load and save seconds."""
    import torch.distributed as dist

    from hetu_ext.cli.args import build_parser, validate_args
    from hetu_ext.config import from_namespace
    from hetu_ext.deepspeed.engine import ZeroConfig, add_deepspeed_args, build

    args = add_deepspeed_args(build_parser()).parse_args(argv)
    validate_args(args)
    config = from_namespace(args)
    dist.barrier() if dist.is_initialized() else None
    start = time.perf_counter()
    run = build(config, ZeroConfig(stage=stage, straggler_interval=config.straggler.interval))
    dist.barrier()
    built = time.perf_counter()
    if load:
        run.load(load)
    dist.barrier()
    loaded = time.perf_counter()
    ends: list[float] = [loaded]
    run.train(log=lambda line: None, after_step=lambda it: ends.append(time.perf_counter()))
    saved = time.perf_counter()
    if save:
        run.save(save)
        dist.barrier()
    done = time.perf_counter()
    history = run.weighting.history if run.weighting is not None else []
    return {"ends": ends, "history": history, "build_s": built - start, "load_s": loaded - built,
            "save_s": done - saved, "tokens": run.rank_tokens} if rank == 0 else None


def _steady(ends: list[float], first: int) -> float:
    """Median step time of steps ``first`` (1-based) and later."""
    steps = [b - a for a, b in zip(ends, ends[1:])]
    return statistics.median(steps[first - 1:])


def run_job(args, ranks: int, slowdown: float | None, weighted: bool, load: str | None = None,
            save: str | None = None, steps: int | None = None) -> tuple[dict, tuple[float, float]]:
    """One job on ``ranks`` forked ranks to step ``steps`` (default ``--steps``); (rank 0's report, load averages
    (before, after))."""
    from hetu_ext.testing.multiproc import run_ranks

    before = os.getloadavg()[0]
    argv = model_argv(args, ranks, slowdown, weighted, steps or args.steps)
    report = run_ranks(job_body, ranks, argv, args.zero_stage, load, save, timeout=args.timeout)[0]
    return report, (before, os.getloadavg()[0])


def one_slowdown(args, x: float, table: Table) -> dict:
    """The three rows of one slowdown; returns their figures."""
    none, load_none = run_job(args, args.ranks, x, weighted=False)
    t_none = _steady(none["ends"], 3)
    table.print_row((x, "none", t_none * 1e3, 1.0, 0.0, float("nan")),
                    f"load {load_none[0]:.1f}-{load_none[1]:.1f}")
    weighted, load_w = run_job(args, args.ranks, x, weighted=True)
    changed = weighted["history"][1][0] if len(weighted["history"]) > 1 else args.steps
    t_weighted = _steady(weighted["ends"], max(changed, 2))
    table.print_row((x, "weighted", t_weighted * 1e3, t_none / t_weighted, 0.0, float("nan")),
                    f"counts {weighted['history']}; load {load_w[0]:.1f}-{load_w[1]:.1f}")
    with tempfile.TemporaryDirectory(prefix="ds_straggler_") as tmp:
        directory = str(Path(tmp) / "ckpt")
        halfway, _ = run_job(args, args.ranks, x, weighted=False, save=directory, steps=2)
        dropped, load_d = run_job(args, args.ranks - 1, None, weighted=False, load=directory)
    t_dropped = _steady(dropped["ends"], 1)
    restart = halfway["save_s"] + dropped["build_s"] + dropped["load_s"]
    gain = t_weighted - t_dropped  # seconds a step the dropped job saves over weighting (negative: it loses)
    catch_up = restart / gain if gain > 0 else None  # None: dropping never catches up with weighting
    table.print_row((x, "dropped", t_dropped * 1e3, t_none / t_dropped, restart,
                     float("inf") if catch_up is None else catch_up),
                    f"save {halfway['save_s']:.2f} s, build {dropped['build_s']:.2f} s, load {dropped['load_s']:.2f} "
                    f"s; load {load_d[0]:.1f}-{load_d[1]:.1f}")
    return {"slowdown": x, "none_ms": t_none * 1e3, "weighted_ms": t_weighted * 1e3, "dropped_ms": t_dropped * 1e3,
            "weighted_counts": weighted["history"], "restart_s": restart, "dropped_catches_up_after_steps": catch_up,
            "load_average": [load_none[0], load_d[1]]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--zero-stage", type=int, default=3, choices=(0, 1, 2, 3))
    p.add_argument("--fp32", dest="bf16", action="store_false", help="fp32 instead of --bf16")
    p.add_argument("--ranks", type=int, default=3)
    p.add_argument("--slowdowns", default="3,1.5", help="the slow rank's slowdowns, one job set each (e.g. 3,1.5)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--layer-ms", type=float, default=40.0, help="emulated forward of one layer, full microbatch")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=32)
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=48)
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    import torch

    print(f"DeepSpeed ZeRO-{args.zero_stage} {'bf16' if args.bf16 else 'fp32'} on {args.ranks} CPU ranks, the last "
          f"slowed; {args.num_layers} layers x hidden {args.hidden_size}, seq {args.seq_length}, micro-batch "
          f"{args.micro_batch_size}, global batch {args.global_batch_size}; {args.steps} steps; emulated layer "
          f"forward {args.layer_ms} ms; {platform.node()} {os.cpu_count()} cores, torch {torch.__version__}; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    table = Table.of(("x", ">4.1f"), ("route", "<9"), ("step ms", ">8.1f"), ("speedup", ">7.2f", "x"),
                     ("restart s", ">9.2f"), ("catch-up", ">8.1f"), tail="notes")
    table.print_header()
    rows = [one_slowdown(args, float(x), table) for x in args.slowdowns.split(",")]
    print_result({"benchmark": "deepspeed_straggler", "zero_stage": args.zero_stage, "bf16": args.bf16,
                  "ranks": args.ranks, "layer_ms": args.layer_ms, "rows": rows})


if __name__ == "__main__":
    main()
