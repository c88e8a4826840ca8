"""Malleus planner: planning time and predicted speed-up over Megatron's uniform plans, 64 to 4096 GPUs.

    python -m benchmarks.planner_scale [--seed 0] [--tp-efficiency configs/calibration/tp_efficiency_cpu.yaml]
        [--cp-degrees 1,2,4,8] [--seq-length 4096]

A GPT of 32 layers, hidden 4096, 32 heads, sequence 4096, micro batch 1, 4 microbatches per GPU of global batch;
nodes of 8 GPUs with 80 GiB. Stragglers: 1% and 5% of the GPUs, slowdowns drawn from Malleus's experiments
{1.5, 2, 3, 5, 12.5}. Two uniform baselines, their step times predicted by the same cost model:

* TP 8 x PP 4 x DP = GPUs / 32 (Megatron-LM's usual layout for this size, all GPUs kept: a straggler slows its
  stage, so its whole step);
* the best uniform layout (:func:`best_uniform`): every TP x PP x DP that fits memory (TP in a node, PP dividing
  the layers, DP dividing the global batch's microbatches), on all GPUs or after dropping the slowest (every
  cutoff: the ranks slower than it are left out, restart cost not counted), stragglers kept placed where they
  cost least. This is what a user restarting without the slow GPUs would pick.

Planning time is the median of 3 runs of the pure planner (no process group), wall-clock (``plan_s``) and its
process CPU time (``cpu_s``: single-threaded, what it costs on an idle core when the machine is shared). Targets:
<= 0.1 s at 64 GPUs, <= 1 s at 1024 and 4096. The TP efficiencies are the cost model's assumed constants unless
``--tp-efficiency FILE`` gives measured ones (``python -m hetu_ext.data.calibrate``; degrees not in it keep the
constants). ``--cp-degrees``: context-parallel degrees searched by the planner, its bound and the best uniform
layout alike (default 1: none); ``--seq-length`` the model's sequence. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time
from collections.abc import Sequence

from benchmarks.common import Table, ceiling_fields, print_result
from hetu_ext.plan.core.cluster import Cluster
from hetu_ext.plan.cost.stage import CostModel, load_tp_efficiency, stage_cost, with_measured_tp
from hetu_ext.plan.malleus import microbatch_bound_s, plan_malleus, plan_step_s, predict_uniform, work_bound_s
from hetu_ext.plan.core.options import PLAIN, Options, search_space
from hetu_ext.model.spec import ModelSpec
from hetu_ext.plan.core.plan import uniform_plan

SPEC = ModelSpec(num_layers=32, hidden_size=4096, num_attention_heads=32, vocab_size=50257, seq_length=4096)
SLOWDOWNS = (1.5, 2.0, 3.0, 5.0, 12.5)


def best_uniform(cluster: Cluster, spec: ModelSpec, *, micro_batch: int, num_microbatches: int,
                 cost: CostModel = CostModel(), tp_degrees: tuple[int, ...] = (1, 2, 4, 8),
                 options: Sequence[Options] = (PLAIN,), cp_degrees: tuple[int, ...] = (1,)) -> dict:
    """The fastest Megatron uniform layout (TP x PP x DP, rank order tp-dp-pp) on the cluster or on what is left
    of it after dropping every rank slower than a cutoff (each distinct slowdown tried, keep-all included).

    TP groups form inside a node from its kept ranks (fastest first); the layout uses the pp x dp groups whose
    slowest member is least; DP divides ``num_microbatches`` (Megatron's global batch rule) and PP the layers;
    every stage must fit ``cluster.gpu_memory_bytes`` with 1F1B's in-flight microbatches. The kept stragglers are
    placed along pipeline 0's stages, slowest first (one slowed pipeline, the others healthy: the least a uniform
    layout loses to them). Ranks beyond the pp x dp groups stay spare (DP must divide the global batch: with 256
    microbatches, 63 healthy GPUs run a layout of 32). Returns ``{"step_s", "tp", "pp", "dp", "ranks", "dropped",
    "slowdowns"}``: ``ranks`` the original ranks in the layout's rank order, ``slowdowns`` by the layout's rank,
    ``dropped`` the ranks it leaves out (too slow, or spare). ``cp_degrees``: each stage ``cp`` TP groups of one
    node (rank order tp-cp-dp-pp)."""
    best = None
    cutoffs = sorted({cluster.slowdown(r) for r in range(cluster.world_size)}, reverse=True)
    for cutoff in cutoffs:
        kept_by_node = [sorted((r for r in node if cluster.slowdown(r) <= cutoff), key=cluster.slowdown)
                        for node in cluster.nodes]
        for tp, cp in ((t, c) for t in tp_degrees for c in cp_degrees):
            w = tp * cp
            if w > cluster.gpus_per_node or spec.num_attention_heads % tp or spec.ffn_hidden_size % tp or (
                    cp > 1 and spec.seq_length % (2 * cp)):
                continue
            groups = [ranks[k:k + w] for ranks in kept_by_node for k in range(0, len(ranks) - w + 1, w)]
            groups.sort(key=lambda g: (max(map(cluster.slowdown, g)), g))
            for pp in (p for p in range(1, spec.num_layers + 1) if spec.num_layers % p == 0):
                for dp in (d for d in range(1, len(groups) // pp + 1) if num_microbatches % d == 0):
                    m = num_microbatches // dp
                    opts = next((o for o in options if _fits(spec, cost, cluster.gpu_memory_bytes, tp, pp, m,
                                                             micro_batch, o, dp, cp)), None)
                    if opts is None:
                        continue
                    used = groups[:pp * dp]
                    slow = sorted((cluster.slowdown(r) for g in used for r in g if cluster.slowdown(r) > 1),
                                  reverse=True)
                    order = [t + tp * (c + cp * (d + dp * p)) for d in range(dp) for p in range(pp)
                             for c in range(cp) for t in range(tp)]
                    layout_slow = dict(zip(order, slow))
                    n = w * pp * dp
                    virtual = Cluster(world_size=n, gpus_per_node=cluster.gpus_per_node,
                                      gpu_memory_bytes=cluster.gpu_memory_bytes, slowdowns=layout_slow)
                    plan = uniform_plan(world_size=n, tp=tp, pp=pp, cp=cp, num_layers=spec.num_layers,
                                        num_microbatches=m)
                    step = plan_step_s(plan, virtual, spec, micro_batch=micro_batch, cost=cost, options=opts)
                    if best is None or step < best["step_s"]:
                        ranks = [r for g in used for r in g]
                        best = {"step_s": step, "tp": tp, "pp": pp, "dp": dp, "cp": cp, "ranks": ranks,
                                "dropped": sorted(set(range(cluster.world_size)) - set(ranks)),
                                "slowdowns": layout_slow, "options": opts}
    if best is None:
        raise ValueError("best_uniform: no uniform layout fits")
    return best


def _fits(spec: ModelSpec, cost: CostModel, memory: int, tp: int, pp: int, m: int, micro_batch: int,
          options: Options = PLAIN, dp: int = 1, cp: int = 1) -> bool:
    per_stage = spec.num_layers // pp
    if options.distributed_optimizer:
        cost = dataclasses.replace(cost, optimizer_sharded=True)
    return all(stage_cost(spec, cost, num_layers=per_stage, tp=tp, slowdown=1.0, micro_batch=micro_batch,
                          first=j == 0, last=j == pp - 1, in_flight=min(pp - j, m), optimizer_holders=dp * cp,
                          recompute=options.recompute, sequence_parallel=options.sequence_parallel and tp > 1,
                          cp=cp).memory_bytes <= memory
               for j in range(pp))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tp-efficiency", default=None, help="measured TP efficiencies (YAML from python -m "
                        "hetu_ext.data.calibrate); default: the cost model's constants")
    parser.add_argument("--options", choices=("search", "plain"), default="search",
                        help="search: recomputation (none/selective/full), sequence parallelism and the "
                        "distributed optimizer with every template and uniform layout; plain: none of them")
    parser.add_argument("--gpus", type=lambda s: [int(x) for x in s.split(",")], default=[64, 256, 1024, 4096])
    parser.add_argument("--cp-degrees", type=lambda s: tuple(int(x) for x in s.split(",")), default=(1,))
    parser.add_argument("--seq-length", type=int, default=SPEC.seq_length)
    args = parser.parse_args()
    spec = dataclasses.replace(SPEC, seq_length=args.seq_length, max_position_embeddings=args.seq_length)
    rng = random.Random(args.seed)
    cost = CostModel()
    if args.tp_efficiency:
        cost = with_measured_tp(cost, load_tp_efficiency(args.tp_efficiency))
    options = search_space(distributed_optimizer=(False, True)) if args.options == "search" else None
    source = f"measured {args.tp_efficiency}" if args.tp_efficiency else "assumed constants"
    print(f"config: {spec}, CP degrees {args.cp_degrees}, micro batch 1, 4 microbatches per GPU, 8 GPUs x 80 GiB per node, seed {args.seed}; "
          f"TP efficiency {cost.tp_efficiency} ({source}); options: {args.options}")
    shares = Table.of(("gpus", ">6"), ("stragglers", ">10"), ("plan_s", ">8.3f"), ("cpu_s", ">6.3f"),
                      ("template", "<42"), ("tp8pp4_s", ">9.2f"), ("best_uniform", "<36"), ("best_s", ">7.2f"),
                      ("hetu_s", ">7.2f"), ("vs_tp8pp4", ">9.2f"), ("gain", ">5.2f", "x"), ("bound_s", ">7.2f"),
                      ("ceiling", ">6.2f", "x"), ("share", ">6.1%"))
    shares.print_header()
    results = []
    for gpus in (64, 256, 1024, 4096):
        for share in (0.01, 0.05):
            count = max(1, round(gpus * share))
            slow = {r: rng.choice(SLOWDOWNS) for r in rng.sample(range(gpus), count)}
            if gpus not in args.gpus:
                continue
            cluster = Cluster(world_size=gpus, gpus_per_node=8, gpu_memory_bytes=80 * 2**30, slowdowns=slow)
            microbatches = 4 * gpus
            times, cpu = [], []
            for _ in range(3):
                start, start_cpu = time.perf_counter(), time.process_time()
                planned = plan_malleus(cluster, spec, micro_batch=1, num_microbatches=microbatches, cost=cost,
                                       options=options, cp_degrees=args.cp_degrees)
                times.append(time.perf_counter() - start)
                cpu.append(time.process_time() - start_cpu)
            uniform = predict_uniform(cluster, spec, tp=8, pp=4, micro_batch=1, num_microbatches=microbatches,
                                      cost=cost)
            best = best_uniform(cluster, spec, micro_batch=1, num_microbatches=microbatches, cost=cost,
                                options=options or (PLAIN,), cp_degrees=args.cp_degrees)
            bound = max(work_bound_s(cluster, spec, micro_batch=1, num_microbatches=microbatches, cost=cost),
                        microbatch_bound_s(cluster, spec, micro_batch=1, num_microbatches=microbatches, cost=cost,
                                           cp_degrees=args.cp_degrees))
            cp_text = f" cp{best['cp']}" if best["cp"] > 1 else ""
            layout = (f"tp{best['tp']}{cp_text} pp{best['pp']} dp{best['dp']} {best['options'].name} "
                      f"on {len(best['ranks'])}/{gpus}")
            speedup, best_speedup = uniform / planned.predicted_step_s, best["step_s"] / planned.predicted_step_s
            ceiling = ceiling_fields(best["step_s"], planned.predicted_step_s, bound)
            reached = ceiling["share_of_ceiling"]
            seconds, cpu_s = statistics.median(times), statistics.median(cpu)
            shares.print_row([gpus, count, seconds, cpu_s, planned.template, uniform, layout, best["step_s"],
                              planned.predicted_step_s, speedup, best_speedup, bound, ceiling["ceiling"], reached])
            results.append({"gpus": gpus, "stragglers": count, "plan_seconds": round(seconds, 4),
                            "plan_cpu_seconds": round(cpu_s, 4),
                            "predicted_speedup": round(speedup, 3), "best_uniform_speedup": round(best_speedup, 3),
                            "hetu_s": round(planned.predicted_step_s, 4), "options": planned.options.name,
                            "bound_s": round(bound, 4), "ceiling": round(best["step_s"] / bound, 4),
                            "share_of_ceiling": round(reached, 4),
                            "best_uniform": {k: best[k] for k in ("tp", "pp", "dp", "cp")} | {
                                "options": best["options"].name,
                                "gpus_used": len(best["ranks"]), "step_s": round(best["step_s"], 3)}})
    print_result({"cp_degrees": list(args.cp_degrees), "seq_length": args.seq_length,
                  "tp_efficiency": {str(k): v for k, v in cost.tp_efficiency.items()},
                  "tp_efficiency_source": source, "options": args.options, "results": results})


if __name__ == "__main__":
    main()
