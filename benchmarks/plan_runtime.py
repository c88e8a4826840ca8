"""Plan runtime vs Megatron's uniform path (step time), and gradient bytes per rank under heterogeneous plans.

    python -m benchmarks.plan_runtime [--reps 3] [--iters 8]

Part 1 (acceptance: within 10%): the same uniform TP2 x DP2 job on 4 CPU ranks, once through Megatron's
parallel_state path and once as a Plan through the plan runtime, interleaved (M, P, M, P, ...) so that machine
noise hits both alike; the step time of a run is the median of its per-iteration times after the first
iteration; the table shows each repetition and the ratio of medians.

Part 2 (acceptance: minimum gradient bytes): for each heterogeneous plan of the gold test, the bytes each rank
hands to all-reduces in one step (measured in GradSync, counted as a ring moves them, 2 (n-1)/n per byte) beside
the minimum for the plan: every element reduced once per lane over exactly the ranks that hold it
(plan/core/layout.py's ReductionLayout.send_bytes), and beside what a plain all-reduce of each rank's whole gradient
over all ranks holding any of its tensors would send.

Part 3 (acceptance: the sharded optimizer within 10% of Megatron's): the same uniform TP2 x DP2 job with
--use-distributed-optimizer, Megatron's DistributedOptimizer on its uniform runtime against the plan runtime's
sharded optimizer, interleaved as in part 1. Part 2 also runs every plan with the flag: the bytes each rank hands
to the reduce-scatter of gradients and the all-gather of weights (fp32) in one step, beside the minimum for
reduce-scatter + all-gather over each holder set (plan/core/optimizer_shards.py's exchange_bytes: (n-1) x ceil(B/n)
per collective with a ring).

    python -m benchmarks.plan_runtime --parts 2,3   # a subset

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from benchmarks.common import ROOT, Table, print_result

MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "128",
         "--micro-batch-size", "4", "--global-batch-size", "16", "--lr", "1e-3", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--log-interval", "1"]


def step_ms(metrics: Path) -> float:
    """The median step time of a run's metrics records, after the first step."""
    from hetu_ext.metrics import read_records

    return statistics.median(r["step_ms"] for r in read_records(metrics, kind="step")[1:])


def grad_bytes(rank: int, world: int, argv: list[str]):
    from hetu_ext.cli.args import parse_run_config
    from hetu_ext.train.trainer import build_trainer

    trainer = build_trainer(parse_run_config(argv))
    trainer.train(log=lambda line: None)
    sync = trainer.placement.grad_sync
    if sync is None:
        return None
    if hasattr(sync, "shards"):  # the sharded optimizer (runtime/sharded_optimizer.py)
        return {"rank": rank, "sharded": sync.bytes_sent, "sharded_minimum": sync.shards.exchange_bytes(rank, 4, 4)}
    local = sum(t.param.numel() * 4 for t in sync.local.values())
    peers = {r for lane in sync.layout.lanes_of(rank) for r in lane[0]}
    naive = round(2 * (len(peers) - 1) / len(peers) * local) if peers else 0
    return {"rank": rank, "measured": sync.bytes_sent, "minimum": sync.layout.send_bytes(rank), "naive": naive}


def main() -> None:
    from hetu_ext.megatron.preprocess_data import preprocess
    from hetu_ext.testing.multiproc import run_ranks
    from hetu_ext.testing.plans import PLANS
    from hetu_ext.cli.runs import train

    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--parts", default="1,2,3", help="which parts to run, e.g. 2,3")
    args = parser.parse_args()
    parts = {int(p) for p in args.parts.split(",")}
    tmp = Path(tempfile.mkdtemp(prefix="hetu_bench_"))
    prefix, _ = preprocess(str(ROOT / "hetu_ext/data/samples/python_reference.jsonl"), str(tmp / "pyref"))
    data = ["--data-path", prefix, "--split", "100,0,0", "--train-iters", str(args.iters)]
    print(f"config: 4 CPU ranks, TP2 x DP2, {' '.join(MODEL)} --train-iters {args.iters}, reps {args.reps}")
    out: dict = {"benchmark": "plan_runtime"}

    def interleaved(title: str, extra: list[str], key: str) -> None:
        print(f"\n{title} (median ms per iteration)")
        reps = Table.of(("rep", ">4"), ("megatron", ">10.1f"), ("plan", ">10.1f"), ("ratio", ">7.3f"))
        reps.print_header()
        megatron, plan = [], []
        for rep in range(args.reps):
            base = MODEL + ["--tensor-model-parallel-size", "2"] + data + extra
            for runtime, times in (("megatron", megatron), ("plan", plan)):
                metrics = tmp / f"{key}_{runtime}{rep}.jsonl"
                run_ranks(train, 4, base + ["--hetu-runtime", runtime, "--hetu-metrics-file", str(metrics)], False,
                          timeout=600)
                times.append(step_ms(metrics))
            reps.print_row([rep, megatron[-1], plan[-1], plan[-1] / megatron[-1]])
        ratio = statistics.median(plan) / statistics.median(megatron)
        reps.print_row(["med", statistics.median(megatron), statistics.median(plan), ratio])
        out.update({f"{key}_step_ms_megatron": statistics.median(megatron),
                    f"{key}_step_ms_plan": statistics.median(plan), f"{key}_plan_over_megatron": round(ratio, 4),
                    f"{key}_within_10_percent": ratio <= 1.10})

    if 1 in parts:
        interleaved("1) uniform TP2 x DP2: Megatron's path vs the plan runtime", [], "uniform")
    if 2 in parts:
        print("\n2) bytes sent per rank per step (fp32), heterogeneous plans: gradient all-reduces (replicated "
              "optimizer), and with --use-distributed-optimizer gradient reduce-scatter + weight all-gather")
        sent = Table.of(("plan", "<30"), ("rank", ">4"), ("measured", ">10"), ("minimum", ">10"), ("naive", ">10"),
                        ("sharded", ">10"), ("sh. min", ">10"))
        sent.print_header()
        all_minimal = sharded_minimal = True
        rows = []
        for name, world, _, text in PLANS:
            path = tmp / f"{name}.yaml"
            path.write_text(text)
            argv = MODEL + ["--hetu-plan", str(path)] + data[:4] + ["--train-iters", "1"]
            plain = {r["rank"]: r for r in filter(None, run_ranks(grad_bytes, world, argv, timeout=600))}
            sharded = {r["rank"]: r for r in filter(None, run_ranks(
                grad_bytes, world, argv + ["--use-distributed-optimizer"], timeout=600))}
            for rank, row in sorted(plain.items()):
                row = {**row, **sharded[rank]}
                all_minimal &= row["measured"] == row["minimum"]
                sharded_minimal &= row["sharded"] == row["sharded_minimum"]
                rows.append({"plan": name, **row})
                sent.print_row([name, rank] + [row[k] for k in ("measured", "minimum", "naive", "sharded",
                                                                 "sharded_minimum")])
        out.update({"grad_bytes_all_minimal": all_minimal, "sharded_bytes_all_minimal": sharded_minimal,
                    "grad_bytes": rows})
    if 3 in parts:
        interleaved("3) uniform TP2 x DP2 with --use-distributed-optimizer: Megatron's DistributedOptimizer vs the "
                    "plan runtime's sharded optimizer", ["--use-distributed-optimizer"], "distopt")
    print_result(out)


if __name__ == "__main__":
    main()
