"""Plan runtime vs Megatron's uniform path (step time), and gradient bytes per rank under heterogeneous plans.

    python benchmarks/plan_runtime.py [--reps 3] [--iters 8]

Part 1 (acceptance: within 10%): the same uniform TP2 x DP2 job on 4 CPU ranks, once through Megatron's
parallel_state path and once as a Plan through the plan runtime, interleaved (M, P, M, P, ...) so that machine
noise hits both alike; the step time of a run is the median of its per-iteration times after the first
iteration; the table shows each repetition and the ratio of medians.

Part 2 (acceptance: minimum gradient bytes): for each heterogeneous plan of the gold test, the bytes each rank
hands to all-reduces in one step (measured in GradSync, counted as a ring moves them, 2 (n-1)/n per byte) beside
the minimum for the plan: every element reduced once per lane over exactly the ranks that hold it
(plan/layout.py's ReductionLayout.send_bytes), and beside what a plain all-reduce of each rank's whole gradient
over all ranks holding any of its tensors would send.

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "128",
         "--micro-batch-size", "4", "--global-batch-size", "16", "--lr", "1e-3", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--log-interval", "1"]


def step_ms(metrics: Path) -> float:
    """The median step time of a run's metrics records, after the first step."""
    from hetu_ext.metrics import read_records

    return statistics.median(r["step_ms"] for r in read_records(metrics, kind="step")[1:])


def grad_bytes(rank: int, world: int, argv: list[str]):
    from hetu_ext.megatron.args import parse_run_config
    from hetu_ext.megatron.trainer import build_trainer

    trainer = build_trainer(parse_run_config(argv))
    trainer.train(log=lambda line: None)
    sync = trainer.placement.grad_sync
    if sync is None:
        return None
    local = sum(t.param.numel() * 4 for t in sync.local.values())
    peers = {r for lane in sync.layout.lanes_of(rank) for r in lane[0]}
    naive = round(2 * (len(peers) - 1) / len(peers) * local) if peers else 0
    return {"rank": rank, "measured": sync.bytes_sent, "minimum": sync.layout.send_bytes(rank), "naive": naive}


def main() -> None:
    from test_plan_runtime import PLANS

    from hetu_ext.megatron.preprocess_data import preprocess
    from hetu_ext.testing.multiproc import run_ranks
    from hetu_ext.testing.runs import train

    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--iters", type=int, default=8)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="hetu_bench_"))
    prefix, _ = preprocess(str(ROOT / "hetu_ext/data/samples/python_reference.jsonl"), str(tmp / "pyref"))
    data = ["--data-path", prefix, "--split", "100,0,0", "--train-iters", str(args.iters)]
    print(f"config: 4 CPU ranks, TP2 x DP2, {' '.join(MODEL)} --train-iters {args.iters}, reps {args.reps}")

    print("\n1) uniform TP2 x DP2: Megatron's path vs the plan runtime (median ms per iteration)")
    print(f"{'rep':>4} {'megatron':>10} {'plan':>10} {'ratio':>7}")
    megatron, plan = [], []
    for rep in range(args.reps):
        base = MODEL + ["--tensor-model-parallel-size", "2"] + data
        for runtime, times in (("megatron", megatron), ("plan", plan)):
            metrics = tmp / f"{runtime}{rep}.jsonl"
            run_ranks(train, 4, base + ["--hetu-runtime", runtime, "--hetu-metrics-file", str(metrics)], False,
                      timeout=600)
            times.append(step_ms(metrics))
        print(f"{rep:>4} {megatron[-1]:>10.1f} {plan[-1]:>10.1f} {plan[-1] / megatron[-1]:>7.3f}")
    ratio = statistics.median(plan) / statistics.median(megatron)
    print(f"{'med':>4} {statistics.median(megatron):>10.1f} {statistics.median(plan):>10.1f} {ratio:>7.3f}")

    print("\n2) gradient bytes sent per rank per step (fp32), heterogeneous plans")
    print(f"{'plan':<30} {'rank':>4} {'measured':>10} {'minimum':>10} {'naive':>10}")
    all_minimal = True
    rows = []
    for name, world, _, text in PLANS:
        path = tmp / f"{name}.yaml"
        path.write_text(text)
        argv = MODEL + ["--hetu-plan", str(path)] + data[:4] + ["--train-iters", "1"]
        for row in filter(None, run_ranks(grad_bytes, world, argv, timeout=600)):
            all_minimal &= row["measured"] == row["minimum"]
            rows.append({"plan": name, **row})
            print(f"{name:<30} {row['rank']:>4} {row['measured']:>10} {row['minimum']:>10} {row['naive']:>10}")
    print(json.dumps({"benchmark": "plan_runtime", "uniform_step_ms_megatron": statistics.median(megatron),
                      "uniform_step_ms_plan": statistics.median(plan), "plan_over_megatron": round(ratio, 4),
                      "within_10_percent": ratio <= 1.10, "grad_bytes_all_minimal": all_minimal,
                      "grad_bytes": rows}))


if __name__ == "__main__":
    main()
