"""Stragglers on 8 emulated CPU ranks: Megatron's uniform plan vs the Malleus plan vs the ideal.

    python benchmarks/straggler.py [--iters 12]

8 ranks as 2 emulated nodes of 4, a tiny GPT (8 layers, hidden 64, 4 heads, sequence 64, micro batch 1, 32
microbatches per step). Slowdown sets from Malleus's experiments mapped onto 8 ranks, plus one node at 2x.
For each set, emulated from step 1 (--hetu-emulate-slowdown):

* uniform: Megatron's own data-parallel plan (TP 1, PP 1, DP 8);
* hetu_ext: the plan ``plan_malleus`` makes for the true slowdowns (TP 1 only: on gloo over 2 shared cores a
  TP group costs more than it gains), run on the plan runtime;
* ideal: healthy tokens/s x sum over ranks of 1/x_r / 8, with healthy tokens/s measured in the same run of the
  script without stragglers.

Step time is the median over the steps after the first two. ``sim_error`` compares the simulator's prediction
for the hetu_ext plan (the cost model's step time, scaled by the measured healthy step time over the predicted
healthy one) with the measured step time. Caveat: 8 ranks share 2 cores, so an emulated straggler's sleep frees
CPU for the others and no plan is ever "healthy" in the way separate GPUs are; the table is what this machine
measures. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import re
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
MODEL = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", str(SEQ),
         "--micro-batch-size", str(MBS), "--global-batch-size", str(MBS * MICROBATCHES), "--lr", "1e-3",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1"]


def step_seconds(lines: list[str]) -> float:
    times = [float(m) / 1e3 for line in lines for m in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)",
                                                                      line)]
    return statistics.median(times[2:])


def emulation(slowdowns: dict[int, float]) -> list[str]:
    if not slowdowns:
        return []
    schedule = ",".join(f"step=1:rank={r}:x={x}" for r, x in sorted(slowdowns.items()))
    return ["--hetu-emulate-slowdown", schedule, "--hetu-straggler-interval", "1000"]


def main() -> None:
    from hetu_ext.megatron.preprocess_data import preprocess
    from hetu_ext.plan import ModelSpec, dump_plan
    from hetu_ext.plan.cluster import Cluster
    from hetu_ext.plan.malleus import plan_malleus, predict
    from hetu_ext.testing.multiproc import run_ranks
    from hetu_ext.testing.runs import train

    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=12)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="hetu_straggler_"))
    prefix, _ = preprocess(str(ROOT / "hetu_ext/data/samples/python_reference.jsonl"), str(tmp / "pyref"))
    data = ["--data-path", prefix, "--split", "100,0,0", "--train-iters", str(args.iters)]
    spec = ModelSpec(num_layers=8, hidden_size=64, num_attention_heads=4, vocab_size=257, seq_length=SEQ)
    tokens = MBS * MICROBATCHES * SEQ

    def run(extra: list[str]) -> float:
        result = next(r for r in run_ranks(train, WORLD, MODEL + data + extra, False, timeout=900) if r)
        return step_seconds(result["log_lines"])

    print(f"config: {WORLD} CPU ranks as {WORLD // GPUS_PER_NODE} nodes of {GPUS_PER_NODE}, {' '.join(MODEL)}, "
          f"--train-iters {args.iters}")
    healthy_s = run(["--hetu-runtime", "megatron"])
    healthy = Cluster(world_size=WORLD, gpus_per_node=GPUS_PER_NODE, gpu_memory_bytes=2**34)
    predicted_healthy = predict(plan_malleus(healthy, spec, micro_batch=MBS, num_microbatches=MICROBATCHES,
                                             tp_degrees=(1,)).plan, healthy, spec, micro_batch=MBS)
    print(f"healthy uniform: {healthy_s * 1e3:.0f} ms/step, {tokens / healthy_s:.0f} tokens/s\n")
    print(f"{'scenario':<12} {'slowdowns':<28} {'uniform':>9} {'hetu':>9} {'ideal':>9} {'hetu/ideal':>10} "
          f"{'hetu/unif':>9} {'sim_err':>8}")
    rows = []
    for name, slow in SCENARIOS:
        cluster = Cluster(world_size=WORLD, gpus_per_node=GPUS_PER_NODE, gpu_memory_bytes=2**34, slowdowns=slow)
        planned = plan_malleus(cluster, spec, micro_batch=MBS, num_microbatches=MICROBATCHES, tp_degrees=(1,))
        path = tmp / f"{name}.yaml"
        path.write_text(dump_plan(planned.plan))
        uniform_s = run(["--hetu-runtime", "megatron"] + emulation(slow))
        hetu_s = run(["--hetu-plan", str(path)] + emulation(slow))
        ideal = tokens / healthy_s * sum(1.0 / slow.get(r, 1.0) for r in range(WORLD)) / WORLD
        predicted_s = predict(planned.plan, cluster, spec, micro_batch=MBS) / predicted_healthy * healthy_s
        row = {"name": name, "slowdowns": sorted(slow.values()), "uniform_tokens_per_s": round(tokens / uniform_s),
               "hetu_tokens_per_s": round(tokens / hetu_s), "ideal_tokens_per_s": round(ideal),
               "sim_error": round(abs(predicted_s - hetu_s) / hetu_s, 3)}
        rows.append(row)
        print(f"{name:<12} {str(row['slowdowns']):<28} {row['uniform_tokens_per_s']:>9} "
              f"{row['hetu_tokens_per_s']:>9} {row['ideal_tokens_per_s']:>9} "
              f"{row['hetu_tokens_per_s'] / ideal:>10.2f} {uniform_s / hetu_s:>9.2f} {row['sim_error']:>8.2f}")
    print(json.dumps({"scenarios": rows}))


if __name__ == "__main__":
    main()
