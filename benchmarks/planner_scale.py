"""Malleus planner: planning time and predicted speed-up over Megatron's uniform plan, 64 to 4096 GPUs.

    python benchmarks/planner_scale.py [--seed 0]

A GPT of 32 layers, hidden 4096, 32 heads, sequence 4096, micro batch 1, 4 microbatches per GPU of global batch;
nodes of 8 GPUs with 80 GiB. Stragglers: 1% and 5% of the GPUs, slowdowns drawn from Malleus's experiments
{1.5, 2, 3, 5, 12.5}. Uniform baseline: TP 8, PP 4, DP = GPUs / 32 (Megatron-LM's usual layout for this size),
its step time predicted by the same cost model (a straggler slows its stage, so its whole step). Planning time is
the median of 3 runs of the pure planner (no process group). Targets: <= 0.1 s at 64 GPUs, <= 1 s at 1024.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from hetu_ext.plan.cluster import Cluster
from hetu_ext.plan.malleus import plan_malleus, predict_uniform
from hetu_ext.plan.model_spec import ModelSpec

SPEC = ModelSpec(num_layers=32, hidden_size=4096, num_attention_heads=32, vocab_size=50257, seq_length=4096)
SLOWDOWNS = (1.5, 2.0, 3.0, 5.0, 12.5)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    print(f"config: {SPEC}, micro batch 1, 4 microbatches per GPU, 8 GPUs x 80 GiB per node, seed {args.seed}")
    print(f"{'gpus':>6} {'stragglers':>10} {'plan_s':>8} {'template':<34} {'uniform_s':>10} {'hetu_s':>9} "
          f"{'speedup':>8}")
    results = []
    for gpus in (64, 256, 1024, 4096):
        for share in (0.01, 0.05):
            count = max(1, round(gpus * share))
            slow = {r: rng.choice(SLOWDOWNS) for r in rng.sample(range(gpus), count)}
            cluster = Cluster(world_size=gpus, gpus_per_node=8, gpu_memory_bytes=80 * 2**30, slowdowns=slow)
            microbatches = 4 * gpus
            times = []
            for _ in range(3):
                start = time.perf_counter()
                planned = plan_malleus(cluster, SPEC, micro_batch=1, num_microbatches=microbatches)
                times.append(time.perf_counter() - start)
            uniform = predict_uniform(cluster, SPEC, tp=8, pp=4, micro_batch=1, num_microbatches=microbatches)
            speedup = uniform / planned.predicted_step_s
            seconds = statistics.median(times)
            print(f"{gpus:>6} {count:>10} {seconds:>8.3f} {planned.template:<34} {uniform:>10.2f} "
                  f"{planned.predicted_step_s:>9.2f} {speedup:>8.2f}")
            results.append({"gpus": gpus, "stragglers": count, "plan_seconds": round(seconds, 4),
                            "predicted_speedup": round(speedup, 3)})
    print(json.dumps({"results": results}))


if __name__ == "__main__":
    main()
