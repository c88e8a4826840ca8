"""The Python steps of benchmarks/gpu_check.sh: hetu_ext's trainer on one GPU, measured beside Megatron's local spec
and ``plan predict`` (issue 47). Each subcommand runs in its own process and writes one JSON file:

    python -m benchmarks.gpu_check probe --out FILE            SDPA's kernel per case; packed flex at 32K tokens
    python -m benchmarks.gpu_check train --out FILE [--attention sdpa|megatron] [--packed] [--hotspa]
                                         [--migrate] [--compile] [--loss-chunk-tokens N]
                                         [--recompute selective|full] [--model 1b|tiny]
    python -m benchmarks.gpu_check summary DIR                 the table, the acceptance checks, one JSON line

``train`` runs hetu_ext's trainer in this process (one rank, pretrain_gpt.py's code path: ``build_run`` and
``Trainer.train``) on mock data and reads its metrics records: the median step time of the steps after the first
two (compilation and allocator warm-up), tokens/s, TFLOP/s and MFU as the trainer computes them (its inventory FLOPs,
the device's dense bf16 peak), and ``torch.cuda.max_memory_allocated``. ``--packed``: THD packs of up to
``--seq-length`` tokens (documents of a log-normal length mix); ``--hotspa``: HotSPa with two strategies
of one GPU (short documents and long ones), its switches timed in the step records; ``--migrate``: a TP 1 -> 1
migration to the same one-GPU plan after step 3 (the reshard engine's time). The 1B model is TinyLlama's shape
(22 layers, hidden 2048, 32 heads in 4 query groups, SwiGLU 5632, vocab 32000: 1.10 B parameters).

``summary`` also settles two defaults that need a GPU (:data:`DECISIONS`): ``--hetu-compile`` (run ``hetu_compile``
beside ``hetu``: on by default on CUDA only if the compiled step is at least 5% faster) and
``--hetu-loss-chunk-tokens`` (run ``hetu_loss_chunk`` beside ``hetu``: its peak memory and step time).

``--model tiny`` and a CPU run everything at toy sizes (tests/test_attention_gpu_check.py), so the script's
Python is checked without a GPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import Table, print_result

MODELS = {
    "1b": ["--num-layers", "22", "--hidden-size", "2048", "--ffn-hidden-size", "5632", "--num-attention-heads", "32",
           "--group-query-attention", "--num-query-groups", "4", "--vocab-size", "32000"],
    "tiny": ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
             "--group-query-attention", "--num-query-groups", "2", "--vocab-size", "256"],
}
LLAMA = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights"]
WARMUP_STEPS = 2
TARGETS = {"mfu": 0.35, "speedup_over_local": 2.0, "predict_rel_error": 0.15}
"""Issue 47's acceptance on the device: MFU, tokens/s over the local spec's, step time against plan predict."""
DECISIONS = {"hetu_compile": 1.05}
"""Defaults the device run decides: ``--hetu-compile`` goes on by default on CUDA when the compiled run's median
step is at least this many times faster than the eager one (its compilation, in the first steps, paid once)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_argv(args: argparse.Namespace, workdir: Path, cuda: bool) -> list[str]:
    """pretrain_gpt.py's flags of one ``train`` run."""
    seq = args.seq_length
    argv = [*MODELS[args.model], *LLAMA, "--seq-length", str(seq), "--max-position-embeddings", str(seq),
            "--micro-batch-size", "1", "--train-iters", str(args.iters), "--lr", "1e-4", "--lr-decay-style",
            "constant", "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--hetu-attention", args.attention, "--log-interval", "1",
            "--hetu-metrics-file", str(workdir / "metrics.jsonl")]
    if cuda:
        argv.append("--bf16")
    if args.compile:
        argv.append("--hetu-compile")
    if args.loss_chunk_tokens:
        argv += ["--hetu-loss-chunk-tokens", str(args.loss_chunk_tokens)]
    if args.recompute == "selective":
        argv += ["--recompute-granularity", "selective"]
    elif args.recompute == "full":
        argv += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    if args.packed or args.hotspa:
        lengths = {"mode": "distribution", "type": "lognormal", "min_seq_len": 16, "max_seq_len": seq,
                   "mean_seq_len": max(seq // 8, 8), "lognormal_sigma": 1.0}
        argv += ["--hetu-packing", "balanced", "--hetu-varlen-mock", json.dumps(lengths),
                 "--hetu-mock-documents", "4000", "--hetu-global-batch-tokens", str(seq * args.microbatches)]
    else:
        argv += ["--global-batch-size", str(args.microbatches)]
    if args.hotspa:
        short = max(seq // 4, 16)
        (workdir / "hotspa.yaml").write_text(
            f"home: long\nstrategies:\n  - {{name: short, tp: 1, max_len: {short}}}\n"
            f"  - {{name: long, tp: 1, max_len: {seq}}}\n")
        argv += ["--hetu-hotspa", str(workdir / "hotspa.yaml")]
    if args.migrate:
        layers = MODELS[args.model][MODELS[args.model].index("--num-layers") + 1]
        plan = workdir / "plan.yaml"  # one GPU, every layer: the migration reshards 1 -> 1 (every tensor moves)
        plan.write_text(f"pipelines:\n  - num_microbatches: {args.microbatches}\n    stages:\n"
                        f"      - {{ranks: [0], layers: [0, {layers}]}}\n")
        argv += ["--hetu-plan", str(plan), "--hetu-migrate", f"step=3:plan={plan}"]
    return argv


def run_train(args: argparse.Namespace) -> dict:
    """One trainer run in this process; the figures of its step records."""
    import torch

    from hetu_ext.cli.args import parse_run_config
    from hetu_ext.cli.train import build_run
    from hetu_ext.megatron import host
    from hetu_ext.metrics import read_records

    cuda = torch.cuda.is_available()
    workdir = Path(tempfile.mkdtemp(prefix="hetu_gpu_check_"))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(_free_port()))
    argv = train_argv(args, workdir, cuda)
    report = _ActivationReport()
    logging.getLogger("hetu_ext.megatron.activations").addHandler(report)
    logging.getLogger("hetu_ext.megatron.activations").setLevel(logging.INFO)
    start = time.perf_counter()
    trainer = build_run(parse_run_config(argv))
    built_s = time.perf_counter() - start
    lines: list[str] = []
    trainer.train(log=lines.append)
    core = _core_attention(trainer.model)
    host.shutdown()
    steps = read_records(workdir / "metrics.jsonl", kind="step")
    timed = steps[WARMUP_STEPS:] or steps
    result = {"attention": args.attention, "core_attention": core, "model": args.model, "seq_length": args.seq_length,
              "packed": args.packed or args.hotspa, "hotspa": args.hotspa, "compile": args.compile,
              "loss_chunk_tokens": args.loss_chunk_tokens, "first_step_s": steps[0]["step_ms"] / 1e3,
              "recompute": args.recompute, "device": torch.cuda.get_device_name() if cuda else "cpu",
              "build_s": built_s, "steps": len(steps), "timed_steps": len(timed),
              "step_s": statistics.median(r["step_ms"] for r in timed) / 1e3,
              "tokens_per_step": statistics.median(r["tokens"] for r in timed),
              "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
              "tflops": statistics.median(r["tflops_per_rank"] for r in timed),
              "mfu": statistics.median(r["mfu"] for r in timed) if timed[0].get("mfu") is not None else None,
              "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
              "losses": [r["loss"] for r in steps], "argv": argv}
    migrations = read_records(workdir / "metrics.jsonl", event="migration")
    if migrations:
        result["migration_s"] = [m["seconds"] for m in migrations]
    if args.hotspa:
        result["packing"] = [r.get("packing") for r in steps]
    result["activation_report"] = report.lines  # the first step's measured vs predicted (issue 47's 4th point)
    return result


class _ActivationReport(logging.Handler):
    """Keeps the first step's activation-memory line (hetu_ext.megatron.activations.report_first_step)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _core_attention(model) -> str:
    for module in model.modules():
        if hasattr(module, "core_attention"):
            return type(module.core_attention).__name__
    return "none"


def run_probe(args: argparse.Namespace) -> dict:
    """Which SDPA kernel torch runs for the trainer's [s, b] cases (math = materialised scores), and packed
    attention at ``--pack-tokens``: flex compiled with the cached block mask beside SDPA per document."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from hetu_ext.megatron import flex_packs

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    heads, groups, d, s = (32, 4, 64, args.seq_length) if cuda else (4, 2, 16, 256)
    out: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "sdpa": {}}
    for name, dtype, dropout in (("bf16", torch.bfloat16, 0.0), ("bf16_dropout", torch.bfloat16, 0.1),
                                 ("fp32", torch.float32, 0.0)):
        if not cuda and dtype is torch.bfloat16 and dropout:
            continue
        q = torch.randn(1, heads, s, d, device=device, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(1, groups, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True,
                                                             enable_gqa=True).sum().backward()
        ops = sorted({e.name for e in prof.events() if "scaled_dot_product" in e.name or "attention" in e.name})
        out["sdpa"][name] = {"ops": ops, "math": any("math" in o for o in ops)}
    tokens = args.pack_tokens if cuda else 2048
    lengths = [tokens // 16] * 8 + [tokens // 4] * 2  # 8 short documents and 2 long ones
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    dtype = torch.bfloat16 if cuda else torch.float32
    # flex's backward runs on CUDA only (CPU: the forward, eager, to check this code)
    q = torch.randn(tokens, heads, d, device=device, dtype=dtype, requires_grad=cuda)
    k, v = (torch.randn(tokens, groups, d, device=device, dtype=dtype, requires_grad=cuda) for _ in range(2))
    for name, fn in (("flex", lambda: flex_packs.packed_flex_attention(q, k, v, cu, scale=d ** -0.5,
                                                                      compiled=cuda)),):
        times = []
        for _ in range(4):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            loss = fn().float().sum()
            if cuda:
                loss.backward()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out[name] = {"tokens": tokens, "first_s": times[0], "warm_s": min(times[1:]),
                     "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
                     "masks_cached": len(flex_packs._masks)}
    # another pack layout of the same shape class: its own block mask, no new compilation (seconds if there is)
    cu = torch.tensor([0, *torch.tensor([tokens // 2, tokens // 4, tokens // 4]).cumsum(0).tolist()],
                      dtype=torch.int32, device=device)
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    loss = flex_packs.packed_flex_attention(q, k, v, cu, scale=d ** -0.5, compiled=cuda).float().sum()
    if cuda:
        loss.backward()
        torch.cuda.synchronize()
    out["flex"]["new_layout_s"] = time.perf_counter() - t0
    return out


def summary(directory: Path) -> dict:
    """The table of the runs in ``directory`` (train_*.json; predict.json, hetu-plan predict's output) and issue
    47's acceptance checks."""
    runs = {p.stem.removeprefix("train_"): json.loads(p.read_text()) for p in sorted(directory.glob("train_*.json"))}
    table = Table.of(("run", "<16"), ("attention", "<26"), ("step s", ">8.3f"), ("tokens/s", ">10.0f"),
                     ("TFLOP/s", ">8.1f"), ("MFU", ">6.1%"), ("peak GiB", ">9.2f"), rule=True)
    table.print_header()
    for name, r in runs.items():
        table.print_row([name, r["core_attention"], r["step_s"], r["tokens_per_s"], r["tflops"], r["mfu"] or 0.0,
                         r["peak_memory_gib"] or 0.0])
    checks: dict = {}
    hetu, local = runs.get("hetu"), runs.get("local")
    predict_path = directory / "predict.json"
    if hetu and hetu.get("mfu") is not None:
        checks["mfu"] = {"got": hetu["mfu"], "target": TARGETS["mfu"], "ok": hetu["mfu"] >= TARGETS["mfu"]}
    if hetu and local:
        speedup = hetu["tokens_per_s"] / local["tokens_per_s"]
        checks["speedup_over_local"] = {"got": speedup, "target": TARGETS["speedup_over_local"],
                                        "ok": speedup >= TARGETS["speedup_over_local"], "local_recompute":
                                        local.get("recompute")}
    if hetu and predict_path.exists():
        # hetu-plan predict's output (the step's log lines around it): its final JSON line
        line = [x for x in predict_path.read_text().splitlines() if x.startswith('{"step_s"')][-1]
        predicted = json.loads(line)["step_s"]
        error = abs(hetu["step_s"] - predicted) / predicted
        checks["predict"] = {"measured_s": hetu["step_s"], "predicted_s": predicted, "rel_error": error,
                             "target": TARGETS["predict_rel_error"], "ok": error <= TARGETS["predict_rel_error"]}
    for name, check in checks.items():
        print(f"{name}: {json.dumps(check)}")
    decisions = _decisions(runs)
    for name, decision in decisions.items():
        print(f"decision {name}: {json.dumps(decision)}")
    extra = {name: {k: r[k] for k in ("migration_s",) if k in r} for name, r in runs.items()}
    for name, r in runs.items():  # HotSPa: every switch's seconds (to a compute placement and back home)
        switches = [sw["seconds"] for p in r.get("packing") or [] if p and "hotspa" in p
                    for sw in p["hotspa"].get("switches", [])]
        if switches:
            extra[name]["switch_s"] = switches
    for name, values in extra.items():
        for key, seconds in values.items():
            print(f"{name}: {key} = {', '.join(f'{x:.3f}' for x in seconds)}")
    return {"benchmark": "gpu_check", "runs": {n: {k: r.get(k) for k in ("step_s", "tokens_per_s", "tflops", "mfu",
                                                                      "peak_memory_gib", "core_attention",
                                                                      "activation_report")}
                                               for n, r in runs.items()},
            "checks": checks, "decisions": decisions, "extra": {k: v for k, v in extra.items() if v}}


def _decisions(runs: dict) -> dict:
    """The defaults the device settles, each from a run beside ``hetu`` (the same run but for one flag)."""
    hetu, out = runs.get("hetu"), {}
    compiled, chunked = runs.get("hetu_compile"), runs.get("hetu_loss_chunk")
    if hetu and compiled:
        gain = hetu["step_s"] / compiled["step_s"]
        out["hetu_compile"] = {"eager_step_s": hetu["step_s"], "compiled_step_s": compiled["step_s"], "gain": gain,
                               "first_step_s": [hetu.get("first_step_s"), compiled.get("first_step_s")],
                               "min_gain": DECISIONS["hetu_compile"],
                               "default_on_cuda": "on" if gain >= DECISIONS["hetu_compile"] else "off"}
    if hetu and chunked:
        out["hetu_loss_chunk_tokens"] = {
            "chunk": chunked.get("loss_chunk_tokens"), "step_s": [hetu["step_s"], chunked["step_s"]],
            "peak_memory_gib": [hetu.get("peak_memory_gib"), chunked.get("peak_memory_gib")],
            "time_cost": chunked["step_s"] / hetu["step_s"] - 1}
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("train", "probe"):
        s = sub.add_parser(name)
        s.add_argument("--out", required=True, help="the JSON file to write")
        s.add_argument("--model", choices=tuple(MODELS), default="1b")
        s.add_argument("--seq-length", type=int, default=4096)
        s.add_argument("--attention", choices=("sdpa", "megatron"), default="sdpa")
        s.add_argument("--iters", type=int, default=8)
        s.add_argument("--microbatches", type=int, default=4, help="microbatches (or packs' worth of tokens) a step")
        s.add_argument("--packed", action="store_true")
        s.add_argument("--hotspa", action="store_true")
        s.add_argument("--migrate", action="store_true")
        s.add_argument("--compile", action="store_true")
        s.add_argument("--loss-chunk-tokens", type=int, default=0, help="--hetu-loss-chunk-tokens")
        s.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
        s.add_argument("--pack-tokens", type=int, default=32768)
    s = sub.add_parser("summary")
    s.add_argument("directory", type=Path)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "summary":
        print_result(summary(args.directory))
        return 0
    result = run_train(args) if args.command == "train" else run_probe(args)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({k: v for k, v in result.items() if k not in ("argv", "losses", "packing")}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
