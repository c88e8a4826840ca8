"""Peak memory and time of a training step's loss at a large vocabulary: the loss over token chunks
(``--hetu-loss-chunk-tokens``) beside Megatron's whole-microbatch loss.

    python -m benchmarks.loss_memory [--seq-lengths 2048,4096] [--chunks 0,1024] [--hidden-size 256]
                                     [--vocab-size 131072]

Each measurement runs in a fresh process (so one run's peak cannot hide another's): a Megatron-core GPTModel of one
transformer layer (hetu_ext's :func:`~hetu_ext.megatron.model.build_gpt_stage`, fp32, batch 1, untied output
layer, dropout 0) does one forward and backward on ``s`` tokens. Figures: the process's peak resident set size
(``ru_maxrss``; the ``base`` column is the RSS before the model is built: interpreter, torch, Megatron-core) and the
step's wall time (one thread). Chunk 0 is Megatron's path: the output layer over the whole microbatch, its
``[s, vocab]`` fp32 logits and the cross entropy's fp32 softmax kept for backward. Chunk ``C``: ``C`` tokens at a
time, each recomputed in backward, so one chunk's logits and softmax exist at a time (and the output GEMM runs once
more). The vocabulary's ``131072`` is Llama 3's 128,256 padded. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from benchmarks.common import ROOT, Table, print_result


def _rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def measure_one(chunk: int, seq: int, hidden: int, vocab: int) -> dict:
    """One forward + backward in this process: peak RSS (MB) before the model and after the step, step seconds."""
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
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="hetu_loss_mem_"), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1)
    base = _rss_mb()
    spec = ModelSpec(num_layers=1, hidden_size=hidden, num_attention_heads=4, vocab_size=vocab, seq_length=seq,
                     max_position_embeddings=seq, make_vocab_size_divisible_by=128,
                     untie_embeddings_and_output_weights=True)
    numerics = TrainingNumerics(hidden_dropout=0.0, attention_dropout=0.0, loss_chunk_tokens=chunk)
    model = build_gpt_stage(spec, transformer_config(spec, numerics, tp=1, pp=1, on_cpu=True),
                            pre_process=True, post_process=True)
    tokens = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    loss = model(tokens, torch.arange(seq)[None], None, labels=tokens.roll(-1, 1))  # (1, s) per-token losses
    loss.sum().backward()
    seconds = time.perf_counter() - start
    out = {"chunk": chunk, "model": type(model).__name__, "seq": seq, "base_mb": base, "peak_mb": _rss_mb(),
           "seconds": seconds, "loss": float(loss.sum()), "grad_norm": float(model.output_layer.weight.grad.norm())}
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return out


def _child(args: argparse.Namespace, chunk: int, seq: int) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.loss_memory", "--one", str(chunk), str(seq),
           "--hidden-size", str(args.hidden_size), "--vocab-size", str(args.vocab_size)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"loss_memory: the run of chunk {chunk} at {seq} tokens failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _ints(p: argparse.ArgumentParser, flag: str, text: str, least: int) -> list[int]:
    values = [int(x) for x in text.split(",") if x]
    if not values or any(v < least for v in values):
        p.error(f"{flag} {text}: give comma-separated integers >= {least}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.loss_memory", description=__doc__.split("\n")[0])
    p.add_argument("--seq-lengths", default="2048,4096", help="comma-separated tokens per step (batch 1)")
    p.add_argument("--chunks", default="0,1024", help="comma-separated --hetu-loss-chunk-tokens (0: Megatron's)")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=131072)
    p.add_argument("--one", nargs=2, type=int, metavar=("CHUNK", "SEQ"), help=argparse.SUPPRESS)  # a child's run
    args = p.parse_args(argv)
    args.lengths = _ints(p, "--seq-lengths", args.seq_lengths, 1)
    args.chunk_list = _ints(p, "--chunks", args.chunks, 0)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.one:
        print(json.dumps(measure_one(args.one[0], args.one[1], args.hidden_size, args.vocab_size)))
        return 0
    print(f"one-layer step (fwd + bwd, fp32, batch 1, one thread): hidden {args.hidden_size}, vocab "
          f"{args.vocab_size} (untied output layer); peak RSS per fresh process (MB) and step seconds")
    runs = {(c, s): _child(args, c, s) for s in args.lengths for c in args.chunk_list}
    table = Table.of(("seq", ">6"), ("chunk", ">6"), ("peak MB", ">9.0f"), ("step MB", ">9.0f"),
                     ("logits MB", ">10.0f"), ("step s", ">8.2f"), ("loss rel. diff", ">15.1e"), rule=True)
    table.print_header()
    for s in args.lengths:
        ref = runs[(args.chunk_list[0], s)]
        for c in args.chunk_list:
            r = runs[(c, s)]
            table.print_row([s, c, r["peak_mb"], r["peak_mb"] - r["base_mb"], s * args.vocab_size * 4 / 2**20,
                             r["seconds"], abs(r["loss"] - ref["loss"]) / abs(ref["loss"])])
    print_result({"benchmark": "loss_memory", "hidden_size": args.hidden_size, "vocab_size": args.vocab_size,
                  "peak_mb": {f"chunk{c}@{s}": round(r["peak_mb"], 1) for (c, s), r in runs.items()},
                  "step_mb": {f"chunk{c}@{s}": round(r["peak_mb"] - r["base_mb"], 1) for (c, s), r in runs.items()},
                  "seconds": {f"chunk{c}@{s}": round(r["seconds"], 3) for (c, s), r in runs.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
