"""Stragglers on 8 emulated CPU ranks: Megatron's uniform plan vs the Malleus plan vs the ideal.

    python benchmarks/straggler.py [--iters 12]

8 ranks as 2 emulated nodes of 4, a tiny GPT (6 layers, hidden 64, 4 heads, sequence 64, micro batch 1, 32
microbatches per step). Every layer has an emulated device time (--hetu-emulate-layer-ms 16: 16 ms forward, 32 ms
backward per microbatch, x the rank's slowdown), so 8 ranks sharing 2 cores keep the pace of an 8-GPU cluster
instead of speeding up whenever a straggler sleeps. Slowdown sets from Malleus's experiments mapped onto 8
ranks, plus one node at 2x. For each set, emulated from step 1 (--hetu-emulate-slowdown):

* uniform: Megatron's own data-parallel plan (TP 1, PP 1, DP 8);
* hetu_ext: the plan ``plan_malleus`` makes for the true slowdowns (TP 1 only: on gloo over 2 shared cores a
  TP group costs more than it gains), run on the plan runtime;
* ideal: healthy tokens/s x sum over ranks of 1/x_r / 8, with healthy tokens/s measured in the same run of the
  script without stragglers.

Step time is the median over the steps after the first two. ``sim_error`` compares the simulator's prediction
for the hetu_ext plan with its measured step time: the cost model, calibrated to the emulated layer time, gives
the compute; the fixed per-step part is taken from the healthy run (measured minus predicted).

A last run starts on the uniform plan with rank 1 turning 5x slow at step 4 and re-plans online: it prints the
detection latency (steps from onset to the new plan) and the migration time. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

SCENARIOS = [
    ("one_5x", {1: 5.0}),
    ("2x_3x", {1: 2.0, 5: 3.0}),
    ("mixed_4", {1: 1.5, 2: 1.1, 5: 1.2, 6: 5.0}),
    ("three_slow", {1: 4.79, 4: 2.34, 6: 3.8}),
    ("two_12x", {2: 12.53, 3: 12.53, 5: 2.57}),
    ("node_2x", {4: 2.0, 5: 2.0, 6: 2.0, 7: 2.0}),
]
WORLD, GPUS_PER_NODE, MBS, MICROBATCHES, SEQ = 8, 4, 1, 32, 64
LAYER_MS = 16.0
MODEL = ["--num-layers", "6", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", str(SEQ),
         "--micro-batch-size", str(MBS), "--global-batch-size", str(MBS * MICROBATCHES), "--lr", "1e-3",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1",
         "--hetu-emulate-layer-ms", str(LAYER_MS), "--hetu-straggler-interval", "1000"]


def step_seconds(metrics: Path) -> float:
    """The median step time of a run's metrics records, after the first two steps."""
    from hetu_ext.metrics import read_records

    return statistics.median(r["step_ms"] / 1e3 for r in read_records(metrics, kind="step")[2:])


def emulation(slowdowns: dict[int, float]) -> list[str]:
    if not slowdowns:
        return []
    return ["--hetu-emulate-slowdown", ",".join(f"step=1:rank={r}:x={x}" for r, x in sorted(slowdowns.items()))]


def main() -> None:
    from hetu_ext.megatron.preprocess_data import preprocess
    from hetu_ext.plan import ModelSpec, dump_plan
    from hetu_ext.plan.cluster import Cluster
    from hetu_ext.plan.cost import CostModel, layer_forward_flops
    from hetu_ext.plan.malleus import plan_malleus, predict
    from hetu_ext.testing.multiproc import run_ranks
    from hetu_ext.testing.runs import train

    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=12)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="hetu_straggler_"))
    prefix, _ = preprocess(str(ROOT / "hetu_ext/data/samples/python_reference.jsonl"), str(tmp / "pyref"))
    data = ["--data-path", prefix, "--split", "100,0,0", "--train-iters", str(args.iters)]
    spec = ModelSpec(num_layers=6, hidden_size=64, num_attention_heads=4, vocab_size=257, seq_length=SEQ)
    cost = CostModel(flops_per_s=layer_forward_flops(spec, MBS) / (LAYER_MS / 1e3))  # the emulated device
    tokens = MBS * MICROBATCHES * SEQ

    counter = itertools.count()

    def run_metrics(extra: list[str]) -> Path:
        """Train with ``extra`` flags; the run's metrics file."""
        metrics = tmp / f"run{next(counter)}.jsonl"
        run_ranks(train, WORLD, MODEL + data + extra + ["--hetu-metrics-file", str(metrics)], False, timeout=900)
        return metrics

    def run(extra: list[str]) -> float:
        return step_seconds(run_metrics(extra))

    def plan_for(cluster):
        return plan_malleus(cluster, spec, micro_batch=MBS, num_microbatches=MICROBATCHES, cost=cost,
                            tp_degrees=(1,))

    print(f"config: {WORLD} CPU ranks as {WORLD // GPUS_PER_NODE} nodes of {GPUS_PER_NODE}, {' '.join(MODEL)}, "
          f"--train-iters {args.iters}")
    healthy_s = run(["--hetu-runtime", "megatron"])
    healthy = Cluster(world_size=WORLD, gpus_per_node=GPUS_PER_NODE, gpu_memory_bytes=2**34)
    predicted_healthy = predict(plan_for(healthy).plan, healthy, spec, micro_batch=MBS, cost=cost)
    print(f"healthy uniform: {healthy_s * 1e3:.0f} ms/step, {tokens / healthy_s:.0f} tokens/s\n")
    print(f"{'scenario':<12} {'slowdowns':<28} {'uniform':>9} {'hetu':>9} {'ideal':>9} {'hetu/ideal':>10} "
          f"{'hetu/unif':>9} {'sim_err':>8}")
    rows = []
    for name, slow in SCENARIOS:
        cluster = Cluster(world_size=WORLD, gpus_per_node=GPUS_PER_NODE, gpu_memory_bytes=2**34, slowdowns=slow)
        planned = plan_for(cluster)
        path = tmp / f"{name}.yaml"
        path.write_text(dump_plan(planned.plan))
        uniform_s = run(["--hetu-runtime", "megatron"] + emulation(slow))
        hetu_s = run(["--hetu-plan", str(path)] + emulation(slow))
        ideal = tokens / healthy_s * sum(1.0 / slow.get(r, 1.0) for r in range(WORLD)) / WORLD
        # the cost model predicts compute; the step's fixed part (optimizer, gradient all-reduce of this tiny model,
        # data, Python) is what the healthy run measured beyond its prediction
        predicted_s = predict(planned.plan, cluster, spec, micro_batch=MBS, cost=cost) + (healthy_s - predicted_healthy)
        row = {"name": name, "slowdowns": sorted(slow.values()), "uniform_tokens_per_s": round(tokens / uniform_s),
               "hetu_tokens_per_s": round(tokens / hetu_s), "ideal_tokens_per_s": round(ideal),
               "sim_error": round(abs(predicted_s - hetu_s) / hetu_s, 3)}
        rows.append(row)
        print(f"{name:<12} {str(row['slowdowns']):<28} {row['uniform_tokens_per_s']:>9} "
              f"{row['hetu_tokens_per_s']:>9} {row['ideal_tokens_per_s']:>9} "
              f"{row['hetu_tokens_per_s'] / ideal:>10.2f} {uniform_s / hetu_s:>9.2f} {row['sim_error']:>8.2f}")
    from hetu_ext.metrics import read_records

    metrics = run_metrics(["--hetu-runtime", "plan", "--hetu-emulate-slowdown", "step=4:rank=1:x=5",
                           "--hetu-straggler-interval", "1", "--hetu-straggler-window", "2",
                           "--hetu-straggler-replan", "online", "--hetu-gpus-per-node", str(GPUS_PER_NODE)])
    detected = read_records(metrics, event="detection")
    migrated = read_records(metrics, event="migration")
    latency = detected[0]["latency_steps"] if detected else None
    seconds = migrated[0]["seconds"] if migrated else None
    print("\nonline: rank 1 5x slow from step 4: " + (
        f"detected at step {detected[0]['iteration']} ({latency} steps after onset), slowdowns "
        f"{detected[0]['stragglers']}" if detected else "not detected"))
    print("online: " + (f"migrated after step {migrated[0]['iteration']} in {seconds:.2f} s, "
                        f"{migrated[0]['bytes_sent'] / 2**20:.2f} MiB sent" if migrated else "no migration"))
    print(json.dumps({"scenarios": rows, "online": {"detection_latency_steps": latency,
                                                    "migration_seconds": seconds}}))


if __name__ == "__main__":
    main()
