"""Rehearsal of an unchanged Megatron-LM recipe on a machine without CUDA: the flag rewrites.

A recipe written for H100s (Megatron-LM's ``examples/llama/train_llama3_8b_h100_fp8.sh``) asks for kernels a CPU
does not have: Transformer Engine, FP8, Apex's persistent LayerNorm, the CUDA-compiled masked softmax and fused
bias activations, the CUDA profiler. None of them changes what is computed, only how fast; so on CPU the entry point
rewrites the command line itself, before Megatron-LM parses it, and says what it changed in ONE notice on rank 0:

* :data:`CPU_SWITCHES`: flags Megatron-LM needs without CUDA (added when absent: the local layer spec, gloo, every
  fused kernel off);
* :data:`CPU_DROPPED`: flags whose kernel or tool exists only on CUDA (removed with their values; FP8 trains in
  the recipe's bf16).

The numbers are then the recipe's own in fp32/bf16 arithmetic; what remains CUDA-only inside Megatron-LM's
training package is patched (:mod:`hetu_ext.patches.megatron_lm`), and the local spec's torch norms take
zero-centred gamma (``--apply-layernorm-1p``) and sequence parallelism (:mod:`hetu_ext.megatron.norms`).
"""

from __future__ import annotations

from dataclasses import dataclass

from hetu_ext.config.megatron_flags import flag_value

from .moe import CPU_DROPPED as MOE_CPU_DROPPED

CPU_SWITCHES: dict[str, str] = {
    "--transformer-impl": "local",
    "--no-gradient-accumulation-fusion": "",
    "--no-persist-layer-norm": "",
    "--distributed-backend": "gloo",
    "--no-masked-softmax-fusion": "",
    "--no-bias-swiglu-fusion": "",
    "--no-bias-gelu-fusion": "",
    "--no-bias-dropout-fusion": "",
    "--no-rope-fusion": "",
}
"""Flag -> value ("" for a switch) that a CPU run needs; a given value other than this one is replaced."""

CPU_DROPPED: dict[str, tuple[int, str]] = {
    "--fp8-format": (1, "FP8 (Transformer Engine): the recipe's bf16/fp32 arithmetic"),
    "--fp8-recipe": (1, "FP8 (Transformer Engine): the recipe's bf16/fp32 arithmetic"),
    "--fp8-amax-history-len": (1, "FP8 scaling history: no FP8 on CPU"),
    "--fp8-amax-compute-algo": (1, "FP8 scaling: no FP8 on CPU"),
    "--fp8-margin": (1, "FP8 scaling: no FP8 on CPU"),
    "--fp8-param-gather": (0, "FP8 parameter all-gather: parameters gathered in their own dtype"),
    "--fp8-interval": (1, "FP8 scaling: no FP8 on CPU"),
    "--attention-backend": (1, "the local spec's attention (the backend picks among Transformer Engine's kernels)"),
    "--cross-entropy-loss-fusion": (0, "the unfused vocab-parallel cross entropy (same formula)"),
    "--cross-entropy-fusion-impl": (1, "the unfused vocab-parallel cross entropy (same formula)"),
    "--profile": (0, "no CUDA profiler on CPU (--use-pytorch-profiler profiles CPU runs)"),
    "--profile-step-start": (1, "no CUDA profiler on CPU"),
    "--profile-step-end": (1, "no CUDA profiler on CPU"),
    "--profile-ranks": (-1, "no CUDA profiler on CPU"),
    "--tp-comm-overlap": (0, "TP communication overlap is Transformer Engine's (userbuffers)"),
    **MOE_CPU_DROPPED,
}
"""Flag -> (values it takes: 0 a switch, 1 one, -1 until the next flag; what runs instead)."""


@dataclass
class Rewrite:
    argv: list[str]
    added: list[str]
    dropped: list[tuple[str, str]]
    """(the flag as given, with its values; what runs instead)."""

    def notice(self) -> str | None:
        if not self.added and not self.dropped:
            return None
        parts = []
        if self.dropped:
            parts.append("; ".join(f"{flag} -> {instead}" for flag, instead in self.dropped))
        if self.added:
            parts.append("added " + " ".join(self.added))
        return "CPU rehearsal (no CUDA device): " + "; ".join(parts)


def _flag(token: str) -> str:
    return token.split("=", 1)[0]


def _values(argv: list[str], i: int, count: int) -> int:
    """How many tokens after ``argv[i]`` are its values."""
    if "=" in argv[i]:
        return 0
    if count >= 0:
        return count
    n = 0
    while i + 1 + n < len(argv) and not argv[i + 1 + n].startswith("--"):
        n += 1
    return n


def cpu_rewrite(argv: list[str], *, uses_pytorch_profiler: bool | None = None) -> Rewrite:
    """``argv`` (Megatron-LM's flags) for a CPU run: CUDA-only flags dropped, CPU switches added or replaced."""
    if uses_pytorch_profiler is None:
        uses_pytorch_profiler = "--use-pytorch-profiler" in argv
    out, dropped, seen, i = [], [], {}, 0
    while i < len(argv):
        flag = _flag(argv[i])
        if flag in CPU_DROPPED and not (flag.startswith("--profile") and uses_pytorch_profiler):
            count, instead = CPU_DROPPED[flag]
            n = _values(argv, i, count)
            dropped.append((" ".join(argv[i:i + 1 + n]), instead))
            i += 1 + n
            continue
        if flag in CPU_SWITCHES:
            want = CPU_SWITCHES[flag]
            n = 0 if want == "" else _values(argv, i, 1)
            given = argv[i].split("=", 1)[1] if "=" in argv[i] else " ".join(argv[i + 1:i + 1 + n])
            if want and given != want:
                dropped.append((f"{flag} {given}", f"{flag} {want} (CPU)"))
            seen[flag] = True
            out += [flag, want] if want else [flag]
            i += 1 + n
            continue
        out.append(argv[i])
        i += 1
    rope = flag_value(out, "--position-embedding-type") == "rope"
    added = []
    for flag, want in CPU_SWITCHES.items():
        if flag in seen or (flag == "--no-rope-fusion" and not rope):
            continue
        out += [flag, want] if want else [flag]
        added.append(f"{flag} {want}".strip())
    return Rewrite(argv=out, added=added, dropped=dropped)


def handoff_rewrite(argv: list[str]) -> Rewrite:
    """The CPU rewrite of a command line handed to hetu_ext's trainer (``--hetu-plan``, ...): only
    ``--transformer-impl transformer_engine`` becomes ``local``, as in :func:`cpu_rewrite` (the trainer refuses
    Transformer Engine where it cannot run; the other CUDA-only flags it takes itself, in its one notice)."""
    given = flag_value(argv, "--transformer-impl")
    if given in (None, "local"):
        return Rewrite(argv=list(argv), added=[], dropped=[])
    out, i = [], 0
    while i < len(argv):
        flag, eq, _ = argv[i].partition("=")
        if flag == "--transformer-impl":
            out += ["--transformer-impl", "local"]
            i += 1 if eq else 2
            continue
        out.append(argv[i])
        i += 1
    return Rewrite(argv=out, added=[], dropped=[(f"--transformer-impl {given}", "--transformer-impl local (CPU)")])
