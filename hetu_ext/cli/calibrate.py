"""Measure one Megatron-core transformer layer and fit the length cost ``t(s) = a s^2 + b s + c`` (seconds).

    python -m hetu_ext.cli.calibrate --out configs/calibration/cpu.yaml [--hidden-size 256 \\
        --num-attention-heads 8 --seq-lengths 128,256,512,1024,2048,4096 --repeats 5 --tp 1,2 \\
        --tp-efficiency-out configs/calibration/tp_efficiency_cpu.yaml]

Measured: forward + backward of one GPTModel stage holding one transformer layer (no embedding, no output
layer; Megatron-core's local layer spec, built by :func:`hetu_ext.megatron.model.build_gpt_stage`) on a THD pack
holding one document of ``s`` tokens (the attention kernel packed training runs), the fastest of ``--repeats``
runs after a warm-up (lengths interleaved; on a shared machine the fastest run is the least disturbed one), for
each ``s``. The fit (hetu_ext/data/calibrate.py, pure) is linear least squares on ``(s^2, s, 1)`` weighted by
``1 / t`` (relative error); the table printed shows measured and fitted times.

TP 1 is measured in this process. Each TP degree t > 1 is measured too, on t ranks started by the project's
multi-process harness (hetu_ext.testing.multiproc: gloo on CPU), the layer split over them by Megatron's own
tensor parallelism, all-reduces included, and fitted on its own. Memory per token: bytes of the tensors the
layer saves for backward at the longest measured length, divided by it (so it includes the s x s attention
scores the local spec keeps at that length); fixed memory: parameters x (weight + gradient + two Adam moments).

``--tp-efficiency-out FILE`` also writes each measured degree's efficiency ``T_1 / (t T_t)`` at the longest length
(hetu_ext.data.calibrate.save_tp_efficiency), the file the Malleus planner's cost model reads
(hetu_ext.plan.cost.stage.load_tp_efficiency); the same from a stored table: ``python -m hetu_ext.data.calibrate``.

Torch and megatron are imported only to measure (the ``--help`` and argument errors stay fast).
"""

from __future__ import annotations

import argparse
import logging
import platform
import time
from collections.abc import Sequence

from hetu_ext.data.calibrate import Fit, length_cost, save_tp_efficiency
from hetu_ext.data.cost import CostTable, save_cost_table
from hetu_ext.hostlog import quiet_host_frameworks

logger = logging.getLogger(__name__)


def _build_layer(hidden: int, heads: int, ffn: int | None, tp: int = 1):
    """One-layer GPTModel stage (no embedding, no output), split over ``tp`` ranks (the whole process group)."""
    import os
    import tempfile

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from hetu_ext.megatron.host import enable_cpu_support
    from hetu_ext.megatron.model import (
        TrainingNumerics,
        build_gpt_stage,
        transformer_config,
    )
    from hetu_ext.model.spec import ModelSpec

    on_cpu = enable_cpu_support() or not torch.cuda.is_available()
    if not dist.is_initialized():
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="hetu_calib_"), "store"), 1)
        dist.init_process_group("gloo" if on_cpu else "nccl", store=store, rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    spec = ModelSpec(num_layers=1, hidden_size=hidden, num_attention_heads=heads, ffn_hidden_size=ffn,
                     seq_length=8, max_position_embeddings=8)
    numerics = TrainingNumerics(hidden_dropout=0.0, attention_dropout=0.0)
    config = transformer_config(spec, numerics, tp=tp, pp=1, on_cpu=on_cpu)
    model = build_gpt_stage(spec, config, pre_process=False, post_process=False)
    device = torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())
    return model.to(device), device


def measure(hidden: int, heads: int, ffn: int | None, seq_lengths: Sequence[int], repeats: int, tp: int = 1) -> dict:
    """Fastest forward+backward seconds of one layer at each length, saved-activation bytes, parameter count (of
    this rank's share when ``tp`` > 1)."""
    import torch

    model, device = _build_layer(hidden, heads, ffn, tp)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    saved: list[int] = []
    from megatron.core.packed_seq_params import PackedSeqParams

    def step(x: torch.Tensor) -> torch.Tensor:
        # a THD pack of one document: the attention kernel packed training runs (hetu_ext/megatron/attention.py)
        cu = torch.tensor([0, x.shape[0]], dtype=torch.int32, device=device)
        pack = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=x.shape[0],
                               max_seqlen_kv=x.shape[0])
        model.set_input_tensor(x)
        return model(input_ids=None, position_ids=None, attention_mask=None, packed_seq_params=pack)

    inputs = [torch.randn(s, 1, hidden, device=device, requires_grad=True) for s in seq_lengths]  # (S, B, H)
    runs: list[list[float]] = [[] for _ in seq_lengths]
    for x in inputs:
        step(x).sum().backward()  # warm-up
    for _ in range(repeats):  # lengths interleaved, so a burst of load on a shared machine hits them alike
        for k, x in enumerate(inputs):
            sync()
            start = time.perf_counter()
            step(x).sum().backward()
            sync()
            runs[k].append(time.perf_counter() - start)
    seconds = [min(r) for r in runs]  # the least disturbed run
    for s, x in zip(seq_lengths, inputs):
        sizes: list[int] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, out=sizes: out.append(t.numel() * t.element_size())
                                                      or t, lambda t: t):
            step(x)
        saved.append(sum(sizes))
        logger.info("s=%d: %.4f s, %d saved bytes", s, seconds[len(saved) - 1], saved[-1])
    params = sum(p.numel() for p in model.parameters())
    return {"seconds": seconds, "saved_bytes": saved, "params": params, "device": str(device),
            "dtype_bytes": 4}


def _measure_rank(rank: int, world_size: int, *args) -> dict | None:
    """Rank body for TP > 1 (hetu_ext.testing.multiproc.run_ranks): every rank measures, rank 0 reports."""
    m = measure(*args, tp=world_size)
    return m if rank == 0 else None


def calibrate(args: argparse.Namespace) -> tuple[CostTable, dict[int, Fit], dict[int, dict]]:
    """Measure and fit every TP degree of ``--tp``; returns the table, and the fit and measurements per degree."""
    lengths = [int(x) for x in args.seq_lengths.split(",")]
    what = (args.hidden_size, args.num_attention_heads, args.ffn_hidden_size, lengths, args.repeats)
    per_tp, fits, measured = {}, {}, {}
    for tp in sorted({1, *[int(x) for x in args.tp.split(",")]}):
        if tp == 1:
            m = measure(*what)
        else:
            from hetu_ext.testing.multiproc import run_ranks

            m = run_ranks(_measure_rank, tp, *what, timeout=3600)[0]
        per_tp[tp], fits[tp] = length_cost(lengths, m["seconds"], m["saved_bytes"], m["params"], m["dtype_bytes"])
        measured[tp] = m
    device = m["device"] if m["device"] != "cpu" else f"cpu ({platform.processor() or platform.machine()})"
    errors = ", ".join(f"TP {tp}: {fit.max_rel_error:.3f}" for tp, fit in fits.items())
    note = (f"one Megatron-core layer (local spec, fp32, packed attention), hidden {args.hidden_size}, heads "
            f"{args.num_attention_heads}, ffn {args.ffn_hidden_size or 4 * args.hidden_size}; lengths {lengths}; "
            f"fastest of {args.repeats}; every TP degree measured; max relative fit error {errors}")
    return CostTable(per_tp=per_tp, device=device, note=note), fits, measured


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hetu_ext.cli.calibrate", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="YAML file to write the cost table to")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--ffn-hidden-size", type=int, default=None)
    parser.add_argument("--seq-lengths", default="128,256,512,1024,2048,3072,4096",
                        help="comma-separated document lengths (tokens) to measure")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tp", default="1", help="comma-separated TP degrees to measure (t > 1 starts t ranks)")
    parser.add_argument("--tp-efficiency-out", default=None, help="also write the measured TP efficiencies "
                        "(at the longest length) to this YAML file, for the planner's cost model")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    args = parser.parse_args(argv)
    try:
        lengths = sorted({int(x) for x in args.seq_lengths.split(",")})
        [int(x) for x in args.tp.split(",")]
    except ValueError:
        parser.error(f"--seq-lengths {args.seq_lengths!r} / --tp {args.tp!r}: give comma-separated integers")
    if len(lengths) < 3 or lengths[0] < 1:
        parser.error(f"--seq-lengths {args.seq_lengths!r}: the fit a s^2 + b s + c needs at least 3 distinct "
                     "positive lengths; give e.g. 128,256,512")
    quiet_host_frameworks()
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    table, fits, measured = calibrate(args)
    lengths = [int(x) for x in args.seq_lengths.split(",")]
    print(f"device: {table.device}")
    for tp, fit in fits.items():
        print(f"TP {tp} fit: a={fit.a:.4g} s/token^2  b={fit.b:.4g} s/token  c={fit.c:.4g} s")
        print(f"{'tokens':>8} {'measured_s':>12} {'fitted_s':>12} {'rel_err':>8}")
        for s, t, f in zip(lengths, measured[tp]["seconds"], fit.fitted_s):
            print(f"{s:>8} {t:>12.5f} {f:>12.5f} {(f - t) / t:>+8.3f}")
        print(f"max relative error {fit.max_rel_error:.3f}")
    save_cost_table(table, args.out)
    print(f"wrote {args.out}")
    if args.tp_efficiency_out:
        eff = save_tp_efficiency(table, max(lengths), args.tp_efficiency_out, source=args.out)
        print("TP efficiency " + ", ".join(f"TP {tp}: {e:.3f}" for tp, e in eff.items()) + f" at {max(lengths)} "
              f"tokens; wrote {args.tp_efficiency_out}")


if __name__ == "__main__":
    main()
