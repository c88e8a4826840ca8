"""Hydraulis, real CPU training: tokens/s of packing methods on the same documents (the "real" part of
benchmarks/packing.py, also runnable alone).

    python -m benchmarks.packing_real [--max-len 4096] [--batch-tokens 32768] [--steps 6] [--rounds 2]

Two ranks train Megatron-core's GPTModel through pretrain_gpt.py's code path with real attention (per-document
causal SDPA on THD packs; no emulated time), first as DP 2, then as PP 2, on documents whose lengths are the real
Wikipedia sample (../shared/data/seqlens/wikipedia.txt.gz, split at the max pack length) with random tokens. The
model is narrow (hidden 64) so that at these lengths attention dominates a layer's time, the regime Hydraulis
targets. Every method sees the same global batches (a token budget per step): ``megatron`` concatenates and cuts
(documents crossing a cut become two pieces, each attending to itself: the issue's "Megatron-style with
per-document attention"), ``megatron_causal`` the same packs with causal attention over the whole pack
(Megatron-LM's default GPTDataset, no --reset-attention-mask), ``greedy`` is DeepSpeed-style greedy by tokens,
``hetu`` is our two-stage length-aware assignment (``--hetu-packing balanced``), whose cost model is calibrated
first on this CPU for this model (``python -m hetu_ext.cli.calibrate``). Methods run interleaved,
``--rounds`` times each; tokens/s is the total tokens over the total time of steps 2..N of every round (step 1
warms up); each round starts with the next method, so that no method always runs first or last on a shared
machine.

Beside the measurement, the calibrated cost model prices the very microbatches each method ran (the trainer's
PackedSteps on the same corpus): its predicted ratio to megatron, its total work relative to megatron's (megatron's
cuts shorten documents, and attention work is quadratic in a document's length), and a ceiling: megatron's
predicted time over a perfect split of the method's work across the 2 ranks, which no assignment of the method's
sequences can beat (for PP 2 a loose one: it ignores the pipeline's fill and drain, at least the forward and
backward of the costliest document on one stage). ``--predict-only`` prints these for a grid of max pack lengths
and batches, without training.

    python -m benchmarks.packing_real --predict-only [--grid-steps 30]
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import ROOT, print_result

WIKIPEDIA = ROOT.parent / "shared" / "data" / "seqlens" / "wikipedia.txt.gz"
METHODS = {"megatron": "concat", "megatron_causal": "concat-causal", "greedy": "greedy", "hetu": "balanced"}
LAYOUTS = {"dp2": (), "pp2": ("--pipeline-model-parallel-size", "2")}
SEED, MOCK_DOCUMENTS = 11, 50000
MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 256}


def calibrate(max_len: int, out: str) -> None:
    lengths = ",".join(str(n) for n in (128, 256, 512, 1024, 2048, 4096, 8192) if n <= max_len)
    subprocess.run([sys.executable, "-m", "hetu_ext.cli.calibrate", "--out", out, "--hidden-size",
                    str(MODEL["hidden_size"]), "--num-attention-heads", str(MODEL["num_attention_heads"]),
                    "--ffn-hidden-size", str(MODEL["ffn_hidden_size"]), "--seq-lengths", lengths, "--threads", "1"],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL)


def _argv(method: str, layout: str, args: argparse.Namespace, cost: str) -> list[str]:
    model = [x for k, v in MODEL.items() for x in ("--" + k.replace("_", "-"), str(v))]
    return [*model, "--seq-length", str(args.max_len), "--micro-batch-size", "1",
            "--hetu-global-batch-tokens", str(args.batch_tokens), "--train-iters", str(args.steps), "--lr", "1e-4",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", str(SEED), "--mock-data",
            "--hetu-varlen-mock", json.dumps({"mode": "file", "path": str(args.lengths)}),
            "--hetu-mock-documents", str(MOCK_DOCUMENTS), "--hetu-packing", method, "--hetu-cost-model", cost,
            *LAYOUTS[layout]]


def _tokens_and_seconds(metrics: Path) -> tuple[float, float]:
    """Tokens and seconds of steps 2..N from the run's metrics records."""
    from hetu_ext.metrics import read_records

    steps = read_records(metrics, kind="step")[1:]
    return float(sum(r["tokens"] for r in steps)), sum(r["step_ms"] for r in steps) / 1e3


@functools.cache
def _documents(lengths: str):
    """The training run's corpus (--hetu-varlen-mock file form, its seed and count): read once per length file
    (--predict-only prices a whole grid on it)."""
    from hetu_ext.megatron.packed_data import varlen_mock_documents

    return varlen_mock_documents(json.dumps({"mode": "file", "path": lengths}), vocab_size=2, seed=SEED,
                                 count=MOCK_DOCUMENTS)


def predicted(args: argparse.Namespace, cost_path: str) -> dict[tuple[str, str], dict]:
    """(layout, method) -> the calibrated cost model's view of the steps the real run takes: ``step_s`` (sum over
    steps 2..N of the slowest pipeline's predicted 1F1B time), ``work_s`` (the same steps' total predicted work,
    all pipelines, a pipeline's stages summed) and ``attention`` (the share of a*s^2 in it).

    The microbatches are the trainer's own (PackedSteps.plan_step on the same corpus, seed and token budget);
    ``megatron_causal`` prices a pack as one span (its causal attention covers the whole pack)."""
    from hetu_ext.data.cost import load_cost_table
    from hetu_ext.plan.core.replicas import replica_specs
    from hetu_ext.data.sequences import GlobalBatches, SequenceTable
    from hetu_ext.megatron.packed_data import PackedSteps
    from hetu_ext.model.spec import ModelSpec
    from hetu_ext.plan.core.plan import uniform_plan

    docs = _documents(str(args.lengths))
    table = SequenceTable.from_documents(docs.token_counts, args.max_len)
    spec = ModelSpec(**MODEL, seq_length=args.max_len)
    cost = load_cost_table(cost_path)
    out = {}
    for layout, flags in LAYOUTS.items():
        pp = int(flags[1]) if flags else 1
        replicas = replica_specs(uniform_plan(world_size=2, pp=pp, num_layers=MODEL["num_layers"]), spec, cost,
                                 max_pack_tokens=args.max_len)
        for name, method in METHODS.items():
            steps = PackedSteps(docs, table, GlobalBatches(table, seed=SEED, tokens=args.batch_tokens),
                                method=method, replicas=replicas, pipeline=0, max_len=args.max_len, device=None)
            step_s = work_s = attention_s = 0.0
            for g in range(1, args.steps):
                per = steps.plan_step(g)[1]
                times = []
                for replica, microbatches in zip(replicas, per):
                    mbs = [[n for *_, n in mb] for mb in microbatches]
                    sq = [sum(mb) ** 2 if method == "concat-causal" else sum(n * n for n in mb) for mb in mbs]
                    t = [replica.microbatch_s(q, sum(mb)) for q, mb in zip(sq, mbs)]
                    times.append(sum(t) + (replica.pp - 1) * max(t))
                    work_s += sum(c.moments_s(q, sum(mb)) for c in replica.stage_costs for q, mb in zip(sq, mbs))
                    attention_s += sum(c.a * q for c in replica.stage_costs for q in sq)
                step_s += max(times)
            steps.close()
            out[layout, name] = {"step_s": step_s, "work_s": work_s, "attention": attention_s / work_s}
    return out


def real_rows(args: argparse.Namespace, log=print) -> list[dict]:
    """``[{"layout", "method", "tokens_per_s"}, ...]`` for DP 2 and PP 2 on 2 CPU ranks."""
    from hetu_ext.testing.multiproc import run_ranks
    from hetu_ext.cli.runs import train

    with tempfile.TemporaryDirectory() as tmp:
        cost = str(Path(tmp) / "cost.yaml")
        calibrate(args.max_len, cost)
        log(f"calibrated {cost}: " + Path(cost).read_text().split("per_tp")[0].replace("\n", " "))
        model = predicted(args, cost)
        totals = {(layout, m): [0.0, 0.0] for layout in LAYOUTS for m in METHODS}
        names = list(METHODS)
        for layout in LAYOUTS:
            for r in range(args.rounds):  # each round starts with another method: no method always runs last
                for name in names[r % len(names):] + names[:r % len(names)]:
                    method = METHODS[name]
                    metrics = Path(tmp) / f"{layout}_{name}_{r}.jsonl"
                    run_ranks(train, 2, _argv(method, layout, args, cost) + ["--hetu-metrics-file", str(metrics)],
                              False, timeout=900)
                    tokens, seconds = _tokens_and_seconds(metrics)
                    totals[layout, name][0] += tokens
                    totals[layout, name][1] += seconds
    rows = [{"layout": layout, "method": m, "tokens_per_s": round(t / s, 1),
             "predicted_vs_megatron": round(model[layout, "megatron"]["step_s"] / model[layout, m]["step_s"], 3),
             "work_vs_megatron": round(model[layout, m]["work_s"] / model[layout, "megatron"]["work_s"], 3),
             "attention_share": round(model[layout, m]["attention"], 3),
             "ceiling_vs_megatron": round(model[layout, "megatron"]["step_s"] / (model[layout, m]["work_s"] / 2), 3)}
            for (layout, m), (t, s) in totals.items()]
    log("measured tokens/s, and the calibrated cost model's prediction for the same microbatches: predicted = "
        "megatron's predicted time / the method's; work = the method's total predicted work / megatron's; attn = "
        "a*s^2 share of the work; ceiling = the speedup over megatron's predicted time of a perfect split of the "
        "method's work over the 2 ranks")
    log(f"{'layout':<7}{'method':<17}{'tokens/s':>10}{'vs megatron':>13}{'vs megatron_causal':>20}"
        f"{'predicted':>11}{'work':>7}{'attn':>6}{'ceiling':>9}")
    for row in rows:
        base = {m: next(r["tokens_per_s"] for r in rows if r["layout"] == row["layout"] and r["method"] == m)
                for m in ("megatron", "megatron_causal")}
        log(f"{row['layout']:<7}{row['method']:<17}{row['tokens_per_s']:>10.0f}"
            f"{row['tokens_per_s'] / base['megatron']:>12.2f}x{row['tokens_per_s'] / base['megatron_causal']:>19.2f}x"
            f"{row['predicted_vs_megatron']:>10.2f}x{row['work_vs_megatron']:>7.2f}{row['attention_share']:>6.2f}"
            f"{row['ceiling_vs_megatron']:>8.2f}x")
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-len", type=int, default=4096, help="max pack length (--seq-length), tokens")
    parser.add_argument("--batch-tokens", type=int, default=32768, help="global batch token budget")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--lengths", type=Path, default=WIKIPEDIA)


def predict_grid(args: argparse.Namespace) -> list[dict]:
    """``--predict-only``: no training; the calibrated cost model's ratios for a grid of max pack lengths and
    global batches (``--grid-steps`` steps each), to see where on 2 ranks any method could beat Megatron-style
    packing at all (the ``ceiling`` column bounds every assignment of a method's sequences)."""
    lens = (4096, 8192, 16384)
    with tempfile.TemporaryDirectory() as tmp:
        cost = str(Path(tmp) / "cost.yaml")
        calibrate(max(lens), cost)
        print(f"calibrated {cost}: " + Path(cost).read_text().split("per_tp")[0].replace("\n", " "))
        rows = []
        print(f"{'max_len':>8}{'batch':>8} {'layout':<7}{'method':<17}{'predicted':>10}{'work':>7}{'attn':>6}"
              f"{'ceiling':>9}")
        for max_len in lens:
            for packs in (2, 4, 8):
                grid = argparse.Namespace(max_len=max_len, batch_tokens=packs * max_len, steps=args.grid_steps + 1,
                                          lengths=args.lengths)
                model = predicted(grid, cost)
                for (layout, m), v in model.items():
                    meg = model[layout, "megatron"]
                    row = {"max_len": max_len, "batch_tokens": grid.batch_tokens, "layout": layout, "method": m,
                           "predicted_vs_megatron": round(meg["step_s"] / v["step_s"], 3),
                           "work_vs_megatron": round(v["work_s"] / meg["work_s"], 3),
                           "attention_share": round(v["attention"], 3),
                           "ceiling_vs_megatron": round(meg["step_s"] / (v["work_s"] / 2), 3)}
                    rows.append(row)
                    print(f"{max_len:>8}{grid.batch_tokens:>8} {layout:<7}{m:<17}"
                          f"{row['predicted_vs_megatron']:>9.2f}x{row['work_vs_megatron']:>7.2f}"
                          f"{row['attention_share']:>6.2f}{row['ceiling_vs_megatron']:>8.2f}x")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.add_argument("--predict-only", action="store_true",
                        help="no training: the cost model's ratios over a grid of max pack lengths and batches")
    parser.add_argument("--grid-steps", type=int, default=30, help="steps per grid point (--predict-only)")
    args = parser.parse_args()
    if args.predict_only:
        print_result({"predicted": predict_grid(args)})
        return
    print(f"real CPU training: model {MODEL}, max pack {args.max_len} tokens, global batch {args.batch_tokens} "
          f"tokens, {args.steps} steps x {args.rounds} rounds per method and layout, lengths from {args.lengths}")
    rows = real_rows(args)
    print_result({"real": rows})


if __name__ == "__main__":
    main()
