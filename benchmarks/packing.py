"""Hydraulis packing: balance of replicas' predicted times and planning time, per method; real CPU training.

    python -m benchmarks.packing [--pp 1] [--steps 5] [--cost configs/calibration/cpu.yaml] [--real]

Balance (pure, no process group): document lengths from ../shared/data/seqlens/wikipedia.txt.gz in a seeded
random order (as a shuffled dataset reads them), documents longer than the max pack length split into pieces of
at most that length (hetu_ext.data.lengths.split_long). Global batch g: consecutive pieces within a token budget
of ``replicas x --tokens-per-replica x max_len`` (default 2 packs' worth per replica, so 64 replicas at 4K packs
are a 512K-token global batch). Replicas: Megatron's uniform plan (TP 1, ``--pp`` stages of a 32-layer model)
turned into ReplicaSpecs by hetu_ext.plan.core.replicas.replica_specs; per-layer costs from ``--cost`` (default: the
built-in A100 FLOP model of hetu_ext.data.cost, 4096-wide layer). Methods: ``megatron`` (the same tokens
concatenated and cut every max_len, per-document attention, packs dealt in order), ``ffd``, ``greedy`` (DeepSpeed
style, by tokens), ``hetu`` (two-stage). For each (max_len, replicas, method), over ``--steps`` global batches:
median of max/mean of the replicas' predicted times, of the certified gap to the lower bound, and of the planning
time of one ``assign`` call (bound and invariant checks included).

``--lognormal SIGMA`` replaces the file by lognormal lengths (sigma 2: heavy-tailed, many full-length pieces).

Real (``--real``): see :func:`real_rows`. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from benchmarks.common import ROOT, Table, print_result
from hetu_ext.data.cost import CostTable, load_cost_table
from hetu_ext.data.lengths import LognormalLengths, batch_bounds, concat_split, read_lengths, split_long
from hetu_ext.data.packing import METHODS, assign
from hetu_ext.plan.core.replicas import replica_specs
from hetu_ext.model.spec import ModelSpec
from hetu_ext.plan.core.plan import uniform_plan

NUM_LAYERS = 32


def balance_rows(args: argparse.Namespace, log: Callable[[str], None] = print) -> list[dict]:
    """One row per (max_len, replicas, method): medians over ``args.steps`` global batches; prints a table."""
    if args.lognormal:  # a heavy-tailed batch: many documents longer than the pack, cut into full-length pieces
        lengths = LognormalLengths(min_seq_len=8, max_seq_len=500_000, mean_seq_len=3000,
                                   lognormal_sigma=args.lognormal).sample(200_000, seed=args.seed)
    else:
        lengths = read_lengths(args.lengths)
    lengths = lengths[np.random.default_rng(args.seed).permutation(lengths.size)]
    cost = load_cost_table(args.cost) if args.cost else CostTable()
    rows = []
    balance = Table.of(("max_len", ">7"), ("replicas", ">8"), ("tokens/batch", ">12"), ("docs", ">6.0f"),
                       ("method", "<8"), ("max/mean", ">8.3f"), ("gap", ">7.3f"), ("gap_max", ">7.3f"),
                       ("plan_ms", ">8.1f"))
    log(balance.header())
    for max_len in args.max_lens:
        pieces = split_long(lengths, max_len).length
        model = ModelSpec(num_layers=NUM_LAYERS, hidden_size=64, num_attention_heads=4, seq_length=max_len)
        for replicas in args.replicas:
            plan = uniform_plan(world_size=replicas * args.pp, pp=args.pp, num_layers=NUM_LAYERS)
            specs = replica_specs(plan, model, cost, max_pack_tokens=max_len)
            budget = replicas * args.tokens_per_replica * max_len
            bounds = batch_bounds(pieces, tokens=budget)
            batches = [pieces[bounds[g]:bounds[g + 1]] for g in range(min(args.steps, bounds.size - 2))]
            for method in args.methods:
                stats = []
                for batch in batches:
                    docs = concat_split(batch, max_len).length if method == "megatron" else batch
                    start = time.perf_counter()
                    a = assign(docs.tolist(), specs, method=method)
                    stats.append((a.max_over_mean, a.gap, (time.perf_counter() - start) * 1e3))
                mm, gap, ms = (statistics.median(x) for x in zip(*stats))
                worst = max(s[1] for s in stats)
                docs_per = statistics.median(b.size for b in batches)
                log(balance.row([max_len, replicas, budget, docs_per, method, mm, gap, worst, ms]))
                rows.append({"max_len": max_len, "replicas": replicas, "method": method,
                             "max_over_mean": round(mm, 4), "gap_to_bound": round(gap, 4), "plan_ms": round(ms, 2)})
    return rows


def real_rows(args: argparse.Namespace) -> list[dict]:
    """Real CPU training with 2 ranks (DP 2, then PP 2): tokens/s per packing method (benchmarks/packing_real.py);
    [] unless ``--real``."""
    if not args.real:
        return []
    from benchmarks import packing_real

    return packing_real.real_rows(argparse.Namespace(
        max_len=args.real_max_len, batch_tokens=args.real_batch_tokens, steps=args.real_steps,
        rounds=args.real_rounds, lengths=Path(args.lengths)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default=str(ROOT.parent / "shared/data/seqlens/wikipedia.txt.gz"))
    parser.add_argument("--lognormal", type=float, default=None, metavar="SIGMA",
                        help="instead of --lengths: 200,000 lognormal lengths (mean 3000, this sigma; 2.0 is heavy-"
                        "tailed: many documents cut into full-length pieces)")
    parser.add_argument("--max-lens", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 16384, 65536])
    parser.add_argument("--replicas", type=lambda s: [int(x) for x in s.split(",")], default=[8, 64, 512])
    parser.add_argument("--methods", type=lambda s: s.split(","), default=list(METHODS))
    parser.add_argument("--tokens-per-replica", type=int, default=2, help="global batch tokens per replica, in "
                        "units of max_len")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages per replica (32 layers split evenly)")
    parser.add_argument("--steps", type=int, default=5, help="global batches per configuration")
    parser.add_argument("--cost", default=None, help="cost table YAML (default: built-in A100 FLOP model)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--real", action="store_true", help="also train for real on CPU (2 ranks)")
    parser.add_argument("--real-max-len", type=int, default=4096)
    parser.add_argument("--real-batch-tokens", type=int, default=32768)
    parser.add_argument("--real-steps", type=int, default=6)
    parser.add_argument("--real-rounds", type=int, default=2)
    args = parser.parse_args()
    import scipy

    cost = args.cost or "built-in A100 FLOP model (hetu_ext.data.cost)"
    print(f"# date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()}, {os.cpu_count()} "
          f"CPUs, Python {platform.python_version()}, numpy {np.__version__}, scipy {scipy.__version__}")
    source = f"lognormal(mean 3000, sigma {args.lognormal})" if args.lognormal else args.lengths
    print(f"config: lengths {source} (seed {args.seed} order), max_len {args.max_lens}, replicas "
          f"{args.replicas}, global batch = replicas x {args.tokens_per_replica} x max_len tokens, uniform plan "
          f"TP 1 x PP {args.pp}, {NUM_LAYERS} layers, cost {cost}, {args.steps} steps per row (medians; gap_max = "
          "worst step)")
    rows = balance_rows(args)
    real = real_rows(args)
    print_result({"balance": rows, "real": real})


if __name__ == "__main__":
    main()
