"""Hydraulis, real CPU training: tokens/s of packing methods on the same documents (the "real" part of
benchmarks/packing.py, also runnable alone).

    python benchmarks/packing_real.py [--max-len 4096] [--batch-tokens 32768] [--steps 6] [--rounds 2]

Two ranks train Megatron-core's GPTModel through pretrain_gpt.py's code path with real attention (per-document
causal SDPA on THD packs; no emulated time), first as DP 2, then as PP 2, on documents whose lengths are the real
Wikipedia sample (../shared/data/seqlens/wikipedia.txt.gz, split at the max pack length) with random tokens. The
model is narrow (hidden 64) so that at these lengths attention dominates a layer's time, the regime Hydraulis
targets. Every method sees the same global batches (a token budget per step): ``megatron`` concatenates and cuts
(documents crossing a cut become two pieces, each attending to itself: the issue's "Megatron-style with
per-document attention"), ``megatron_causal`` the same packs with causal attention over the whole pack
(Megatron-LM's default GPTDataset, no --reset-attention-mask), ``greedy`` is DeepSpeed-style greedy by tokens,
``hetu`` is our two-stage length-aware assignment (``--hetu-packing balanced``), whose cost model is calibrated first on this CPU
for this model (``python -m hetu_ext.data.calibrate``). Methods run interleaved, ``--rounds`` times each;
tokens/s is the total tokens over the total time of steps 2..N of every round (step 1 warms up); each round
starts with the next method, so that no method always runs first or last on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WIKIPEDIA = ROOT.parent / "shared" / "data" / "seqlens" / "wikipedia.txt.gz"
METHODS = {"megatron": "concat", "megatron_causal": "concat-causal", "greedy": "greedy", "hetu": "balanced"}
LAYOUTS = {"dp2": (), "pp2": ("--pipeline-model-parallel-size", "2")}
MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 256}


def calibrate(max_len: int, out: str) -> None:
    lengths = ",".join(str(n) for n in (128, 256, 512, 1024, 2048, 4096, 8192) if n <= max_len)
    subprocess.run([sys.executable, "-m", "hetu_ext.data.calibrate", "--out", out, "--hidden-size",
                    str(MODEL["hidden_size"]), "--num-attention-heads", str(MODEL["num_attention_heads"]),
                    "--ffn-hidden-size", str(MODEL["ffn_hidden_size"]), "--seq-lengths", lengths, "--threads", "1"],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL)


def _argv(method: str, layout: str, args: argparse.Namespace, cost: str) -> list[str]:
    model = [x for k, v in MODEL.items() for x in ("--" + k.replace("_", "-"), str(v))]
    return [*model, "--seq-length", str(args.max_len), "--micro-batch-size", "1",
            "--hetu-global-batch-tokens", str(args.batch_tokens), "--train-iters", str(args.steps), "--lr", "1e-4",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "11", "--mock-data",
            "--hetu-varlen-mock", json.dumps({"mode": "file", "path": str(args.lengths)}),
            "--hetu-mock-documents", "50000", "--hetu-packing", method, "--hetu-cost-model", cost,
            *LAYOUTS[layout]]


def _tokens_and_seconds(log_lines: list[str]) -> tuple[float, float]:
    """Tokens and seconds of steps 2..N from Megatron-LM-style log lines (one per step)."""
    tokens = seconds = 0.0
    for line in log_lines[1:]:
        ms = float(re.search(r"elapsed time per iteration \(ms\): ([0-9.]+)", line).group(1))
        rate = float(re.search(r"tokens/s: ([0-9.]+)", line).group(1))
        tokens += rate * ms / 1e3
        seconds += ms / 1e3
    return tokens, seconds


def real_rows(args: argparse.Namespace, log=print) -> list[dict]:
    """``[{"layout", "method", "tokens_per_s"}, ...]`` for DP 2 and PP 2 on 2 CPU ranks."""
    from hetu_ext.testing.multiproc import run_ranks
    from hetu_ext.testing.runs import train

    with tempfile.TemporaryDirectory() as tmp:
        cost = str(Path(tmp) / "cost.yaml")
        calibrate(args.max_len, cost)
        log(f"calibrated {cost}: " + Path(cost).read_text().split("per_tp")[0].replace("\n", " "))
        totals = {(layout, m): [0.0, 0.0] for layout in LAYOUTS for m in METHODS}
        names = list(METHODS)
        for layout in LAYOUTS:
            for r in range(args.rounds):  # each round starts with another method: no method always runs last
                for name in names[r % len(names):] + names[:r % len(names)]:
                    method = METHODS[name]
                    out = run_ranks(train, 2, _argv(method, layout, args, cost), timeout=900)[0]
                    tokens, seconds = _tokens_and_seconds(out["log_lines"])
                    totals[layout, name][0] += tokens
                    totals[layout, name][1] += seconds
    rows = [{"layout": layout, "method": m, "tokens_per_s": round(t / s, 1)} for (layout, m), (t, s) in
            totals.items()]
    log(f"{'layout':<7}{'method':<17}{'tokens/s':>10}{'vs megatron':>13}{'vs megatron_causal':>20}")
    for row in rows:
        base = {m: next(r["tokens_per_s"] for r in rows if r["layout"] == row["layout"] and r["method"] == m)
                for m in ("megatron", "megatron_causal")}
        log(f"{row['layout']:<7}{row['method']:<17}{row['tokens_per_s']:>10.0f}"
            f"{row['tokens_per_s'] / base['megatron']:>12.2f}x{row['tokens_per_s'] / base['megatron_causal']:>19.2f}x")
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-len", type=int, default=4096, help="max pack length (--seq-length), tokens")
    parser.add_argument("--batch-tokens", type=int, default=32768, help="global batch token budget")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--lengths", type=Path, default=WIKIPEDIA)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args()
    print(f"real CPU training: model {MODEL}, max pack {args.max_len} tokens, global batch {args.batch_tokens} "
          f"tokens, {args.steps} steps x {args.rounds} rounds per method and layout, lengths from {args.lengths}")
    rows = real_rows(args)
    print(json.dumps({"real": rows}))


if __name__ == "__main__":
    main()
