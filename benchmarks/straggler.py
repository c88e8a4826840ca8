"""Stragglers on 8 emulated CPU ranks: Megatron's uniform plan (waiting, or restarted without the slow ranks) vs
the Malleus plan vs a strict ideal.

    python -m benchmarks.straggler [--iters 10] [--repeats 1] [--microbatches 64] [--scenario "name=1:3.0,6:3.0"]

8 ranks as 2 emulated nodes of 4, a tiny GPT (6 layers, hidden 64, 4 heads, sequence 64, micro batch 1, 64
microbatches per step: with 32, one 5x straggler's best integral split is 0.89-0.90 of the fluid ideal below, so
the ideal could not be approached by granularity alone; with 64 it is within 1%). Every layer has an emulated
device time (--hetu-emulate-layer-ms 16: 16 ms forward, 32 ms backward per microbatch, x the rank's slowdown), so
8 ranks sharing 2 cores keep the pace of an 8-GPU cluster instead of speeding up whenever a straggler sleeps; the
step records' ``emulation_overruns`` (layers whose real time exceeded the emulated one) are summed per run and
printed, so a run where the emulation did not hold shows.
Slowdown sets from Malleus's experiments mapped onto 8 ranks, plus one node at 2x (``--scenario NAME=R:X,R:X``,
repeatable, runs given sets instead). For each set, emulated from step 1 (--hetu-emulate-slowdown):

* uniform (wait): Megatron's own data-parallel plan on all 8 ranks (TP 1, PP 1, DP 8), at the straggler's pace;
* drop: Megatron's best uniform layout after restarting without the slow ranks, what a user would otherwise do:
  ``best_uniform`` of benchmarks/planner_scale.py searches every cutoff (drop the ranks slower than it, keep-all
  included) and every PP x DP on what is left (DP must divide the microbatches; PP the 6 layers), by the
  same cost model; the chosen layout then trains for real on its own ranks through Megatron's path (fewer
  processes on the same 2 cores), its kept slow ranks emulated where the layout put them. The restart itself
  (relaunch, checkpoint load) is not counted: this row is an upper bound on what dropping gives;
* hetu_ext: the plan ``plan_malleus`` makes for the true slowdowns, run on the plan runtime;
* ideal (strict): the step's non-emulated part F (optimizer, all-reduce, data, Python: the healthy run's step
  minus its emulated compute E) kept, the emulated compute spread perfectly by speed:
  ``F + E x 8 / sum_r 1/x_r``. No plan can beat it (F is not scaled; the compute is a fluid bound).

TP is 1 in every row: the emulated layer time does not shrink with TP, so a TP group would only add gloo
all-reduces. The systems of a set run in rotating order (interleaved); with ``--repeats N`` each runs N times and
its median step time counts. Step time is the median over the steps after the first two. ``detected``: the
straggler monitor's estimate of each slow rank (measured in the uniform run, --hetu-straggler-interval 1) beside
the true factor. ``sim_error`` compares the simulator's prediction for the hetu_ext plan with its measured step.

A last run starts on the uniform plan with rank 1 turning 5x slow at step 4 and re-plans online: it prints the
detection latency (steps from onset to the new plan), the slowdown detected then and the last estimate, and the
migration time. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
from pathlib import Path

from benchmarks.common import ROOT, Table, print_result

SCENARIOS = [
    ("one_5x", {1: 5.0}),
    ("2x_3x", {1: 2.0, 5: 3.0}),
    ("mixed_4", {1: 1.5, 2: 1.1, 5: 1.2, 6: 5.0}),
    ("three_slow", {1: 4.79, 4: 2.34, 6: 3.8}),
    ("two_12x", {2: 12.53, 3: 12.53, 5: 2.57}),
    ("node_2x", {4: 2.0, 5: 2.0, 6: 2.0, 7: 2.0}),
]
WORLD, GPUS_PER_NODE, MBS, SEQ, LAYERS = 8, 4, 1, 64, 6
MICROBATCHES = 64
LAYER_MS = 16.0
MODEL = ["--num-layers", str(LAYERS), "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", str(SEQ),
         "--micro-batch-size", str(MBS), "--lr", "1e-3",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1",
         "--hetu-emulate-layer-ms", str(LAYER_MS), "--hetu-straggler-interval", "1000"]


def parse_scenario(text: str) -> tuple[str, dict[int, float]]:
    """``NAME=R:X,R:X`` -> (name, {rank: x}); ValueError naming the rule."""
    name, sep, body = text.partition("=")
    try:
        slow = {int(r): float(x) for r, x in (item.split(":") for item in body.split(",") if item)}
    except ValueError:
        slow = None
    if not sep or not name or not slow or any(not 0 <= r < WORLD or x < 1 for r, x in slow.items()):
        raise ValueError(f"--scenario {text!r}: expected NAME=RANK:X[,RANK:X...] with ranks 0..{WORLD - 1} and "
                         "x >= 1, e.g. two_3x=1:3.0,6:3.0")
    return name, slow


def emulation(slowdowns: dict[int, float]) -> list[str]:
    slow = {r: x for r, x in slowdowns.items() if x > 1}
    if not slow:
        return []
    return ["--hetu-emulate-slowdown", ",".join(f"step=1:rank={r}:x={x}" for r, x in sorted(slow.items()))]


def main() -> None:
    from benchmarks.planner_scale import best_uniform

    from hetu_ext.megatron.preprocess_data import preprocess
    from hetu_ext.metrics import read_records
    from hetu_ext.plan import ModelSpec, dump_plan
    from hetu_ext.plan.core.cluster import Cluster
    from hetu_ext.plan.cost.stage import CostModel, layer_forward_flops
    from hetu_ext.plan.malleus import plan_malleus, plan_step_s
    from hetu_ext.testing.multiproc import run_ranks
    from hetu_ext.cli.runs import train

    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--microbatches", type=int, default=MICROBATCHES, help="microbatches (sequences) per "
                        "step; a multiple of 8")
    parser.add_argument("--repeats", type=int, default=1, help="runs per system and set (median counts)")
    parser.add_argument("--scenario", action="append", default=[], help="NAME=RANK:X[,RANK:X...], repeatable; "
                        "replaces the built-in sets")
    args = parser.parse_args()
    try:
        scenarios = [parse_scenario(s) for s in args.scenario] or SCENARIOS
    except ValueError as exc:
        parser.error(str(exc))
    tmp = Path(tempfile.mkdtemp(prefix="hetu_straggler_"))
    prefix, _ = preprocess(str(ROOT / "hetu_ext/data/samples/python_reference.jsonl"), str(tmp / "pyref"))
    microbatches = args.microbatches
    data = ["--data-path", prefix, "--split", "100,0,0", "--train-iters", str(args.iters), "--global-batch-size",
            str(MBS * microbatches)]
    spec = ModelSpec(num_layers=LAYERS, hidden_size=64, num_attention_heads=4, vocab_size=257, seq_length=SEQ)
    cost = CostModel(flops_per_s=layer_forward_flops(spec, MBS) / (LAYER_MS / 1e3))  # the emulated device
    tokens = MBS * microbatches * SEQ
    emulated_healthy_s = microbatches // WORLD * LAYERS * 3 * LAYER_MS / 1e3  # E: a healthy rank's emulated compute
    counter = itertools.count()

    def run(extra: list[str], world: int = WORLD) -> tuple[list[dict], Path]:
        """Train with ``extra`` flags on ``world`` ranks; the run's step records and metrics file."""
        metrics = tmp / f"run{next(counter)}.jsonl"
        run_ranks(train, world, MODEL + data + extra + ["--hetu-metrics-file", str(metrics)], False, timeout=1800)
        return read_records(metrics, kind="step"), metrics

    def seconds(records: list[dict]) -> float:
        return statistics.median(r["step_ms"] / 1e3 for r in records[2:])

    def overruns(records: list[dict]) -> int:
        return sum(r.get("emulation_overruns", 0) for r in records)

    def plan_for(cluster):
        return plan_malleus(cluster, spec, micro_batch=MBS, num_microbatches=microbatches, cost=cost,
                            tp_degrees=(1,))

    print(f"config: {WORLD} CPU ranks as {WORLD // GPUS_PER_NODE} nodes of {GPUS_PER_NODE}, {' '.join(MODEL)}, "
          f"--global-batch-size {MBS * microbatches} --train-iters {args.iters}, {args.repeats} run(s) per system "
          "and set, systems interleaved")
    healthy_records, _ = run(["--hetu-runtime", "megatron"])
    healthy_s = seconds(healthy_records)
    fixed_s = healthy_s - emulated_healthy_s
    healthy = Cluster(world_size=WORLD, gpus_per_node=GPUS_PER_NODE, gpu_memory_bytes=2**34)
    predicted_healthy = plan_step_s(plan_for(healthy).plan, healthy, spec, micro_batch=MBS, cost=cost)
    print(f"healthy uniform: {healthy_s * 1e3:.0f} ms/step ({tokens / healthy_s:.0f} tokens/s): emulated compute "
          f"E {emulated_healthy_s * 1e3:.0f} ms + the rest F {fixed_s * 1e3:.0f} ms; "
          f"{overruns(healthy_records)} emulation overruns\n")
    table = Table.of(("scenario", "<12"), ("slowdowns", "<24"), ("uniform", ">8"), ("drop", ">8"),
                     ("drop layout", "<22"), ("hetu", ">8"), ("ideal", ">8"), ("hetu/ideal", ">10.2f"),
                     ("hetu/best", ">9.2f"), ("best", ">7"), ("sim_err", ">7.2f"), ("overruns", ">8"),
                     tail="detected (true)")
    header = table.header()
    lines, rows = [], []
    for index, (name, slow) in enumerate(scenarios):
        cluster = Cluster(world_size=WORLD, gpus_per_node=GPUS_PER_NODE, gpu_memory_bytes=2**34, slowdowns=slow)
        planned = plan_for(cluster)
        path = tmp / f"{name}.yaml"
        path.write_text(dump_plan(planned.plan))
        drop = best_uniform(cluster, spec, micro_batch=MBS, num_microbatches=microbatches, cost=cost,
                            tp_degrees=(1,))
        drop_n = len(drop["ranks"])
        systems = {
            "uniform": (["--hetu-runtime", "megatron", "--hetu-straggler-interval", "1"] + emulation(slow), WORLD),
            "drop": (["--hetu-runtime", "megatron", "--pipeline-model-parallel-size", str(drop["pp"])]
                     + emulation(drop["slowdowns"]), drop_n),
            "hetu": (["--hetu-plan", str(path)] + emulation(slow), WORLD),
        }
        measured: dict[str, list[float]] = {k: [] for k in systems}
        over = 0
        detected: dict[str, float] = {}
        for rep in range(args.repeats):
            names = list(systems)
            shift = (index + rep) % len(names)
            for system in names[shift:] + names[:shift]:
                extra, world = systems[system]
                records, _ = run(extra, world)
                measured[system].append(seconds(records))
                over += overruns(records)
                if system == "uniform":
                    last = [r for r in records if r.get("slowdowns")]
                    if last:
                        detected = {str(r): round(last[-1]["slowdowns"][str(r)], 2) for r in sorted(slow)}
        uniform_s, drop_s, hetu_s = (statistics.median(measured[k]) for k in ("uniform", "drop", "hetu"))
        ideal_s = fixed_s + emulated_healthy_s * WORLD / sum(1.0 / slow.get(r, 1.0) for r in range(WORLD))
        best_name, best_s = min((("uniform", uniform_s), ("drop", drop_s)), key=lambda x: x[1])
        # the cost model predicts compute; the step's fixed part is what the healthy run measured beyond its prediction
        predicted_s = (plan_step_s(planned.plan, cluster, spec, micro_batch=MBS, cost=cost)
                       + (healthy_s - predicted_healthy))
        layout = f"pp{drop['pp']} dp{drop['dp']} on {drop_n}" + (f" (-{','.join(map(str, drop['dropped']))})"
                                                                 if drop["dropped"] else "")
        row = {"name": name, "slowdowns": {str(r): x for r, x in sorted(slow.items())},
               "uniform_tokens_per_s": round(tokens / uniform_s), "drop_tokens_per_s": round(tokens / drop_s),
               "drop_layout": {"tp": 1, "pp": drop["pp"], "dp": drop["dp"], "ranks": drop_n,
                               "dropped": drop["dropped"]},
               "hetu_tokens_per_s": round(tokens / hetu_s), "ideal_tokens_per_s": round(tokens / ideal_s),
               "hetu_over_best_baseline": round(best_s / hetu_s, 3), "best_baseline": best_name,
               "hetu_over_ideal": round(ideal_s / hetu_s, 3), "detected": detected,
               "sim_error": round(abs(predicted_s - hetu_s) / hetu_s, 3), "emulation_overruns": over}
        rows.append(row)
        shown = ", ".join(f"{r}: x{detected.get(str(r), float('nan')):.2f} ({x:g})" for r, x in sorted(slow.items()))
        line = table.row([name, str(sorted(slow.values())), row["uniform_tokens_per_s"], row["drop_tokens_per_s"],
                          layout, row["hetu_tokens_per_s"], row["ideal_tokens_per_s"], row["hetu_over_ideal"],
                          row["hetu_over_best_baseline"], best_name, row["sim_error"], over], shown)
        lines.append(line)
        print((header + "\n" if index == 0 else "") + line, flush=True)
    print("\n(tokens/s; drop excludes its restart; ideal strict: F + E x 8 / sum 1/x; best = the better of uniform "
          "and drop)")

    records, metrics = run(["--hetu-runtime", "plan", "--hetu-emulate-slowdown", "step=4:rank=1:x=5",
                            "--hetu-straggler-interval", "1", "--hetu-straggler-window", "2",
                            "--hetu-straggler-replan", "online", "--hetu-gpus-per-node", str(GPUS_PER_NODE)])
    detections = read_records(metrics, event="detection")
    migrated = read_records(metrics, event="migration")
    latency = detections[0]["latency_steps"] if detections else None
    at_detection = detections[0]["stragglers"].get("1") if detections else None
    estimates = [r["slowdowns"]["1"] for r in records if r.get("slowdowns") and "1" in r["slowdowns"]]
    last_estimate = estimates[-1] if estimates else None
    migration_s = migrated[0]["seconds"] if migrated else None
    print("\nonline: rank 1 5x slow from step 4: " + (
        f"detected at step {detections[0]['iteration']} ({latency} steps after onset) as x{at_detection:.2f}; last "
        f"estimate x{last_estimate:.2f} (true x5)" if detections else "not detected"))
    print("online: " + (f"migrated after step {migrated[0]['iteration']} in {migration_s:.2f} s, "
                        f"{migrated[0]['bytes_sent'] / 2**20:.2f} MiB sent" if migrated else "no migration")
          + f"; {overruns(records)} emulation overruns")
    print_result({"healthy_tokens_per_s": round(tokens / healthy_s), "scenarios": rows,
                  "online": {"detection_latency_steps": latency, "detected_at_detection": at_detection,
                             "detected_last": last_estimate, "true": 5.0, "migration_seconds": migration_s}})


if __name__ == "__main__":
    main()
