"""The kernels the step-time model prices, measured on one GPU: bf16 GEMM efficiency by size, HBM bandwidth, and the
packed (THD, document-causal) attention kernels of hetu_ext.megatron.attention.

    python -m benchmarks.gpu_kernels [--base-profile h100-sxm] [--profile-out FILE] [--json-out FILE]

* **GEMM**: ``(n x n) @ (n x n)`` in bf16 for n = 256 .. 16384 (size = n = (m n k)^(1/3), the profile's key),
  CUDA-event timed, the mean of ``--repeats`` after warm-ups; efficiency = FLOP/s / the base profile's peak.
* **HBM**: a copy of 2 GiB, bytes read + written per second.
* **packed attention**: forward + backward of one pack of ``--pack-tokens`` tokens (32 heads of 128) holding 1, 4
  or 16 equal documents, each attending causally to itself: torch's SDPA per document (the flash kernel), and
  FlexAttention with the document-causal block mask, eager (what hetu_ext.megatron.attention calls) and compiled.
  Per kernel, the time over ``sum s_i^2`` shows whether it does only each document's own square.

``--profile-out`` writes a device profile: the base profile with the measured GEMM curve and HBM bandwidth (an
isolated kernel's efficiency: an upper bound of what it sustains inside training). Prints a table, ends with one
JSON line. Needs CUDA (``--allow-cpu`` runs tiny sizes on the CPU, to check the script itself).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import yaml

from benchmarks.common import print_result, result_line
from hetu_ext.plan.cost.devices import DEVICES_DIR


def _timer(device: torch.device):
    """Seconds of ``fn()`` (mean of ``repeats`` after ``warmup``), CUDA events on a GPU, perf_counter on a CPU."""
    def timed(fn, repeats: int, warmup: int = 2) -> float:
        for _ in range(warmup):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3 / repeats
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - t0) / repeats
    return timed


def gemm_curve(sizes: list[int], peak: float, device: torch.device, repeats: int) -> dict[int, float]:
    timed, dtype = _timer(device), torch.bfloat16
    out = {}
    for n in sizes:
        a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
        seconds = timed(lambda: a @ b, repeats)
        out[n] = 2.0 * n ** 3 / seconds / peak
        print(f"gemm  n={n:>6}  {2.0 * n ** 3 / seconds / 1e12:8.1f} TFLOP/s  efficiency {out[n]:.3f}")
    return out


def hbm_bytes_per_s(device: torch.device, nbytes: int, repeats: int) -> float:
    x = torch.empty(nbytes // 2, device=device, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    seconds = _timer(device)(lambda: y.copy_(x), repeats)
    rate = 2 * x.numel() * 2 / seconds
    print(f"hbm   copy of {nbytes / 2**30:.2f} GiB: {rate / 1e12:.2f} TB/s (read + written)")
    return rate


def packed_attention(tokens: int, heads: int, head_dim: int, docs_list: list[int], device: torch.device,
                     repeats: int) -> list[dict]:
    """fwd+bwd seconds of each kernel on a pack of ``tokens`` split into ``docs`` equal documents."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    timed, dtype = _timer(device), torch.bfloat16 if device.type == "cuda" else torch.float32
    compiled = torch.compile(flex_attention) if device.type == "cuda" else None
    if device.type != "cuda":
        create_block_mask = None  # noqa: F811 - no FlexAttention on CPU
    rows = []
    for docs in docs_list:
        s = tokens // docs
        q, k, v = (torch.randn(1, heads, tokens, head_dim, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        ids = torch.arange(tokens, device=device) // s

        def document_causal(b, h, qi, ki):
            return (ids[qi] == ids[ki]) & (qi >= ki)

        mask = None if create_block_mask is None else create_block_mask(document_causal, B=None, H=None,
                                                                        Q_LEN=tokens, KV_LEN=tokens, device=device)

        def sdpa():
            outs = [torch.nn.functional.scaled_dot_product_attention(
                q[:, :, i * s:(i + 1) * s], k[:, :, i * s:(i + 1) * s], v[:, :, i * s:(i + 1) * s], is_causal=True)
                for i in range(docs)]
            torch.cat(outs, dim=2).sum().backward()

        kernels = {"sdpa_per_document": sdpa}
        if device.type == "cuda":  # FlexAttention has no backward on CPU
            kernels["flex_eager"] = lambda: flex_attention(q, k, v, block_mask=mask).sum().backward()
            kernels["flex_compiled"] = lambda: compiled(q, k, v, block_mask=mask).sum().backward()
        for name, fn in kernels.items():
            failure = ""
            try:
                seconds = timed(fn, repeats)
            except (RuntimeError, NotImplementedError) as exc:  # out of memory, a kernel that fails to compile
                seconds, failure = float("nan"), f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            sum_sq = docs * s * s
            rows.append({"kernel": name, "tokens": tokens, "documents": docs, "seconds": seconds,
                         "ns_per_sum_sq": seconds / sum_sq * 1e9, "failure": failure})
            print(f"attn  {name:<18} {tokens} tokens in {docs:>2} documents: {seconds * 1e3:9.3f} ms  "
                  f"{seconds / sum_sq * 1e9:.4f} ns per (query, key) pair of sum s_i^2 {failure}")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-profile", default=None, help="shipped profile (default: from the GPU's name)")
    parser.add_argument("--profile-out", default=None, help="write the measured device profile (YAML) here")
    parser.add_argument("--json-out", default=None, help="also write the final JSON here")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--pack-tokens", type=int, default=16384)
    parser.add_argument("--allow-cpu", action="store_true", help="tiny sizes on the CPU (checks the script)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.allow_cpu:
        print("error: no CUDA device (torch.cuda.is_available() is False); run on a GPU machine, or pass "
              "--allow-cpu to check the script with tiny sizes", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    base = args.base_profile or ("h200" if "H200" in gpu else "a100-80gb-sxm" if "A100" in gpu else "h100-sxm")
    profile = yaml.safe_load((DEVICES_DIR / f"{base}.yaml").read_text())
    peak = float(profile["peak_flops"])
    tiny = device.type == "cpu"
    print(f"device {gpu}; base profile {base} (peak {peak / 1e12:.0f} TFLOP/s); torch {torch.__version__}")
    sizes = [64, 128] if tiny else [256, 512, 1024, 2048, 4096, 8192, 16384]
    curve = gemm_curve(sizes, peak, device, 2 if tiny else args.repeats)
    hbm = hbm_bytes_per_s(device, 2**20 if tiny else 2**31, 2 if tiny else args.repeats)
    tokens = 256 if tiny else args.pack_tokens
    attention = packed_attention(tokens, 2 if tiny else 32, 16 if tiny else 128, [1, 4, 16], device,
                                 1 if tiny else max(2, args.repeats // 3))
    result = {"device": gpu, "base_profile": base, "gemm_efficiency": curve, "hbm_bytes_per_s": hbm,
              "packed_attention": attention, "torch": torch.__version__}
    if args.profile_out:
        measured = dict(profile, name=f"{profile['name']} (measured)", hbm_bytes_per_s=hbm,
                        gemm_efficiency={int(n): min(1.0, max(1e-4, round(e, 4))) for n, e in curve.items()},
                        note=f"measured by benchmarks/gpu_kernels.py on {gpu}, torch {torch.__version__}: "
                             "isolated bf16 GEMMs (an upper bound of the efficiency inside training) and a "
                             f"2 GiB copy; links and the rest from {base}.yaml")
        Path(args.profile_out).write_text(yaml.safe_dump(measured, sort_keys=False))
        print(f"wrote {args.profile_out}")
    if args.json_out:
        Path(args.json_out).write_text(result_line(result) + "\n")
    print_result(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
