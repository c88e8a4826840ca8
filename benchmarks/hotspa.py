"""HotSPa: one step's length groups under their own strategies vs the best static strategy.

Two parts, one JSON line at the end:

* **predicted**: a 7B-shaped model (32 layers, hidden 4096, ffn 11008, vocabulary 32000) on 8/16/32 GPUs of 80 GB,
  Wikipedia lengths (shared/data/seqlens, documents split at the longest sequence, 16K or 32K), global batches of
  ``--batch-tokens`` tokens. ``static_s``: the best uniform TP x PP x DP whose memory holds the longest sequence
  (every shape that fits, searched as a Megatron user would; Hydraulis packing, the strongest packer here) plus
  its data-parallel gradient all-reduce. ``hotspa_s``: the dynamic program's grouping over every shape that fits
  memory (hetu_ext.plan.hotspa.auto_groups, the candidates --hetu-hotspa auto offers), each group's time, its
  all-reduce and the switch to and from the home (the static best; weights bf16 in, gradients fp32 out at
  ``--bandwidth`` GB/s per GPU) included; ``switch_s`` the switch part. ``bound_s``: no grouping of the same
  batches over those candidates, under any home, beats it (hetu_ext.plan.hotspa.grouping_bound_s: compute and
  all-reduce, switches left out); ``ceiling`` = static_s / bound_s, the most any HotSPa grouping can gain under
  this cost and memory model. Means over ``--batches`` batches.
  The per-TP layer costs are the cost model's assumption: the A100 FLOPs model of hetu_ext.data.cost plus the
  tensor-parallel all-reduces a Megatron layer makes without sequence parallelism (4 per layer, forward and
  backward, of s x h bf16 values, ring 2 (t-1)/t at ``--tp-bandwidth`` GB/s: 150 for NVLink A100 SXM, 25 for a
  PCIe node), activations 10 h + 24 h / t bytes per token and layer (no sequence parallelism, FlashAttention),
  weights, gradients and Adam 18 bytes per parameter split by TP and PP; calibrate a real device with
  ``python -m hetu_ext.cli.calibrate`` and pass ``--cost-model`` to use measured ones. PP up to 8.
* **emulated**: 4 CPU ranks train a small model (256-token context) whose layers are padded to a cost table's time
  (``--hetu-emulate-cost``: configs/emulation/hotspa_cpu.yaml x ``--emulation-scale``, a large layer's times, so
  the padding dominates the CPU's own work) on real Wikipedia lengths divided by 128 (256 tokens stand for 32K);
  static (TP 4, the one uniform strategy holding 256 tokens) and hotspa (DP 4 up to 64 tokens, TP 4 home)
  interleaved, ``--repeats`` runs each; measured step time vs the packer's prediction (switches are real CPU
  transfers: measured, not predicted).

    python -m benchmarks.hotspa [--skip-emulated] [--skip-predicted] [--tp-bandwidth GBS]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import ROOT, Table, ceiling_fields, print_result
from hetu_ext.data.cost import CostTable, load_cost_table, save_cost_table
from hetu_ext.plan.hotspa import (
    GroupPricer,
    StrategySet,
    allreduce_seconds,
    auto_groups,
    auto_strategies,
    group_seconds,
    grouping_bound_s,
    switch_seconds,
)
from hetu_ext.data.lengths import read_lengths, split_long
from hetu_ext.metrics import read_records
from hetu_ext.plan import ModelSpec
from hetu_ext.plan.cost.stage import CostModel
from hetu_ext.plan.hydraulis import flops_cost_table, sample_batches
from hetu_ext.plan.core.options import PLAIN, search_space

RECOMPUTE_SEARCHED = ("none", "full")
"""Selective recomputation is left out of the packer benchmarks' search: with FlashAttention (their memory model)
it keeps the same activations as none and only adds the attention core's time, so it never wins."""


SEQLENS = ROOT.parent / "shared" / "data" / "seqlens" / "wikipedia.txt.gz"
SAMPLE = ROOT / "hetu_ext" / "data" / "samples" / "wikipedia_lengths_20k.txt.gz"


@dataclasses.dataclass(frozen=True)
class Candidates:
    """What one row offers HotSPa: every uniform shape that fits memory, homed on the static best."""

    home: StrategySet
    static_s: float
    """The static best's mean time over the batches, its all-reduce included."""
    switch: list[float]
    """Per strategy, the switch to it and back from the home (0 for the home)."""
    allreduce: list[float]


def candidates(spec: ModelSpec, gpus: int, cost: CostTable, batch_list: list[list[int]], *,
               bandwidth: float, cp_degrees: tuple[int, ...] = (1,)) -> Candidates:
    items = auto_strategies(spec, gpus, cost, max_pp=8, cp_degrees=cp_degrees).items
    longest = max(max(b) for b in batch_list)
    holding = [k for k, s in enumerate(items) if s.max_len >= longest]
    if not holding:
        raise SystemExit(f"no uniform strategy over {gpus} GPUs holds {longest} tokens")

    def static_time(k: int) -> float:
        return statistics.mean(group_seconds(items[k].plan, spec, cost, b, items[k].max_len) for b in batch_list) \
            + allreduce_seconds(items[k].plan, spec, bandwidth=bandwidth)

    static_k = min(holding, key=static_time)
    return Candidates(home=StrategySet(items=items, home=static_k), static_s=static_time(static_k),
                      switch=[0.0 if k == static_k else switch_seconds(items[static_k].plan, s.plan, spec,
                                                                      weight_bytes=2, bandwidth=bandwidth)
                              for k, s in enumerate(items)],
                      allreduce=[allreduce_seconds(s.plan, spec, bandwidth=bandwidth) for s in items])


def predicted_row(spec: ModelSpec, gpus: int, cost: CostTable, batch_list: list[list[int]], *, bandwidth: float,
                  bound_time_limit_s: float = 60.0, cp_degrees: tuple[int, ...] = (1,)) -> dict:
    row = candidates(spec, gpus, cost, batch_list, bandwidth=bandwidth, cp_degrees=cp_degrees)
    home, static_s, switch, allreduce = row.home, row.static_s, row.switch, row.allreduce
    items, static_k = home.items, home.home  # every shape that fits: what --hetu-hotspa auto offers
    pricer = GroupPricer(home, spec, cost)

    def group_s(k, ls):
        return pricer.exact(k, ls) + allreduce[k]

    def estimate_s(k, ls):
        return pricer.estimate(k, ls) + allreduce[k]

    fixed = [a + w for a, w in zip(allreduce, switch)]
    totals, switches, chosen, plan_ms, bounds = [], [], set(), [], []
    for b in batch_list:
        start = time.perf_counter()
        groups = auto_groups(b, home, estimate_s, switch, exact=group_s,
                             relaxed=lambda ls, price: pricer.relaxed(ls, fixed, upper_s=price),
                             slowest=pricer.slowest, fill=pricer.fill)
        plan_ms.append((time.perf_counter() - start) * 1e3)
        t = sw = 0.0
        for g in groups:
            t += group_s(g.strategy, [b[i] for i in g.indices])
            sw += switch[g.strategy]
            chosen.add(items[g.strategy].name)
        totals.append(t + sw)
        switches.append(sw)
        # every grouping with this home (the static best, as auto_groups is given), all-reduce and switches
        # included: one group is priced by the packer itself (what HotSPa's price of it is), two or more groups
        # by the relaxation (grouping_bound_s), which needs no bound above the best price known (upper_s)
        alone = min((pricer.exact(k, b) + fixed[k] for k, s in enumerate(items)
                     if s.max_len >= max(b) and len(s.plan.pipelines) <= len(b)), default=float("inf"))
        known = min(alone, totals[-1])
        bounds.append(min(alone, grouping_bound_s(b, home, spec, cost, fixed_s=fixed, min_strategies=2,
                                                  upper_s=known, time_limit_s=bound_time_limit_s)))
    plan_ms = statistics.mean(plan_ms)
    hotspa_s, switch_s = statistics.mean(totals), statistics.mean(switches)
    return {"gpus": gpus, "max_len": max(max(b) for b in batch_list), "static_s": static_s, "hotspa_s": hotspa_s,
            "switch_s": switch_s, "static": items[static_k].name, "hotspa_strategies": sorted(chosen),
            "grouping_ms": plan_ms, "bound_s": statistics.mean(bounds)}


# ----------------------------------------------------------------------------------------------------- emulated

EMULATED_MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size",
                  "128", "--seq-length", "256", "--micro-batch-size", "1", "--lr", "1e-4", "--lr-decay-style",
                  "constant", "--mock-data", "--hetu-mock-documents", "4000", "--hetu-packing", "balanced",
                  "--log-interval", "1"]


def emulation_inputs(out: Path, *, scale: float, lengths_file: str, divisor: int = 128, documents: int = 4000
                     ) -> tuple[Path, str]:
    """The emulated cluster's cost table (configs/emulation/hotspa_cpu.yaml with every time x ``scale``, so the
    padding dominates the CPU's own work even with 4 ranks on 2 busy cores) and the corpus: the first
    ``documents`` real document lengths of ``lengths_file`` divided by ``divisor`` (128: the emulated model's
    256-token context stands for 32K), as a --hetu-varlen-mock spec."""
    table = load_cost_table(ROOT / "configs" / "emulation" / "hotspa_cpu.yaml")
    table = dataclasses.replace(table, per_tp={tp: c.scaled(scale) for tp, c in table.per_tp.items()},
                                device=f"{table.device}-x{scale:g}")
    cost_file = out / "emulated_cost.yaml"
    save_cost_table(table, cost_file)
    scaled = np.maximum(2, read_lengths(lengths_file)[:documents] // divisor)
    lengths_path = out / "lengths.txt"
    lengths_path.write_text("\n".join(str(int(x)) for x in scaled) + "\n")
    return cost_file, json.dumps({"mode": "file", "path": str(lengths_path)})


def emulated_run(method: str, flags: list[str], *, cost_file: Path, steps: int, lengths: str, tokens: int,
                 out: Path) -> dict:
    """One 4-rank training run of ``steps`` steps with ``flags`` (the method's); its median measured step time
    (the first step, which builds the strategies' placements, left out) and median predicted time: the packer's
    (static), the groups' (HotSPa) or the chosen candidate's compute (Hydraulis); switches are real CPU transfers,
    measured but not emulated, so they are not in the prediction."""
    metrics = out / f"{method}.jsonl"
    metrics.unlink(missing_ok=True)
    argv = [sys.executable, str(ROOT / "launch" / "pretrain_gpt.py"), "--nproc-per-node", "4", *EMULATED_MODEL,
            "--train-iters", str(steps), "--hetu-varlen-mock", lengths, "--hetu-global-batch-tokens", str(tokens),
            "--hetu-emulate-cost", str(cost_file), "--hetu-cost-model", str(cost_file),
            "--hetu-metrics-file", str(metrics), *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"{method} run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    records = read_records(metrics, kind="step")[1:]  # the first step builds the strategies' placements

    def predicted(r: dict) -> float:
        packing = r["packing"]
        if "hotspa" in packing:
            return sum(g["predicted_s"] for g in packing["hotspa"]["groups"])
        if "hydraulis" in packing:
            return packing["hydraulis"]["predicted_compute_s"]
        return max(packing["predicted_s"])

    return {"ranks": 4, "method": method, "step_s": statistics.median(r["step_ms"] / 1e3 for r in records),
            "predicted_s": statistics.median(predicted(r) for r in records),
            "overruns": sum(r.get("emulation_overruns", 0) for r in records), "records": records}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default=str(SEQLENS if SEQLENS.exists() else SAMPLE))
    parser.add_argument("--batch-tokens", type=int, default=256 * 1024, help="tokens per global batch per 8 GPUs")
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--bandwidth", type=float, default=100.0, help="GB/s per GPU for switches and all-reduce")
    parser.add_argument("--tp-bandwidth", type=float, default=150.0, help="GB/s of the TP all-reduces (NVLink)")
    parser.add_argument("--cost-model", help="a measured cost table (YAML) instead of the A100 model")
    parser.add_argument("--gpu-memory-gb", type=float, default=80.0)
    parser.add_argument("--gpus", type=lambda s: [int(x) for x in s.split(",")], default=[8, 16, 32])
    parser.add_argument("--options", choices=("search", "plain"), default="search",
                        help="search: recomputation (none, full) with sequence parallelism and the distributed "
                        "optimizer, for the static strategies and HotSPa alike; plain: none of them")
    parser.add_argument("--bound-time-limit", type=float, default=60.0,
                        help="seconds HiGHS may spend on each relaxation of the bound (its dual bound stays a bound)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--emulation-scale", type=float, default=5.0,
                        help="multiply the emulated cluster's times (x5: a layer pass well above the CPU's own)")
    parser.add_argument("--skip-emulated", action="store_true")
    parser.add_argument("--skip-predicted", action="store_true")
    parser.add_argument("--cp-degrees", type=lambda s: tuple(int(x) for x in s.split(",")), default=(1,),
                        help="context-parallel degrees in the space of HotSPa and of the static strategies alike "
                        "(1,2,4,8 with CP; the rows of docs/cost_model.md before issue 48: 1); a Megatron hybrid-CP "
                        "row (benchmarks/hybrid_cp.py) is printed with each row when CP is in the space")
    args = parser.parse_args()

    measured = load_cost_table(args.cost_model) if args.cost_model else None
    options = [PLAIN] if args.options == "plain" or measured is not None else search_space(RECOMPUTE_SEARCHED)
    all_lengths = read_lengths(args.lengths)
    predicted = []
    print(f"predicted: 7B-shaped model, {args.lengths}, {args.batch_tokens} tokens per 8 GPUs, cost: "
          f"{measured.device if measured else 'flops_cost_table'} at TP link {args.tp_bandwidth:g} GB/s, options "
          f"searched: {', '.join(o.name for o in options)}")
    shares = Table.of(("gpus", ">5"), ("max_len", ">8"), ("static", ">22"), ("static_s", ">9.3f"),
                      ("hotspa_s", ">9.3f"), ("switch_s", ">9.3f"), ("gain", ">5.2f", "x"), ("bound_s", ">8.3f"),
                      ("ceiling", ">6.2f", "x"), ("share", ">6.1%"), tail="strategies used")
    shares.print_header()
    for max_len in () if args.skip_predicted else (16384, 32768):
        spec = ModelSpec(num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=11008,
                         vocab_size=32000, seq_length=max_len, untie_embeddings_and_output_weights=True)
        pieces = split_long(all_lengths, max_len).length
        for gpus in args.gpus:
            batch_list = sample_batches(pieces, tokens=args.batch_tokens * gpus // 8, count=args.batches, seed=gpus)
            per_option = []
            for opts in options:
                cost = measured or flops_cost_table(spec, memory_bytes=args.gpu_memory_gb * 1e9, options=opts,
                                                    world_size=gpus,
                                                    cost=CostModel(intra_node_bytes_per_s=args.tp_bandwidth * 1e9))
                try:
                    row = predicted_row(spec, gpus, cost, batch_list, bandwidth=args.bandwidth * 1e9,
                                        bound_time_limit_s=args.bound_time_limit, cp_degrees=args.cp_degrees)
                    if args.cp_degrees != (1,):
                        from benchmarks.hybrid_cp import best_hybrid

                        row["hybrid"] = best_hybrid(spec, gpus, cost, batch_list, bandwidth=args.bandwidth * 1e9)
                except SystemExit:
                    continue  # no strategy under these options holds the longest sequence
                row["options"] = opts.name
                per_option.append(row)
            static = min(per_option, key=lambda r: r["static_s"])
            row = dict(min(per_option, key=lambda r: r["hotspa_s"]))
            row.update(max_len=max_len, static=f"{static['static']} {static['options']}", static_s=static["static_s"],
                       bound_s=min(r["bound_s"] for r in per_option), per_option=per_option)
            row.update(ceiling_fields(row["static_s"], row["hotspa_s"], row["bound_s"]))
            hybrid = [(r["hybrid"][1], f"{r['hybrid'][0]} {r['options']}") for r in per_option if r.get("hybrid")]
            if hybrid:  # Megatron's hybrid CP beside the static best; HotSPa's gain over the stronger of the two
                row.update(hybrid_s=min(hybrid)[0], hybrid=min(hybrid)[1],
                           gain_over_stronger=min(row["static_s"], min(hybrid)[0]) / row["hotspa_s"])
            predicted.append(row)
            shares.print_row([gpus, max_len] + [row[k] for k in ("static", "static_s", "hotspa_s", "switch_s", "gain",
                                                                 "bound_s", "ceiling", "share_of_ceiling")],
                             f"{row['options']}: {', '.join(row['hotspa_strategies'])}" + (
                                 f"; hybrid CP {row['hybrid']} {row['hybrid_s']:.3f} s, gain over the stronger "
                                 f"{row['gain_over_stronger']:.3f}x" if "hybrid_s" in row else ""))

    emulated = []
    if not args.skip_emulated:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp)
            cost_file, lengths = emulation_inputs(out, scale=args.emulation_scale, lengths_file=args.lengths)
            strategies = out / "hotspa.yaml"
            strategies.write_text("home: long\nstrategies:\n  - {name: short, dp: 4, max_len: 64}\n"
                                  "  - {name: long, tp: 4, max_len: 256}\n")
            flags = {"static": ["--tensor-model-parallel-size", "4", "--hetu-runtime", "plan"],
                     "hotspa": ["--hetu-hotspa", str(strategies)]}
            runs = {"static": [], "hotspa": []}
            for _ in range(args.repeats):
                for method in ("static", "hotspa"):
                    runs[method].append(emulated_run(method, flags[method], cost_file=cost_file, steps=args.steps,
                                                     lengths=lengths, tokens=2048, out=out))
        print(f"\nemulated: 4 CPU ranks, --hetu-emulate-cost configs/emulation/hotspa_cpu.yaml x"
              f"{args.emulation_scale:g}, Wikipedia lengths / 128 (256 tokens stand for 32K), {args.repeats} runs "
              "each, interleaved")
        methods = Table.of(("method", ">8"), ("step_s", ">8.3f"), ("predicted_s", ">11.3f"),
                           ("measured/pred", ">13.2f"), ("overruns", ">8"))
        methods.print_header()
        for method, rows in runs.items():
            row = {"ranks": 4, "method": method, "step_s": statistics.median(r["step_s"] for r in rows),
                   "predicted_s": statistics.median(r["predicted_s"] for r in rows),
                   "overruns": sum(r["overruns"] for r in rows)}
            emulated.append(row)
            methods.print_row([method, row["step_s"], row["predicted_s"], row["step_s"] / row["predicted_s"],
                               row["overruns"]])
        print(f"hotspa speed-up over static: {emulated[0]['step_s'] / emulated[1]['step_s']:.2f}x")
    print_result({"predicted": predicted, "emulated": emulated})


if __name__ == "__main__":
    main()
