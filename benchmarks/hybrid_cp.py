"""Baselines with context parallelism for the packer benchmarks: the best static strategy with CP in its space, and
Megatron-core's hybrid CP, beside the best static strategy without CP (issue 48, part 3).

    python -m benchmarks.hybrid_cp [--lengths FILE] [--gpus 8,16,32] [--max-lens 16384,32768]

The setting is ``benchmarks/hotspa.py``'s (7B shape, the same batches: ``sample_batches(..., seed=gpus)``, the same
FLOP cost tables per option, all-reduce at ``--bandwidth``), so ``static_s`` here equals its ``static_s`` and its
``hotspa_s`` can be set against the stronger baseline. Per row:

* ``static_s``: the best uniform TP x PP x DP (HotSPa ``auto``'s space without CP), mean step over the batches,
  gradient all-reduce included;
* ``static_cp_s``: the same with TP x CP x DP shapes in the space (``CP_DEGREES``);
* ``hybrid_s``: Megatron's ``--hybrid-context-parallel``: every TP degree of the cost table and
  ``--max-seqlen-per-dp-cp-rank`` N from the TP degree's memory capacity down by halves (the best kept, as a user
  would tune it); the groups are formed by Megatron-core's own ``BalancedCPScheduler`` (imported from the venv)
  and priced by :mod:`hetu_ext.plan.cost.hybrid_cp`; plus the all-reduce over the TP degree's DP x CP replicas.

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.common import Table, print_result
from benchmarks.hotspa import RECOMPUTE_SEARCHED, SAMPLE, SEQLENS
from hetu_ext.data.cost import CostTable
from hetu_ext.data.lengths import read_lengths, split_long
from hetu_ext.model.spec import ModelSpec
from hetu_ext.plan.core.options import search_space
from hetu_ext.plan.core.plan import uniform_plan
from hetu_ext.plan.core.replicas import CP_DEGREES, replica_specs
from hetu_ext.plan.cost import hybrid_cp
from hetu_ext.plan.cost.stage import CostModel
from hetu_ext.plan.hotspa import allreduce_seconds, auto_strategies, group_seconds
from hetu_ext.plan.hydraulis import flops_cost_table, sample_batches


class _Group:
    """The one thing BalancedCPScheduler asks of its DP x CP process group: its size."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def best_static(spec: ModelSpec, gpus: int, cost: CostTable, batches: list[list[int]], *, bandwidth: float,
                cp_degrees: tuple[int, ...]) -> tuple[str, float] | None:
    """(name, mean step seconds) of the fastest uniform strategy holding every batch's longest sequence."""
    longest = max(max(b) for b in batches)
    best = None
    for s in auto_strategies(spec, gpus, cost, max_pp=8, cp_degrees=cp_degrees).items:
        if s.max_len < longest:
            continue
        t = statistics.mean(group_seconds(s.plan, spec, cost, b, s.max_len) for b in batches) \
            + allreduce_seconds(s.plan, spec, bandwidth=bandwidth)
        if best is None or t < best[1]:
            best = (s.name, t)
    return best


def best_hybrid(spec: ModelSpec, gpus: int, cost: CostTable, batches: list[list[int]], *,
                bandwidth: float) -> tuple[str, float] | None:
    """(``tpT N=...``, mean step seconds) of Megatron's hybrid CP at its best TP degree and N."""
    from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    longest = max(max(b) for b in batches)
    best = None
    for tp in sorted(cost.per_tp):
        if gpus % tp:
            continue
        ranks = gpus // tp
        try:
            (replica,) = replica_specs(uniform_plan(world_size=tp, tp=tp, num_layers=spec.num_layers), spec, cost,
                                       max_pack_tokens=spec.seq_length)
        except ValueError:
            continue
        capacity = replica.token_capacity
        sync = allreduce_seconds(uniform_plan(world_size=gpus, tp=tp, num_layers=spec.num_layers), spec,
                                 bandwidth=bandwidth)
        n = capacity
        while n >= 512:
            if all(hybrid_cp.fits(x, n, capacity, ranks) for x in (longest,)):
                times = []
                for batch in batches:
                    scheduler = BalancedCPScheduler(max_seq_len_per_rank=n, dp_cp_group=_Group(ranks))
                    groups, ids = scheduler.get_groups_and_subsamples(list(enumerate(batch)), None)
                    times.append(hybrid_cp.step_seconds(list(zip(groups, ids)), cost.for_tp(tp), spec, tp=tp,
                                                        num_layers=spec.num_layers))
                t = statistics.mean(times) + sync
                if best is None or t < best[1]:
                    best = (f"tp{tp} N={n}", t)
            n //= 2
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default=str(SEQLENS if SEQLENS.exists() else SAMPLE))
    parser.add_argument("--batch-tokens", type=int, default=256 * 1024, help="tokens per global batch per 8 GPUs")
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--bandwidth", type=float, default=100.0, help="GB/s per GPU for the all-reduce")
    parser.add_argument("--tp-bandwidth", type=float, default=150.0)
    parser.add_argument("--gpu-memory-gb", type=float, default=80.0)
    parser.add_argument("--gpus", type=lambda s: [int(x) for x in s.split(",")], default=[8, 16, 32])
    parser.add_argument("--max-lens", type=lambda s: [int(x) for x in s.split(",")], default=[16384, 32768])
    args = parser.parse_args()
    options = search_space(RECOMPUTE_SEARCHED)
    all_lengths = read_lengths(args.lengths)
    print(f"baselines with CP: 7B-shaped model (benchmarks/hotspa.py's), {args.lengths}, {args.batch_tokens} tokens "
          f"per 8 GPUs, {args.batches} batches, options searched: {', '.join(o.name for o in options)}")
    table = Table.of(("gpus", ">5"), ("max_len", ">8"), ("static", ">22"), ("static_s", ">9.3f"),
                     ("static_cp", ">24"), ("static_cp_s", ">11.3f"), ("hybrid", ">24"), ("hybrid_s", ">9.3f"),
                     ("plan_s", ">7.1f"))
    table.print_header()
    rows = []
    for max_len in args.max_lens:
        spec = ModelSpec(num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=11008,
                         vocab_size=32000, seq_length=max_len, untie_embeddings_and_output_weights=True)
        pieces = split_long(all_lengths, max_len).length
        for gpus in args.gpus:
            start = time.perf_counter()
            batches = sample_batches(pieces, tokens=args.batch_tokens * gpus // 8, count=args.batches, seed=gpus)
            found = {"static": [], "static_cp": [], "hybrid": []}
            for opts in options:
                cost = flops_cost_table(spec, memory_bytes=args.gpu_memory_gb * 1e9, options=opts, world_size=gpus,
                                        cost=CostModel(intra_node_bytes_per_s=args.tp_bandwidth * 1e9))
                bw = args.bandwidth * 1e9
                for key, got in (("static", best_static(spec, gpus, cost, batches, bandwidth=bw, cp_degrees=(1,))),
                                 ("static_cp", best_static(spec, gpus, cost, batches, bandwidth=bw,
                                                           cp_degrees=CP_DEGREES)),
                                 ("hybrid", best_hybrid(spec, gpus, cost, batches, bandwidth=bw))):
                    if got is not None:
                        found[key].append((f"{got[0]} {opts.name}", got[1]))
            best = {k: min(v, key=lambda x: x[1]) if v else ("none fits", float("nan")) for k, v in found.items()}
            row = {"gpus": gpus, "max_len": max_len, **{k: v[0] for k, v in best.items()},
                   **{f"{k}_s": v[1] for k, v in best.items()}, "plan_s": time.perf_counter() - start}
            rows.append(row)
            table.print_row([row[k] for k in ("gpus", "max_len", "static", "static_s", "static_cp", "static_cp_s",
                                              "hybrid", "hybrid_s", "plan_s")])
    print_result({"lengths": args.lengths, "rows": rows})


if __name__ == "__main__":
    main()
