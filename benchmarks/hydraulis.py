"""Hydraulis: heterogeneous parallel strategies chosen per step vs Megatron's best homogeneous strategy.

    python -m benchmarks.hydraulis [--lengths FILE] [--batches 4] [--gpus 16,32,64] [--max-lens 16384,32768]
                                   [--tp-bandwidth 150] [--bandwidth 100] [--cost-model YAML] [--emulated]

**Predicted** (pure planners, no process group): a 7B-shaped model (32 layers, hidden 4096, ffn 11008, 32 heads,
vocabulary 32000) and a 32-layer 13B-shaped one (hidden 5120, ffn 13824, 40 heads) on 16 / 32 / 64 GPUs of
``--gpu-memory-gb`` (80) in nodes of 8, Wikipedia lengths (../shared/data/seqlens/wikipedia.txt.gz; documents
longer than the max length split into pieces of that length, hetu_ext.data.lengths.split_long) at 16K and 32K,
global batches of 32768 tokens per GPU drawn in a seeded random order, ``--batches`` of them (the same batches for
every method). Per-layer costs: hetu_ext.plan.hydraulis.flops_cost_table (A100-class FLOP model with the TP
all-reduces at ``--tp-bandwidth`` GB/s, activations 10 h + 24 h / t bytes per token, weights + gradients + Adam 18
bytes per parameter over TP), or a measured ``--cost-model``. Every time includes the data-parallel gradient
all-reduce (hetu_ext.plan.hydraulis.sync_seconds at ``--bandwidth`` GB/s per GPU). Mean step seconds of:

* ``megatron_s``: the best homogeneous TP x PP x DP (every shape whose memory holds the max length) with
  Megatron-LM's packing: the batch's documents concatenated and cut every max length, each piece attending to
  itself (hetu_ext.plan.lobra.megatron_time_s; the stronger of Megatron's two attention modes, the other,
  attention over the whole pack, is ``megatron_causal_s``), packs dealt to replicas in equal runs;
* ``static_hetero_s``: the best single plan among the candidates (heterogeneous ones and the home) with the
  two-stage packer for every step, and that plan's own gradient all-reduce (what the heterogeneous plan runtime
  does without switching);
* ``dynamic_s``: per step, the candidate hetu_ext.plan.hydraulis.Selector chooses (packer's time plus the
  switch of weights and gradients from the home and back, hetu_ext.plan.hotspa.switch_seconds at
  ``--bandwidth``), plus the home's gradient all-reduce;
* ``one_plan_bound_s`` (``bound_s``; ``ceiling``: ``megatron_s`` over it): per step, the lesser of the home's
  certified packing bound and hetu_ext.plan.hydraulis.one_plan_bound_s, a certified lower bound on the compute
  plus switch of any single plan of the pool's shapes (each shape's switch floor from the home,
  hetu_ext.plan.hydraulis.switch_floors_s; whole replicas per shape, proven by HiGHS), plus the home's
  all-reduce: what per-step selection among plans can reach at best; no candidate set and no selector beats it
  under this cost and memory model.

Times: ``candidates_s`` (candidate_strategies on the whole length file; ``candidates_cpu_s`` its CPU time),
``select_ms`` (one step's choice: the bounds of every candidate holding the longest sequence and the packer on each
one priced), ``pack_ms`` (the packer once on the chosen candidate, its bound already computed: the step's packing,
which training runs anyway) and ``select_overhead_ms`` (the difference), wall-clock; ``select_cpu_ms`` the
choice's process CPU time (single-threaded: what it costs on an idle core when the machine is shared). Medians
over the batches;
``select_max_ms`` / ``select_cpu_max_ms`` (``sel_max`` / ``cpu_max``) the slowest batch's.
``dynamic_bound_s`` / ``select_bound_ms``: the cheaper choice by the certified lower bound plus switch alone
(Selector.choose(exact=False): the packer runs only on the chosen candidate, as the step's packing), its mean step
time and its choice time (bounds only).

**Emulated** (``--emulated``): :func:`emulated_rows`, 4 CPU ranks training under ``--hetu-emulate-cost``.
The last line is one JSON object ``{"predicted": [...], "emulated": [...]}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import Table, ceiling_fields, print_result
from benchmarks.hotspa import RECOMPUTE_SEARCHED, SAMPLE, SEQLENS, emulated_run, emulation_inputs

from hetu_ext.data.cost import CostTable, load_cost_table
from hetu_ext.data.lengths import read_lengths, split_long
from hetu_ext.data.packing_bound import lower_bound_s
from hetu_ext.plan.core.replicas import replica_specs
from hetu_ext.plan import ModelSpec
from hetu_ext.plan.cost.stage import CostModel
from hetu_ext.plan.hydraulis import (
    MAX_PP,
    Selector,
    candidate_strategies,
    flops_cost_table,
    one_plan_bound_s,
    sample_batches,
    select_candidate,
    shape_pool,
    switch_floors_s,
    sync_seconds,
)
from hetu_ext.plan.lobra import megatron_time_s
from hetu_ext.plan.core.options import PLAIN, Options, search_space
from hetu_ext.plan.core.plan import uniform_plan

MODELS = {
    "7B": {"num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "ffn_hidden_size": 11008},
    "13B-32L": {"num_layers": 32, "hidden_size": 5120, "num_attention_heads": 40, "ffn_hidden_size": 13824},
}
TOKENS_PER_GPU = 32768


def cost_for(spec: ModelSpec, args: argparse.Namespace, options: Options = PLAIN, world_size: int | None = None
             ) -> CostTable:
    if args.cost_model:
        table = load_cost_table(args.cost_model)
        return table if table.device_memory_bytes is not None else CostTable(
            per_tp=table.per_tp, device=table.device, device_memory_bytes=args.gpu_memory_gb * 1e9, note=table.note)
    return flops_cost_table(spec, memory_bytes=args.gpu_memory_gb * 1e9, options=options, world_size=world_size,
                            cost=CostModel(intra_node_bytes_per_s=args.tp_bandwidth * 1e9))


def megatron_best(spec: ModelSpec, gpus: int, cost: CostTable, batches: list[list[int]], *, max_len: int,
                  bandwidth: float, cp_degrees: tuple[int, ...] = (1,)) -> dict:
    """The best homogeneous TP x PP x DP (or TP x CP x DP, CP of ``cp_degrees``) holding ``max_len`` with
    Megatron-LM's packing (module docstring)."""
    rows = []
    shapes = [(tp, pp, 1) for tp in sorted(cost.per_tp) for pp in range(1, MAX_PP + 1)] + [
        (tp, 1, cp) for tp in sorted(cost.per_tp) for cp in cp_degrees if cp > 1 and max_len % (2 * cp) == 0]
    for tp, pp, cp in shapes:
        if gpus % (tp * pp * cp) or spec.num_layers % pp or tp > 8 or spec.num_attention_heads % tp:
            continue
        plan = uniform_plan(world_size=gpus, tp=tp, pp=pp, cp=cp, num_layers=spec.num_layers)
        try:
            replicas = replica_specs(plan, spec, cost, max_pack_tokens=max_len)
        except ValueError:
            continue
        if replicas[0].token_capacity < max_len:
            continue
        sync = sync_seconds(plan, spec, bandwidth=bandwidth)
        doc = [megatron_time_s(np.asarray(b), replicas, max_len, causal=False) + sync for b in batches]
        causal = [megatron_time_s(np.asarray(b), replicas, max_len, causal=True) + sync for b in batches]
        rows.append((float(np.mean(doc)), float(np.mean(causal)),
                     f"tp{tp}" + (f"cp{cp}" if cp > 1 else "") + f"pp{pp}dp{gpus // (tp * pp * cp)}"))
    if not rows:
        raise SystemExit(f"no homogeneous strategy over {gpus} GPUs holds {max_len} tokens")
    best = min(rows)
    return {"megatron_s": best[0], "megatron": best[2], "megatron_causal_s": min(r[1] for r in rows)}


def predicted_row(name: str, spec: ModelSpec, gpus: int, cost: CostTable, pieces: np.ndarray,
                  batches: list[list[int]], *, max_len: int, bandwidth: float, limit: int = 8,
                  sampled: int = 0, cp_degrees: tuple[int, ...] = (1,)) -> dict:
    start, cpu = time.perf_counter(), time.process_time()
    strategies = candidate_strategies(spec, gpus, cost, pieces, max_len=max_len, batch_tokens=TOKENS_PER_GPU * gpus,
                                      limit=limit, sampled_batches=sampled, seed=10_000 + gpus,
                                      cp_degrees=cp_degrees)
    candidates_s, candidates_cpu_s = time.perf_counter() - start, time.process_time() - cpu
    items = strategies.items
    selector = Selector(strategies, spec, cost, bandwidth=bandwidth)
    home_sync = sync_seconds(items[strategies.home].plan, spec, bandwidth=bandwidth)
    dynamic, chosen, select_ms, pack_ms, select_cpu_ms = [], [], [], [], []
    bound_dynamic, bound_ms, bound_cpu_ms = [], [], []
    exact = {k: [] for k in range(len(items))}
    uppers: list[float | None] = []
    longest = max(max(b) for b in batches)
    for b in batches:
        start, cpu = time.perf_counter(), time.process_time()  # first: the bounds of these lengths not yet cached
        kb, _ = select_candidate(b, strategies, estimate=selector.estimate, exact=selector.estimate,
                                 switch_s=selector.switch_s)
        bound_ms.append((time.perf_counter() - start) * 1e3)
        bound_cpu_ms.append((time.process_time() - cpu) * 1e3)
        start, cpu = time.perf_counter(), time.process_time()
        k, t, _ = selector.choose(b)
        select_ms.append((time.perf_counter() - start) * 1e3)
        select_cpu_ms.append((time.process_time() - cpu) * 1e3)
        start = time.perf_counter()
        selector.exact(k, b)
        pack_ms.append((time.perf_counter() - start) * 1e3)
        dynamic.append(t + home_sync)
        chosen.append(items[k].name)
        bound_dynamic.append(selector.exact(kb, b) + selector.switch_s[kb] + home_sync)
        known = []  # the candidates' compute times on this batch: the bound needs none above the least
        for j, s in enumerate(items):
            if s.max_len >= longest and len(s.plan.pipelines) <= len(b):
                known.append(selector.exact(j, b))
                exact[j].append(known[-1] + sync_seconds(s.plan, spec, bandwidth=bandwidth))
        uppers.append(min(known, default=None))
    static = min((float(np.mean(v)), items[j].name) for j, v in exact.items() if len(v) == len(batches))
    pool = shape_pool(spec, cost, world_size=gpus, max_len=max_len, prune=False, cp_degrees=cp_degrees)
    # the candidates' home is fixed and its all-reduce is paid every step: on top of any one plan's compute
    # per batch: the home (its packer's certified bound; a plan of fewer home replicas is no faster), or any other
    # plan (one_plan_bound_s, its switch included: at least the largest floor of its shapes)
    home_shape = items[strategies.home].plan.pipelines[0]
    floors = switch_floors_s(home_shape.stages[0].tp, home_shape.pp, pool, spec, bandwidth=bandwidth)
    home = items[strategies.home]
    home_replicas = replica_specs(home.plan, spec, cost, max_pack_tokens=home.max_len)
    bound = float(np.mean([min(lower_bound_s(np.asarray(b), home_replicas),
                               one_plan_bound_s(b, pool, gpus, upper_s=u, switch_s=floors,
                                                whole_replicas=True))
                           for b, u in zip(batches, uppers)])) + home_sync
    row = {"model": name, "gpus": gpus, "max_len": max_len, "lengths": None,
           **megatron_best(spec, gpus, cost, batches, max_len=max_len, bandwidth=bandwidth, cp_degrees=cp_degrees),
           "static_hetero_s": static[0], "static_hetero": static[1], "dynamic_s": float(np.mean(dynamic)),
           "one_plan_bound_s": bound,
           "chosen": sorted(set(chosen)), "candidates": len(items), "home": items[strategies.home].name,
           "candidates_s": candidates_s, "candidates_cpu_s": candidates_cpu_s,
           "select_ms": statistics.median(select_ms), "select_max_ms": max(select_ms),
           "select_cpu_ms": statistics.median(select_cpu_ms), "select_cpu_max_ms": max(select_cpu_ms),
           "pack_ms": statistics.median(pack_ms),
           "select_overhead_ms": statistics.median(s - p for s, p in zip(select_ms, pack_ms)),
           "dynamic_bound_s": float(np.mean(bound_dynamic)), "select_bound_ms": statistics.median(bound_ms),
           "select_bound_cpu_ms": statistics.median(bound_cpu_ms)}
    return row


EMULATED_CANDIDATES = """
home: tp4
strategies:
  - {name: dp4, dp: 4, max_len: 64}
  - {name: tp2+2x1, plan: tp2_1_1.yaml, max_len: 128}
  - {name: tp4, tp: 4, max_len: 256}
"""
TP2_1_1 = """
pipelines:
  - {num_microbatches: 1, stages: [{ranks: [0, 1], layers: [0, 4]}]}
  - {num_microbatches: 1, stages: [{ranks: [2], layers: [0, 4]}]}
  - {num_microbatches: 1, stages: [{ranks: [3], layers: [0, 4]}]}
"""


def emulated_rows(args: argparse.Namespace) -> list:
    """Emulated training (``--emulated``): 4 CPU ranks, the model and emulated cluster of benchmarks/hotspa.py
    (layers padded to configs/emulation/hotspa_cpu.yaml x ``--emulation-scale``; memory: TP 1 holds 64 tokens,
    TP 2 128, TP 4 256), real Wikipedia lengths / 128 (256 tokens stand for 32K). Batches alternate short and
    long: a run on the corpus' documents of at most 64 tokens (short steps) and one on the whole corpus (long
    steps), each method on both, methods interleaved, ``--repeats`` times. ``static``: TP 4, the one homogeneous
    strategy holding 256 tokens; ``dynamic``: ``--hetu-strategies`` over {DP 4, TP 2 + 2 x TP 1, TP 4 (home)}.
    A row's times are the mean of a short and a long step (medians over steps and repeats)."""
    if not args.emulated:
        return []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        cost_file, mixed = emulation_inputs(out, scale=args.emulation_scale, lengths_file=args.lengths)
        scaled = np.loadtxt(out / "lengths.txt", dtype=np.int64)
        (out / "short.txt").write_text("\n".join(str(int(x)) for x in scaled[scaled <= 64]) + "\n")
        short = json.dumps({"mode": "file", "path": str(out / "short.txt")})
        (out / "tp2_1_1.yaml").write_text(TP2_1_1)
        (out / "candidates.yaml").write_text(EMULATED_CANDIDATES)
        flags = {"static": ["--tensor-model-parallel-size", "4", "--hetu-runtime", "plan"],
                 "dynamic": ["--hetu-strategies", str(out / "candidates.yaml")]}
        runs = {(m, c): [] for m in flags for c in ("short", "long")}
        for _ in range(args.repeats):
            for corpus, lengths in (("short", short), ("long", mixed)):
                for method in flags:
                    run = emulated_run(method, flags[method], cost_file=cost_file, steps=args.emulated_steps,
                                       lengths=lengths, tokens=args.emulated_tokens, out=out)
                    if method == "dynamic":
                        run["chosen"] = sorted({r["packing"]["hydraulis"]["candidate"] for r in run["records"]})
                        run["switch_s"] = statistics.median(r["packing"]["hydraulis"]["switch_s"]
                                                            for r in run["records"])
                    runs[method, corpus].append(run)
    print(f"\nemulated: 4 CPU ranks, --hetu-emulate-cost configs/emulation/hotspa_cpu.yaml x{args.emulation_scale:g},"
          f" Wikipedia lengths / 128, {args.emulated_tokens} tokens per step, short and long steps, {args.repeats} "
          "runs each, interleaved")
    methods = Table.of(("method", ">8"), ("steps", ">6"), ("step_s", ">8.3f"), ("predicted_s", ">11.3f"),
                       ("measured/pred", ">13.2f"), ("overruns", ">8"), ("switch_s", ">8.3f"), tail="chosen")
    methods.print_header()
    rows = []
    for method in flags:
        per = {}
        for corpus in ("short", "long"):
            got = runs[method, corpus]
            per[corpus] = (statistics.median(r["step_s"] for r in got),
                           statistics.median(r["predicted_s"] for r in got))
            chosen = sorted({c for r in got for c in r.get("chosen", [])})
            methods.print_row([method, corpus, per[corpus][0], per[corpus][1], per[corpus][0] / per[corpus][1],
                               sum(r["overruns"] for r in got), statistics.median(r.get("switch_s", 0.0) for r in got)],
                              ", ".join(chosen))
        row = {"ranks": 4, "method": method, "step_s": (per["short"][0] + per["long"][0]) / 2,
               "predicted_s": (per["short"][1] + per["long"][1]) / 2}
        rows.append(row)
        methods.print_row([method, "mean", row["step_s"], row["predicted_s"], row["step_s"] / row["predicted_s"]])
    print(f"dynamic speed-up over the best homogeneous (static TP 4): {rows[0]['step_s'] / rows[1]['step_s']:.2f}x")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default=str(SEQLENS if SEQLENS.exists() else SAMPLE))
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--gpus", type=lambda s: [int(x) for x in s.split(",")], default=[16, 32, 64])
    parser.add_argument("--max-lens", type=lambda s: [int(x) for x in s.split(",")], default=[16384, 32768])
    parser.add_argument("--models", type=lambda s: s.split(","), default=list(MODELS))
    parser.add_argument("--gpu-memory-gb", type=float, default=80.0)
    parser.add_argument("--bandwidth", type=float, default=100.0, help="GB/s per GPU: switches and all-reduce")
    parser.add_argument("--tp-bandwidth", type=float, default=150.0, help="GB/s of the TP all-reduces (NVLink)")
    parser.add_argument("--cost-model", default=None, help="a measured cost table (YAML) instead of the FLOP model")
    parser.add_argument("--cp-degrees", type=lambda s: tuple(int(x) for x in s.split(",")), default=(1,),
                        help="context-parallel degrees in the candidates' pool and Megatron's homogeneous baseline "
                        "alike (1,2,4,8 with CP; the saved rows before issue 48: 1); with CP a Megatron hybrid-CP "
                        "row (benchmarks/hybrid_cp.py) is printed beside each")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--emulated", action="store_true", help="also the emulated CPU rows")
    parser.add_argument("--emulation-scale", type=float, default=10.0, help="emulated: the cost file's times x this")
    parser.add_argument("--emulated-steps", type=int, default=3, help="emulated: steps per run (first left out)")
    parser.add_argument("--emulated-tokens", type=int, default=1024, help="emulated: tokens per global batch")
    parser.add_argument("--repeats", type=int, default=2, help="emulated: runs per method and corpus")
    parser.add_argument("--skip-predicted", action="store_true")
    parser.add_argument("--limit", type=int, default=24, help="most candidates (the home included; the CLI's default)")
    parser.add_argument("--sampled-batches", type=int, default=16,
                        help="candidates also from the program on this many global batches drawn from the lengths "
                        "(another seed than the evaluated batches')")
    parser.add_argument("--options", choices=("search", "plain"), default="search",
                        help="search: no/full recomputation with sequence parallelism and the distributed optimizer, "
                        "for Megatron's strategies and Hydraulis's alike; plain: none of them")
    args = parser.parse_args()

    all_lengths = read_lengths(args.lengths)
    options = [PLAIN] if args.options == "plain" or args.cost_model else search_space(RECOMPUTE_SEARCHED)
    print(f"# date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()}, {os.cpu_count()} "
          f"CPUs, load average {os.getloadavg()[0]:.1f}")
    print(f"predicted: lengths {args.lengths} ({all_lengths.size} documents), {TOKENS_PER_GPU} tokens per GPU per "
          f"batch, {args.batches} batches, {args.gpu_memory_gb:g} GB per GPU, TP link {args.tp_bandwidth:g} GB/s, "
          f"switch/all-reduce {args.bandwidth:g} GB/s per GPU; options searched: "
          f"{', '.join(o.name for o in options)} (the same for Megatron's homogeneous strategies)")
    shares = Table.of(("model", "<8"), ("gpus", ">4"), ("max_len", ">7"), ("megatron", ">22"), ("megatron_s", ">10.3f"),
                      ("causal_s", ">8.3f"), ("static_h_s", ">10.3f"), ("dynamic_s", ">9.3f"), ("gain", ">6.2f", "x"),
                      ("stat/dyn", ">7.2f", "x"), ("bound_s", ">7.3f"), ("ceiling", ">6.2f", "x"), ("share", ">6.1%"),
                      ("cand_s", ">6.2f"), ("sel_ms", ">7.1f"), ("sel_max", ">7.1f"), ("sel_cpu", ">7.1f"),
                      tail="options: chosen (home)", rule=True)
    shares.print_header()
    predicted = []
    for max_len in () if args.skip_predicted else args.max_lens:
        pieces = split_long(all_lengths, max_len).length
        for name in args.models:
            spec = ModelSpec(**MODELS[name], vocab_size=32000, seq_length=max_len,
                             untie_embeddings_and_output_weights=True)
            for gpus in args.gpus:
                batches = sample_batches(pieces, tokens=TOKENS_PER_GPU * gpus, count=args.batches,
                                         seed=args.seed + gpus)
                per_option = []
                for opts in options:
                    cost = cost_for(spec, args, opts, gpus)
                    try:
                        one = predicted_row(name, spec, gpus, cost, pieces, batches, max_len=max_len,
                                            bandwidth=args.bandwidth * 1e9, limit=args.limit,
                                            sampled=args.sampled_batches, cp_degrees=args.cp_degrees)
                        if args.cp_degrees != (1,):
                            from benchmarks.hybrid_cp import best_hybrid

                            one["hybrid"] = best_hybrid(spec, gpus, cost, batches, bandwidth=args.bandwidth * 1e9)
                    except (ValueError, SystemExit):
                        continue  # nothing under these options holds max_len
                    one["options"] = opts.name
                    per_option.append(one)
                meg = min(per_option, key=lambda r: r["megatron_s"])
                row = dict(min(per_option, key=lambda r: r["dynamic_s"]))
                row.update(megatron=f"{meg['megatron']} {meg['options']}", megatron_s=meg["megatron_s"],
                           megatron_causal_s=min(r["megatron_causal_s"] for r in per_option),
                           static_hetero_s=min(r["static_hetero_s"] for r in per_option),
                           one_plan_bound_s=min(r["one_plan_bound_s"] for r in per_option),
                           lengths=Path(args.lengths).name, per_option=per_option)
                row.update(ceiling_fields(row["megatron_s"], row["dynamic_s"], row["one_plan_bound_s"]))
                hybrid = [(r["hybrid"][1], f"{r['hybrid'][0]} {r['options']}") for r in per_option if r.get("hybrid")]
                if hybrid:  # Megatron's hybrid CP beside its best static strategy; the gain over the stronger
                    row.update(hybrid_s=min(hybrid)[0], hybrid=min(hybrid)[1],
                               gain_over_stronger=min(row["megatron_s"], min(hybrid)[0]) / row["dynamic_s"])
                predicted.append(row)
                shares.print_row([name, gpus, max_len, row["megatron"], row["megatron_s"], row["megatron_causal_s"],
                                  row["static_hetero_s"], row["dynamic_s"], row["gain"],
                                  row["static_hetero_s"] / row["dynamic_s"], row["one_plan_bound_s"], row["ceiling"],
                                  row["share_of_ceiling"], row["candidates_s"], row["select_ms"],
                                  row["select_max_ms"], row["select_cpu_ms"]],
                                 f"{row['options']}: {', '.join(row['chosen'])} ({row['home']})" + (
                                     f"; hybrid CP {row['hybrid']} {row['hybrid_s']:.3f} s, gain over the "
                                     f"stronger {row['gain_over_stronger']:.3f}x" if "hybrid_s" in row else ""))
    emulated = emulated_rows(args)
    print_result({"predicted": predicted, "emulated": emulated})


if __name__ == "__main__":
    main()
