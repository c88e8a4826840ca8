"""Peak memory of a one-layer training step by sequence length: hetu_ext's score-free attention beside Megatron's.

    python -m benchmarks.attention_memory [--seq-lengths 2048,8192] [--hidden-size 64] [--num-attention-heads 4]
                                          [--vocab-size 256] [--attention-dropout 0]

Each measurement runs in a fresh process (so one run's peak cannot hide another's): a Megatron-core GPTModel of one
transformer layer (embedding, layer, output layer and loss; hetu_ext's :func:`~hetu_ext.megatron.model.build_gpt_stage`,
fp32, batch 1) does one forward and backward on ``s`` tokens; the figure is the process's peak resident set size
(``ru_maxrss``), which includes the interpreter, torch and Megatron-core (the ``base`` column: RSS before the model
is built). Two core attentions (``--hetu-attention``): ``sdpa`` (hetu_ext's default, never materialises the scores)
and ``megatron`` (the local spec's DotProductAttention: ``[b, heads, s, s]`` scores, fp32 softmax and its
dropout, kept for backward).

Dropout 0 by default: on CPU torch's SDPA runs its math kernel when dropout > 0, which materialises the scores
like Megatron's (CUDA's flash kernel takes dropout); ``--attention-dropout 0.1`` shows that. The target (issue 47):
the score-free path's peak grows at most 3x from 2048 to 8192 tokens. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from benchmarks.common import ROOT, Table, print_result

ATTENTIONS = ("megatron", "sdpa")
TARGET_GROWTH = 3.0


def _rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def measure_one(attention: str, seq: int, hidden: int, heads: int, vocab: int, dropout: float) -> dict:
    """One forward + backward in this process; returns the peak RSS (MB) before the model and after the step."""
    import tempfile

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from hetu_ext.megatron.host import enable_cpu_support
    from hetu_ext.megatron.model import TrainingNumerics, build_gpt_stage, transformer_config
    from hetu_ext.model import ModelSpec

    torch.set_num_threads(1)
    enable_cpu_support(True)
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="hetu_attn_mem_"), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1)
    base = _rss_mb()
    spec = ModelSpec(num_layers=1, hidden_size=hidden, num_attention_heads=heads, vocab_size=vocab,
                     seq_length=seq, max_position_embeddings=seq)
    numerics = TrainingNumerics(hidden_dropout=0.0, attention_dropout=dropout, attention=attention)
    model = build_gpt_stage(spec, transformer_config(spec, numerics, tp=1, pp=1, on_cpu=True),
                            pre_process=True, post_process=True)
    tokens = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(0))
    loss = model(tokens, torch.arange(seq)[None], None, labels=tokens).sum()  # (1, s) per-token losses
    loss.backward()
    core = type(model.decoder.layers[0].self_attention.core_attention).__name__
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return {"attention": attention, "core_attention": core, "seq": seq, "base_mb": base, "peak_mb": _rss_mb()}


def _child(args: argparse.Namespace, attention: str, seq: int) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.attention_memory", "--one", attention, str(seq),
           "--hidden-size", str(args.hidden_size), "--num-attention-heads", str(args.num_attention_heads),
           "--vocab-size", str(args.vocab_size), "--attention-dropout", str(args.attention_dropout)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"attention_memory: the {attention} run at {seq} tokens failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.attention_memory", description=__doc__.split("\n")[0])
    p.add_argument("--seq-lengths", default="2048,8192", help="comma-separated tokens per step (batch 1)")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--attention-dropout", type=float, default=0.0)
    p.add_argument("--one", nargs=2, metavar=("ATTENTION", "SEQ"), help=argparse.SUPPRESS)  # a child's measurement
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.seq_lengths.split(",") if x]
    if len(lengths) < 2 or any(s < 1 for s in lengths):
        p.error(f"--seq-lengths {args.seq_lengths}: give at least two positive lengths, e.g. 2048,8192")
    args.lengths = lengths
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.one:
        attention, seq = args.one[0], int(args.one[1])
        print(json.dumps(measure_one(attention, seq, args.hidden_size, args.num_attention_heads, args.vocab_size,
                                     args.attention_dropout)))
        return 0
    print(f"one-layer step (fwd + bwd, fp32, batch 1): hidden {args.hidden_size}, heads {args.num_attention_heads}, "
          f"vocab {args.vocab_size}, attention dropout {args.attention_dropout}; peak RSS per fresh process (MB)")
    runs = {(a, s): _child(args, a, s) for s in args.lengths for a in ATTENTIONS}
    table = Table.of(("seq", ">6"), *((f"{a} peak", ">13.0f") for a in ATTENTIONS),
                     *((f"{a} step", ">13.0f") for a in ATTENTIONS), ("base", ">6.0f"), rule=True)
    table.print_header()
    for s in args.lengths:
        table.print_row([s, *(runs[(a, s)]["peak_mb"] for a in ATTENTIONS),
                         *(runs[(a, s)]["peak_mb"] - runs[(a, s)]["base_mb"] for a in ATTENTIONS),
                         runs[("sdpa", s)]["base_mb"]])
    first, last = args.lengths[0], args.lengths[-1]
    growth = {a: runs[(a, last)]["peak_mb"] / runs[(a, first)]["peak_mb"] for a in ATTENTIONS}
    print(f"growth of the peak from {first} to {last} tokens: "
          + ", ".join(f"{a} {g:.2f}x" for a, g in growth.items())
          + f" (target for sdpa: at most {TARGET_GROWTH:.0f}x); core attentions: "
          + ", ".join(sorted({r["core_attention"] for r in runs.values()})))
    print_result({"benchmark": "attention_memory", "hidden_size": args.hidden_size,
                  "num_attention_heads": args.num_attention_heads, "vocab_size": args.vocab_size,
                  "attention_dropout": args.attention_dropout,
                  "peak_mb": {f"{a}@{s}": round(r["peak_mb"], 1) for (a, s), r in runs.items()},
                  "growth": {a: round(g, 3) for a, g in growth.items()},
                  "target_growth": TARGET_GROWTH, "meets_target": growth["sdpa"] <= TARGET_GROWTH})
    return 0


if __name__ == "__main__":
    sys.exit(main())
