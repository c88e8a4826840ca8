"""LobRA: GPU-seconds per global step of many tenants' LoRA fine-tuning, predicted at scale and emulated on CPU.

    python -m benchmarks.lobra [--steps 8] [--part all|predicted|emulated] [--emulated-steps 6] [--cost-model YAML]

**Predicted** (pure planner, hetu_ext/plan/lobra/): a LLaMA-7B-shaped model (Hetu's LobRA scripts: 32 layers,
hidden 4096, ffn 11008, 32 heads), 16K max length, A100-class 80 GB GPUs (hetu_ext.plan.cost.stage's FLOP / all-reduce
model, frozen bf16 base), 8 GPUs per node, at 16 / 32 / 64 GPUs with 4 / 6 / 8 tenants of 64 sequences per step.
The tenants' length distributions are SYNTHETIC: each tenant draws from the real Wikipedia lengths
(../shared/data/seqlens/wikipedia.txt.gz; the shipped 20K sample when absent) multiplied by its own scale factor
(short tenants x1/4 .. long ones x16) and truncated to 16K, so that tenants are skewed against each other and
steps vary. GPU-seconds per step = GPUs x mean step time over the same sampled steps for:

* ``homogeneous``: GPUs // g replicas of the smallest strategy holding the longest sequence, Megatron-style packs
  (sequences laid end to end, cut every 16K tokens, each piece attending to itself, packs dealt in equal runs);
  ``homogeneous_causal``: the same packs with attention over the whole pack (Megatron-LM's default);
  ``homogeneous_balanced``: the same replicas with LobRA's per-step dispatch (shows what the heterogeneous
  replicas add on their own);
* ``sequential``: tenants one after another, each on all GPUs with the smallest strategy holding its own longest
  sequence, Megatron-style packs;
* ``lobra``: the planner's deployment of heterogeneous replicas and the two-stage dispatch of every step;
* ``hybrid CP`` (with ``--cp-degrees`` beyond 1): Megatron-core's ``--hybrid-context-parallel`` over all the
  tenants' sequences of a step on every GPU (:func:`best_hybrid_lora`: its own BalancedCPScheduler forms the
  groups, hetu_ext.plan.cost.hybrid_cp prices them with the frozen-base layer cost, K/V exchange on the
  intra-node link within a node and the inter-node one beyond, as the pool's CP shapes; no gradient reduction,
  as for the other rows: the adapters are negligible); every TP degree and N tuned; the row's gain over the
  stronger of it and ``homogeneous`` is printed;
* ``bound``: a certified lower bound on the GPU-seconds of ANY deployment and dispatch under the same cost model
  (hetu_ext.plan.lobra.work_bound_gpu_s: each whole sequence at the cheapest GPU-seconds of any strategy, no
  per-microbatch cost, bubble or imbalance); ``max sav.`` = 1 - bound / homogeneous, the largest saving this
  cost model allows whatever the planner does (the issue's 45% needs it above 45%).

**Emulated**: 4 CPU ranks train 3 tenants jointly (pretrain_gpt.py's code path with --hetu-lora-tenants) on the
planner's deployment and on the homogeneous one, each transformer layer padded to a cost table's time for the
microbatch it ran (--hetu-emulate-cost; the same table is the packer's --hetu-cost-model and the planner's
--cost-model), so measured step times can be compared with the predicted ones. Measured: steps 2..N from the
metrics records (step_ms); predicted: the slowest pipeline's predicted_s of the same steps' records.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.common import ROOT, Table, ceiling_fields, print_result

WIKIPEDIA = ROOT.parent / "shared" / "data" / "seqlens" / "wikipedia.txt.gz"
SHIPPED = ROOT / "hetu_ext" / "data" / "samples" / "wikipedia_lengths_20k.txt.gz"
SCALES = (0.25, 16, 0.5, 8, 1, 4, 1, 2)
"""Tenant k's length scale (the first T tenants are used): short and long tenants alternate."""
SIZES = ((16, 4), (32, 6), (64, 8))
MAX_LEN, SAMPLES = 16384, 64
USABLE_BYTES = 0.9 * 80e9
"""Memory a stage may use on an 80 GB GPU (10% kept for the CUDA context, allocator and logits)."""


def predicted(steps: int, cost_model: str | None = None, lengths: str | None = None,
              search: bool = True, cp_degrees: tuple[int, ...] = (1,), gpus_only: tuple[int, ...] | None = None
              ) -> list[dict]:
    from hetu_ext.data.cost import load_cost_table
    from hetu_ext.data.lengths import read_lengths
    from hetu_ext.plan import ModelSpec
    from hetu_ext.plan.lobra import (
        TenantLengths,
        homogeneous_s,
        lobra_cost_model,
        plan_deployment,
        sample_steps,
        sequential_s,
        strategy_pool,
        work_bound_gpu_s,
    )
    from hetu_ext.plan.core.options import PLAIN, search_space

    source = Path(lengths) if lengths else WIKIPEDIA if WIKIPEDIA.is_file() else SHIPPED
    wiki = read_lengths(source)
    pool_lengths = np.random.default_rng(0).choice(wiki, 200_000)
    spec = ModelSpec(num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=11008,
                     vocab_size=32000, seq_length=MAX_LEN)
    table = load_cost_table(cost_model) if cost_model else None
    # the distributed optimizer is moot here (the frozen base has no optimizer state); selective recomputation
    # keeps what none keeps under FlashAttention and adds time: no/full recomputation with sequence parallelism
    options = search_space(("none", "full"), distributed_optimizer=(False,)) if search and table is None else [PLAIN]
    print(f"predicted: LLaMA-7B shape, max length {MAX_LEN}, {SAMPLES} sequences per tenant per step, {steps} "
          f"sampled steps; tenants synthetic from {source.name} x scale {SCALES}; per-layer costs: "
          f"{table.device + ' (' + cost_model + ')' if table is not None else 'FLOP / all-reduce model'}; options "
          f"searched (homogeneous and LobRA alike): {', '.join(o.name for o in options)}")
    rows = []
    shares = Table.of(("gpus", ">4"), ("tenants", ">7"), ("homog.", ">8.1f"), ("h.causal", ">8.1f"),
                      ("h.balanced", ">10.1f"), ("sequential", ">10.1f"), ("lobra", ">8.1f"), ("saving", ">6.1%"),
                      ("gain", ">5.2f", "x"), ("bound", ">8.1f"), ("max sav.", ">8.1%"), ("ceiling", ">6.2f", "x"),
                      ("share", ">6.1%"), tail="deployment (homogeneous)", rule=True)
    shares.print_header()
    for gpus, count in SIZES:
        if gpus_only is not None and gpus not in gpus_only:
            continue
        tenants = [TenantLengths(f"t{k}", np.maximum((pool_lengths * SCALES[k]).astype(np.int64), 1), SAMPLES)
                   for k in range(count)]
        batches = sample_steps(tenants, steps=steps, seed=1, max_len=MAX_LEN)
        per = []
        for opts in options:
            pool = strategy_pool(spec, lobra_cost_model(), gpu_memory_bytes=USABLE_BYTES, gpus_per_node=8,
                                 max_gpus=gpus, table=table, options=opts, cp_degrees=cp_degrees)
            strategy, homo = homogeneous_s(pool, batches, world_size=gpus, max_len=MAX_LEN)
            _, causal = homogeneous_s(pool, batches, world_size=gpus, max_len=MAX_LEN, packing="concat-causal")
            _, balanced = homogeneous_s(pool, batches, world_size=gpus, max_len=MAX_LEN, packing="hetu")
            seq = sequential_s(pool, batches, world_size=gpus, max_len=MAX_LEN)
            best = plan_deployment(pool, batches, world_size=gpus, max_len=MAX_LEN)
            full_pool = strategy_pool(spec, lobra_cost_model(), gpu_memory_bytes=USABLE_BYTES, gpus_per_node=8,
                                      max_gpus=gpus, prune=False, table=table, options=opts, cp_degrees=cp_degrees)
            per.append({"options": opts.name, "homogeneous_gpu_s": homo * gpus, "sequential_gpu_s": seq * gpus,
                        "lobra_gpu_s": best.step_s * gpus, "homogeneous_causal_gpu_s": causal * gpus,
                        "homogeneous_balanced_gpu_s": balanced * gpus, "deployment": best.describe(),
                        "homogeneous_strategy": f"{gpus // strategy.gpus} x {strategy.name}",
                        "bound_gpu_s": work_bound_gpu_s(full_pool, batches, world_size=gpus)})
            if cp_degrees != (1,):  # Megatron's hybrid CP beside the homogeneous replicas
                hybrid = best_hybrid_lora(spec, lobra_cost_model(), opts, batches, gpus=gpus, full_pool=full_pool,
                                          table=table)
                if hybrid is not None:
                    per[-1]["hybrid"] = (hybrid[0], hybrid[1] * gpus)
        homo = min(per, key=lambda r: r["homogeneous_gpu_s"])
        row = dict(min(per, key=lambda r: r["lobra_gpu_s"]))
        row.update(gpus=gpus, tenants=count, lengths=source.name, per_option=per,
                   homogeneous_gpu_s=homo["homogeneous_gpu_s"],
                   homogeneous_strategy=f"{homo['homogeneous_strategy']} {homo['options']}",
                   homogeneous_causal_gpu_s=min(r["homogeneous_causal_gpu_s"] for r in per),
                   homogeneous_balanced_gpu_s=min(r["homogeneous_balanced_gpu_s"] for r in per),
                   sequential_gpu_s=min(r["sequential_gpu_s"] for r in per),
                   bound_gpu_s=min(r["bound_gpu_s"] for r in per))
        row["saving_vs_homogeneous"] = 1 - row["lobra_gpu_s"] / row["homogeneous_gpu_s"]
        row["max_saving_vs_homogeneous"] = 1 - row["bound_gpu_s"] / row["homogeneous_gpu_s"]
        row.update(ceiling_fields(row["homogeneous_gpu_s"], row["lobra_gpu_s"], row["bound_gpu_s"]))
        hybrid = [(r["hybrid"][1], f"{r['hybrid'][0]} {r['options']}") for r in per if r.get("hybrid")]
        if hybrid:  # LobRA's gain over the stronger of the homogeneous replicas and Megatron's hybrid CP
            row.update(hybrid_gpu_s=min(hybrid)[0], hybrid=min(hybrid)[1],
                       gain_over_stronger=min(row["homogeneous_gpu_s"], min(hybrid)[0]) / row["lobra_gpu_s"])
        rows.append(row)
        shares.print_row([gpus, count] + [row[k] for k in (
            "homogeneous_gpu_s", "homogeneous_causal_gpu_s", "homogeneous_balanced_gpu_s", "sequential_gpu_s",
            "lobra_gpu_s", "saving_vs_homogeneous", "gain", "bound_gpu_s", "max_saving_vs_homogeneous", "ceiling",
            "share_of_ceiling")], f"{row['options']}: {row['deployment']} ({row['homogeneous_strategy']})" + (
                f"; hybrid CP {row['hybrid']} {row['hybrid_gpu_s']:.1f} GPU-s, gain over the stronger "
                f"{row['gain_over_stronger']:.3f}x" if "hybrid_gpu_s" in row else ""))
    return rows


def best_hybrid_lora(spec, cost, options, batches: list[list[np.ndarray]], *, gpus: int, full_pool, table=None,
                     gpus_per_node: int = 8) -> tuple[str, float] | None:
    """(``tpT N=...``, mean step seconds) of Megatron's hybrid CP for the LoRA step at its best TP degree and
    ``--max-seqlen-per-dp-cp-rank`` N (from the TP degree's capacity, the unpruned pool's TP x PP1 shape, down by
    halves to 512); every tenant's sequences of a step in one batch; None when no TP degree holds the longest."""
    from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    from benchmarks.hybrid_cp import _Group
    from hetu_ext.plan.cost import hybrid_cp
    from hetu_ext.plan.lobra import layer_cost

    steps = [np.concatenate(step).tolist() for step in batches]
    longest = max(max(step) for step in steps)
    best = None
    for shape in sorted((s for s in full_pool if s.pp == 1 and s.cp == 1), key=lambda s: s.tp):
        tp, capacity = shape.tp, shape.capacity
        if gpus % tp:
            continue
        ranks = gpus // tp
        layer = table.for_tp(tp) if table is not None else layer_cost(spec, cost, tp, options)
        links = hybrid_cp.node_links(tp=tp, gpus_per_node=gpus_per_node, intra_bytes_per_s=cost.intra_node_bytes_per_s,
                                     inter_bytes_per_s=cost.inter_node_bytes_per_s)
        n = capacity
        while n >= 512:
            if hybrid_cp.fits(longest, n, capacity, ranks):
                times = []
                for step in steps:
                    scheduler = BalancedCPScheduler(max_seq_len_per_rank=n, dp_cp_group=_Group(ranks))
                    groups, ids = scheduler.get_groups_and_subsamples(list(enumerate(step)), None)
                    times.append(hybrid_cp.step_seconds(list(zip(groups, ids)), layer, spec, tp=tp,
                                                        num_layers=spec.num_layers, link_for_cp=links))
                t = float(np.mean(times))
                if best is None or t < best[1]:
                    best = (f"tp{tp} N={n}", t)
            n //= 2
    return best


EMULATED_TABLE = {  # per layer, forward + backward; big enough that padding dominates real compute on 2 cores
    "device": "emulated", "device_memory_bytes": 7.0e7,
    "note": "benchmarks/lobra.py: TP 1 holds 165 tokens per microbatch, TP 2 340",
    "per_tp": {1: {"a": 1.2e-5, "b": 9.0e-3, "c": 0.3, "memory_per_token_bytes": 1.0e5,
                   "memory_fixed_bytes": 1.0e6},
               2: {"a": 9.0e-6, "b": 7.5e-3, "c": 0.36, "memory_per_token_bytes": 5.0e4,
                   "memory_fixed_bytes": 5.0e5}}}
EMULATED_TENANTS = [(0.02, 8), (0.25, 2), (0.05, 6)]
"""(length scale of the Wikipedia lengths, sequences per step) of the 3 emulated tenants (synthetic)."""
EMULATED_MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
                  "--seq-length", "256"]


def _emulated_files(tmp: Path) -> tuple[str, str, str]:
    """The cost table, the tenants file and the planner's plan (4 ranks) for the emulated runs."""
    import yaml

    from hetu_ext.data.lengths import read_lengths

    table = tmp / "cost.yaml"
    table.write_text(yaml.safe_dump(EMULATED_TABLE))
    wiki = read_lengths(WIKIPEDIA if WIKIPEDIA.is_file() else SHIPPED)[:20000]
    tenants = []
    for k, (scale, samples) in enumerate(EMULATED_TENANTS):
        lengths = tmp / f"tenant{k}.txt"
        lengths.write_text("\n".join(str(int(v)) for v in np.clip(wiki * scale, 2, 256).astype(int)) + "\n")
        tenants.append({"name": f"t{k}", "lengths": {"mode": "file", "path": str(lengths)}, "documents": 5000,
                        "samples": samples, "lora": {"rank": 4, "alpha": 8}})
    (tmp / "tenants.yaml").write_text(yaml.safe_dump({"tenants": tenants}))
    from hetu_ext.plan.__main__ import main as plan_main

    plan = tmp / "lobra_plan.yaml"
    code = plan_main(["lobra", "--tenants", str(tmp / "tenants.yaml"), "--world-size", "4", "--gpus-per-node", "4",
                      "--cost-model", str(table), *EMULATED_MODEL[:6], "--seq-length", "256", "--steps", "32",
                      "-o", str(plan)])
    assert code == 0
    return str(table), str(tmp / "tenants.yaml"), str(plan)


def emulated(steps: int) -> list[dict]:
    from hetu_ext.metrics import read_records
    from hetu_ext.testing.multiproc import run_ranks
    from hetu_ext.cli.runs import train

    tmp = Path(tempfile.mkdtemp(prefix="lobra_bench_"))
    table, tenants, plan = _emulated_files(tmp)
    (tmp / "homogeneous.yaml").write_text("pipelines:\n" + "".join(
        f"  - num_microbatches: 1\n    stages:\n      - {{ranks: [{2 * k}, {2 * k + 1}], layers: [0, 4]}}\n"
        for k in range(2)))
    rows = []
    print(f"\nemulated: 4 CPU ranks, 3 tenants (synthetic lengths), {steps} steps each, layers padded to {table}")
    for method, plan_file in (("lobra", plan), ("homogeneous", str(tmp / "homogeneous.yaml"))):
        metrics = tmp / f"{method}.jsonl"
        argv = [*EMULATED_MODEL, "--micro-batch-size", "1", "--train-iters", str(steps), "--lr", "1e-3",
                "--hidden-dropout", "0", "--attention-dropout", "0", "--hetu-lora-tenants", tenants,
                "--hetu-plan", plan_file, "--hetu-cost-model", table, "--hetu-emulate-cost", table,
                "--hetu-metrics-file", str(metrics)]
        run_ranks(train, 4, argv, False, timeout=600)
        records = [r for r in read_records(str(metrics)) if r.get("kind") == "step"][1:]  # step 1 warms up
        measured = 4 * float(np.mean([r["step_ms"] for r in records])) / 1e3
        predicted_s = 4 * float(np.mean([max(r["packing"]["predicted_s"]) for r in records]))
        rows.append({"ranks": 4, "method": method, "gpu_s": measured, "predicted_gpu_s": predicted_s,
                     "overruns": sum(r.get("emulation_overruns", 0) or 0 for r in records)})
    errors = Table.of(("method", "<12"), ("measured GPU-s", ">14.3f"), ("predicted GPU-s", ">15.3f"),
                      ("error", ">+7.1%"))
    errors.print_header()
    for row in rows:
        errors.print_row([row["method"], row["gpu_s"], row["predicted_gpu_s"],
                          row["gpu_s"] / row["predicted_gpu_s"] - 1])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="sampled steps of the predicted part")
    parser.add_argument("--emulated-steps", type=int, default=6)
    parser.add_argument("--part", choices=("all", "predicted", "emulated"), default="all")
    parser.add_argument("--cost-model", default=None, help="predicted part: a measured per-layer cost table (YAML, "
                        "python -m hetu_ext.cli.calibrate on the GPU) instead of the FLOP model")
    parser.add_argument("--lengths", default=None, help="predicted part: the length file the tenants' lengths are "
                        "scaled from (default: Wikipedia's)")
    parser.add_argument("--options", choices=("search", "plain"), default="search",
                        help="predicted part: search no/full recomputation with sequence parallelism for the "
                        "homogeneous replicas and LobRA alike; plain: neither")
    parser.add_argument("--cp-degrees", type=lambda s: tuple(int(x) for x in s.split(",")), default=(1,),
                        help="predicted part: context-parallel degrees in the pool of LobRA and of the homogeneous "
                        "baseline alike (1,2,4,8 with CP; the saved rows before issue 48: 1)")
    parser.add_argument("--gpus", type=lambda s: tuple(int(x) for x in s.split(",")), default=None,
                        help=f"predicted part: only these of the sizes {', '.join(str(g) for g, _ in SIZES)} "
                        "(default: all)")
    args = parser.parse_args()
    rows = predicted(args.steps, args.cost_model, args.lengths, args.options == "search", args.cp_degrees,
                     args.gpus) \
        if args.part != "emulated" else []
    emulated_rows = emulated(args.emulated_steps) if args.part != "predicted" else []
    print_result({"predicted": rows, "emulated": emulated_rows})


if __name__ == "__main__":
    main()
