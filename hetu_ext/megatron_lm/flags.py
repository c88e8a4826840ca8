"""The ``--hetu-*`` flags of a Megatron-LM command line: split off, parsed by hetu_ext's typed configuration and
checked together with the Megatron-LM flags they depend on, before anything is imported or launched.

Megatron-LM's ``pretrain_gpt.py`` parses its own flags (its ``extra_args_provider`` is the script's, and
``--yaml-cfg`` replaces the namespace), so the ``--hetu-*`` flags are taken out of ``argv`` here; Megatron-LM sees
its own flags only. Each ``--hetu-*`` flag is the field of :mod:`hetu_ext.config.schema` that
``launch/pretrain_gpt.py`` takes too (same name, type, choices and help).

Two modes:

* **megatron** (the default): Megatron-LM's own loop runs; the flags ask for hooks on its patch points
  (:mod:`.hooks`): hetu checkpoints, straggler measurement with per-data-parallel-rank microbatch weighting.
* **handoff**: ``--hetu-plan``, ``--hetu-runtime plan``, ``--hetu-straggler-replan online``, ``--hetu-migrate`` or
  ``--hetu-packing`` (other than off) need what Megatron-LM's uniform grid cannot hold; the run goes to hetu_ext's
  trainer (:mod:`.handoff`), which is given the same command line. Megatron-LM flags it does not support are refused
  by name.

Bad input raises :class:`ValueError` with one line naming the flag, the value and the fix; the entry point prints
it and exits 2.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from hetu_ext.config import SECTIONS, FlagParser
from hetu_ext.config.megatron_flags import flag_value
from hetu_ext.config.parse import add_section_flags

from .moe import ckpt_problem as moe_ckpt_problem
from .moe import weighting_problem as moe_weighting_problem
from .rehearsal import cpu_rewrite, handoff_rewrite

PROG = "hetu_ext.megatron_lm"
HETU_PREFIX = "--hetu-"

NATIVE_FLAGS = ("--hetu-cpu-patches", "--hetu-ckpt-format", "--hetu-ckpt-keep", "--hetu-ckpt-fallback",
                "--hetu-ckpt-read", "--hetu-straggler-interval", "--hetu-straggler-threshold",
                "--hetu-straggler-min-change", "--hetu-straggler-window", "--hetu-emulate-slowdown",
                "--hetu-emulate-layer-ms", "--hetu-packing", "--hetu-global-batch-tokens", "--hetu-cost-model",
                "--hetu-varlen-mock", "--hetu-mock-documents")
"""The ``--hetu-*`` flags served by hooks on Megatron-LM's own loop."""

HANDOFF_FLAGS = ("--hetu-plan", "--hetu-runtime", "--hetu-straggler-replan", "--hetu-migrate")
"""Flags whose non-default value hands the run to hetu_ext's trainer (Megatron-LM's grid cannot hold it); so does
``--hetu-packing`` with tensor or pipeline parallelism (Megatron-LM broadcasts fixed-shape batches to TP ranks and
passes fixed-shape activations between stages)."""

MOE_FLAGS = ("--num-experts", "--moe-layer-freq", "--expert-model-parallel-size", "--moe-router-topk",
             "--moe-grouped-gemm", "--moe-token-dispatcher-type", "--expert-tensor-parallel-size")
"""Megatron-LM's MoE flags (named in the refusal of a hand-off, whose trainer builds dense GPT models only)."""

HETU_CKPT_UNCOVERED = {
    "--multi-latent-attention": "multi-latent attention's projections",
    "--mtp-num-layers": "multi-token prediction layers",
    "--heterogeneous-layers-config-path": "heterogeneous layer blocks",
    "--experimental-attention-variant": "experimental attention variants",
    "--spec": "a custom layer spec",
    "--fp8-format": "Transformer Engine's FP8 scaling state",
    "--use-precision-aware-optimizer": "the precision-aware optimizer's own masters and scaled moments",
    "--num-layers-per-virtual-pipeline-stage": "virtual pipeline model chunks",
    "--num-virtual-stages-per-pipeline-rank": "virtual pipeline model chunks",
}
"""Model options whose state the hetu format has no rule for (refused before launch with --hetu-ckpt-format hetu).
Covered, and tested with real saves (tests/test_megatron_lm_llama.py): --swiglu, --quick-geglu, --normalization
RMSNorm, --group-query-attention, --qk-layernorm, --untie-embeddings-and-output-weights, --disable-bias-linear,
--add-qkv-bias, --position-embedding-type rope; MoE: the flags of :data:`.moe.CKPT_RULES`
(tests/test_megatron_lm_moe.py), any other MoE flag is refused."""


@dataclass
class MegatronFlags:
    """The few Megatron-LM flags the ``--hetu-*`` checks depend on (parsed leniently; Megatron-LM parses all)."""

    calculate_per_token_loss: bool = False
    use_distributed_optimizer: bool = False
    save: str | None = None
    load: str | None = None
    dataloader_type: str | None = None
    rampup_batch_size: list[str] | None = None
    micro_batch_size: int | None = None
    global_batch_size: int | None = None
    ckpt_step: int | None = None
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    mock_data: bool = False
    data_path: list[str] | None = None
    present: list[str] = field(default_factory=list)
    """Every ``--flag`` of the Megatron-LM command line (as typed, without ``=value``)."""


@dataclass
class Invocation:
    """A checked command line: the script, Megatron-LM's argv (the ``--hetu-*`` flags taken out, and any flag a
    feature sets added), hetu_ext's settings and the mode."""

    script: Path
    megatron_argv: list[str]
    hetu: argparse.Namespace
    """Destinations of every setting of hetu_ext's schema (``hetu_ckpt_format``, ...); non-hetu ones unset."""
    hetu_argv: list[str]
    megatron: MegatronFlags
    mode: str
    """``megatron`` (hooks on Megatron-LM's loop) or ``handoff`` (hetu_ext's trainer)."""
    cpu: bool = False
    """No CUDA device (or ``--hetu-cpu-patches on``): the recipe is rehearsed on CPU (:mod:`.rehearsal`)."""
    notes: list[str] = field(default_factory=list)
    """What the checks changed (said once on rank 0): e.g. ``--calculate-per-token-loss`` added."""

    @property
    def checkout(self) -> Path:
        return self.script.parent

    @property
    def weighting(self) -> bool:
        return bool(self.hetu.hetu_straggler_interval)

    @property
    def hetu_checkpoints(self) -> bool:
        return self.hetu.hetu_ckpt_format == "hetu"


def hetu_parser() -> FlagParser:
    """Every setting of hetu_ext's schema as a flag (only the ``--hetu-*`` ones are ever given to it)."""
    parser = FlagParser(prog=PROG, allow_abbrev=False)
    for name, cls in SECTIONS.items():
        add_section_flags(parser, name, cls)
    return parser


def split_argv(argv: list[str], parser: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """``argv`` -> (Megatron-LM's tokens, the ``--hetu-*`` tokens with their values), order kept."""
    takes_value = {s: a.nargs != 0 for a in parser._actions for s in a.option_strings}
    megatron, hetu, i = [], [], 0
    while i < len(argv):
        token = argv[i]
        flag = token.split("=", 1)[0]
        if flag.startswith(HETU_PREFIX):
            hetu.append(token)
            if "=" not in token and takes_value.get(flag, False) and i + 1 < len(argv):
                hetu.append(argv[i + 1])
                i += 1
        else:
            megatron.append(token)
        i += 1
    return megatron, hetu


def megatron_flags(argv: list[str]) -> MegatronFlags:
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--calculate-per-token-loss", action="store_true")
    parser.add_argument("--use-distributed-optimizer", action="store_true")
    parser.add_argument("--save")
    parser.add_argument("--load")
    parser.add_argument("--dataloader-type")
    parser.add_argument("--rampup-batch-size", nargs="*")
    parser.add_argument("--micro-batch-size", type=int)
    parser.add_argument("--global-batch-size", type=int)
    parser.add_argument("--ckpt-step", type=int)
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--context-parallel-size", type=int, default=1)
    parser.add_argument("--mock-data", action="store_true")
    parser.add_argument("--data-path", nargs="*")
    known, _ = parser.parse_known_args(argv)
    present = [t.split("=", 1)[0] for t in argv if t.startswith("--")]
    return MegatronFlags(**vars(known), present=present)


def _given(hetu_argv: list[str]) -> list[str]:
    return [t.split("=", 1)[0] for t in hetu_argv if t.startswith(HETU_PREFIX)]


def handoff_reasons(ns: argparse.Namespace, m: MegatronFlags | None = None) -> list[str]:
    asked = []
    if ns.hetu_plan is not None:
        asked.append(f"--hetu-plan {ns.hetu_plan}")
    if ns.hetu_runtime == "plan":
        asked.append("--hetu-runtime plan")
    if ns.hetu_straggler_replan != "off":
        asked.append(f"--hetu-straggler-replan {ns.hetu_straggler_replan}")
    if ns.hetu_migrate is not None:
        asked.append("--hetu-migrate")
    if ns.hetu_packing != "off" and m is not None and (m.tensor_model_parallel_size > 1 or
                                                        m.pipeline_model_parallel_size > 1):
        asked.append(f"--hetu-packing {ns.hetu_packing}")
    return asked


def parse_invocation(argv: list[str]) -> Invocation:
    """Split, parse and check; raises ValueError (one line) on bad input. An unknown ``--hetu-*`` flag or a bad
    value is argparse's error (one line with the closest flag, exit 2)."""
    if not argv or argv[0].startswith("-"):
        raise ValueError("give the Megatron-LM script first: python -m hetu_ext.megatron_lm "
                         "PATH/TO/Megatron-LM/pretrain_gpt.py <its flags> --hetu-...")
    script = Path(argv[0]).absolute()  # not resolve(): a linked script keeps its checkout
    if not script.is_file():
        raise ValueError(f"{argv[0]}: no such file; give the pretrain_gpt.py of your Megatron-LM checkout")
    parser = hetu_parser()
    megatron_argv, hetu_argv = split_argv(argv[1:], parser)
    if "--hetu-config" in _given(hetu_argv):
        raise ValueError("--hetu-config is launch/pretrain_gpt.py's; with Megatron-LM's script give --hetu-* flags "
                         "(Megatron-LM's own settings stay on its command line or in its --yaml-cfg)")
    ns = parser.parse_args(hetu_argv)
    mflags = megatron_flags(megatron_argv)
    inv = Invocation(script=script, megatron_argv=megatron_argv, hetu=ns, hetu_argv=hetu_argv, megatron=mflags,
                     mode="handoff" if handoff_reasons(ns, mflags) else "megatron")
    if inv.mode == "handoff":
        why = handoff_reasons(ns, mflags)[0]
        moe = [f for f in mflags.present if f in MOE_FLAGS]
        if moe:
            raise ValueError(f"{moe[0]} (MoE) cannot go with {why}: hetu_ext's trainer, which runs plans "
                             "Megatron-LM's grid cannot hold, builds dense GPT models only; drop "
                             f"{why} to train MoE on Megatron-LM's grid")
        if flag_value(megatron_argv, "--transformer-impl") not in (None, "local") and \
                rehearse_on_cpu(ns.hetu_cpu_patches):  # the recipe's TE spec rehearsed on the local one
            rewrite = handoff_rewrite(megatron_argv)
            inv.cpu, inv.megatron_argv = True, rewrite.argv
            inv.notes.append(rewrite.notice())
        return inv
    inv.cpu = rehearse_on_cpu(ns.hetu_cpu_patches)
    if inv.cpu:
        rewrite = cpu_rewrite(megatron_argv)
        inv.megatron_argv = rewrite.argv
        inv.megatron = megatron_flags(rewrite.argv)
        if rewrite.notice():
            inv.notes.append(rewrite.notice())
    _check_native(inv)
    return inv


def rehearse_on_cpu(setting: str) -> bool:
    """``--hetu-cpu-patches``: auto (only without a CUDA device), on or off."""
    if setting != "auto":
        return setting == "on"
    import torch

    return not torch.cuda.is_available()


def _check_native(inv: Invocation) -> None:
    ns, m = inv.hetu, inv.megatron
    unsupported = [f for f in _given(inv.hetu_argv) if f not in NATIVE_FLAGS and f not in HANDOFF_FLAGS]
    if unsupported:
        raise ValueError(f"{unsupported[0]} is not supported on Megatron-LM's own loop (supported there: "
                         f"{', '.join(NATIVE_FLAGS)}); use launch/pretrain_gpt.py for it")
    if ns.hetu_emulate_layer_ms is not None and (ns.hetu_emulate_layer_ms <= 0 or not ns.hetu_straggler_interval):
        raise ValueError(f"--hetu-emulate-layer-ms must be > 0 and needs --hetu-straggler-interval N (got "
                         f"{ns.hetu_emulate_layer_ms}, interval {ns.hetu_straggler_interval})")
    if ns.hetu_emulate_slowdown and not ns.hetu_straggler_interval:
        raise ValueError("--hetu-emulate-slowdown needs --hetu-straggler-interval N (the monitor that measures it)")
    if ns.hetu_straggler_interval < 0:
        raise ValueError(f"--hetu-straggler-interval must be >= 0, got {ns.hetu_straggler_interval}")
    if ns.hetu_emulate_slowdown:
        from hetu_ext.runtime.straggler import parse_schedule

        parse_schedule(ns.hetu_emulate_slowdown)
    if ns.hetu_straggler_interval:
        if m.dataloader_type not in (None, "single"):
            raise ValueError(f"--hetu-straggler-interval weights each data-parallel rank's microbatches, which "
                             f"needs Megatron-LM's sequential sampler; got --dataloader-type {m.dataloader_type} "
                             "(drop it or use single)")
        problem = moe_weighting_problem(inv.megatron_argv)
        if problem:
            raise ValueError(problem)
        if m.rampup_batch_size:
            raise ValueError("--hetu-straggler-interval cannot go with --rampup-batch-size (the microbatch counts "
                             "per rank are fixed by the global batch); drop one")
        if not m.calculate_per_token_loss:
            inv.megatron_argv.append("--calculate-per-token-loss")
            inv.megatron.calculate_per_token_loss = True
            inv.notes.append("--hetu-straggler-interval: added --calculate-per-token-loss (with microbatches "
                             "weighted per data-parallel rank, only a per-token mean keeps the global batch's loss)")
    if m.context_parallel_size > 1:
        uses = [f for f, on in (("--hetu-ckpt-format hetu", inv.hetu_checkpoints),
                                ("--hetu-straggler-interval", inv.weighting),
                                ("--hetu-packing", ns.hetu_packing != "off")) if on]
        if uses or inv.cpu:
            why = (f"{uses[0]} has no rule for context parallelism yet" if uses else
                   "on CPU Megatron-core's local layer spec has no context parallelism (it needs Transformer Engine)")
            raise ValueError(f"--context-parallel-size {m.context_parallel_size}: {why}; give "
                             "--context-parallel-size 1" + (f" or drop {uses[0]}" if uses else ""))
    _check_packing(inv)
    if ns.hetu_ckpt_keep < 1:
        raise ValueError(f"--hetu-ckpt-keep must be >= 1, got {ns.hetu_ckpt_keep}")
    if inv.hetu_checkpoints:
        uncovered = [f for f in m.present if f in HETU_CKPT_UNCOVERED]
        if uncovered:
            raise ValueError(f"--hetu-ckpt-format hetu has no rule for {HETU_CKPT_UNCOVERED[uncovered[0]]} "
                             f"({uncovered[0]}); use Megatron-LM's own checkpoints (--hetu-ckpt-format auto) or drop "
                             f"{uncovered[0]}")
        problem = moe_ckpt_problem(m.present, cpu=inv.cpu)
        if problem:
            raise ValueError(problem)
        kept = [f for f in ("--no-load-optim", "--no-load-rng", "--finetune") if f in m.present]
        if kept and _holds_hetu_checkpoint(m.load):  # a recipe's first run (--load is its empty --save) loads none
            raise ValueError(f"{kept[0]} with --hetu-ckpt-format hetu: a hetu --load resumes the saved run (optimizer "
                             "state resharded, RNG states under the saving grid); drop "
                             f"{kept[0]}, or load Megatron-LM's own checkpoints with --hetu-ckpt-format auto")
        # Megatron-LM's recipes give --save DIR --load DIR: the first run finds no DIR yet and starts from scratch
        if m.load is not None and not Path(m.load).is_dir() and m.load != m.save:
            raise ValueError(f"--load {m.load}: no such directory; give the --save directory of an earlier run")


def _holds_hetu_checkpoint(directory: str | None) -> bool:
    """Whether ``--load`` names a directory with a hetu checkpoint in it (its iter_*/manifest.json)."""
    return directory is not None and Path(directory).is_dir() and any(Path(directory).glob("iter_*/manifest.json"))


def _check_packing(inv: Invocation) -> None:
    ns, m = inv.hetu, inv.megatron
    for name in ("hetu_global_batch_tokens", "hetu_mock_documents"):
        value = getattr(ns, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if ns.hetu_packing == "off":
        for name in ("hetu_global_batch_tokens", "hetu_varlen_mock", "hetu_cost_model"):
            if getattr(ns, name) is not None:
                raise ValueError(f"--{name.replace('_', '-')} needs --hetu-packing other than off (packed "
                                 "documents); add e.g. --hetu-packing balanced")
        return
    method = f"--hetu-packing {ns.hetu_packing}"
    if m.micro_batch_size not in (None, 1):
        raise ValueError(f"{method}: a THD pack is one row, so --micro-batch-size must be 1 (got "
                         f"{m.micro_batch_size}); --seq-length is the most tokens of a pack")
    if ns.hetu_straggler_interval:
        raise ValueError(f"{method} cannot go with --hetu-straggler-interval on Megatron-LM's loop yet (both set "
                         "the microbatches per rank); drop one, or add --hetu-runtime plan to run both in hetu_ext's "
                         "trainer")
    if m.mock_data and ns.hetu_varlen_mock is None:
        raise ValueError(f"{method} with --mock-data needs --hetu-varlen-mock JSON (the document lengths), e.g. "
                         "'{\"mode\": \"distribution\", \"type\": \"lognormal\", ...}'")
    if not m.mock_data and (not m.data_path or len(m.data_path) != 1):
        raise ValueError(f"{method} reads the documents of one indexed dataset: give --data-path PREFIX (one, no "
                         f"blend; got {m.data_path}) or --mock-data with --hetu-varlen-mock")
    if ns.hetu_varlen_mock is not None:
        from hetu_ext.data.lengths import parse_length_spec

        try:
            parse_length_spec(ns.hetu_varlen_mock)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"--hetu-varlen-mock {ns.hetu_varlen_mock}: {exc}") from exc
    if not m.calculate_per_token_loss:
        inv.megatron_argv.append("--calculate-per-token-loss")
        m.calculate_per_token_loss = True
        inv.notes.append(f"{method}: added --calculate-per-token-loss (packs hold different token counts; only a "
                         "per-token mean keeps the global batch's loss)")
