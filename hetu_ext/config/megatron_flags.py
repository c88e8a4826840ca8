"""What hetu_ext's trainer does with each Megatron-LM flag of Megatron-LM's own example scripts, as data.

Megatron-LM's recipes (``examples/llama``, ``examples/gpt3``, ``examples/mixtral`` at tag core_v0.16.1) carry flags
of three kinds for hetu_ext's trainer (``launch/pretrain_gpt.py`` and the hand-off of ``-m hetu_ext.megatron_lm``):

* ``implemented``: the trainer computes what Megatron-LM computes. Most are settings of :mod:`.schema` (the
  trainer's parser takes them); the few listed in :data:`MEGATRON_FLAGS` as implemented but absent from the schema
  select exactly what the trainer always does (``--calculate-per-token-loss``, ``--use-mcore-models``) and
  are taken silently;
* ``accepted``: the flag only picks a kernel, a fusion, a profiler or a memory/performance knob; the numbers do not
  depend on it. It is taken off the command line and ONE notice on rank 0 lists each such flag and what runs
  instead (:func:`accepted_notice`), never silently;
* ``refused``: it changes the numbers and is not built (MoE, ...): one line naming the flag and why, exit code 2.

:data:`MEGATRON_FLAGS` is the one place of this classification (a docs table is generated from
:func:`classification_rows`); a rule may depend on the flag's value or on another flag (``--no-position-embedding``
needs rotary positions). A flag in neither the table nor the schema is refused by the parser, by name. Pure: no
torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

KINDS = ("implemented", "accepted", "refused")


@dataclass(frozen=True)
class FlagRule:
    """What the trainer does with one Megatron-LM flag (``kind`` in :data:`KINDS`; ``note``: what runs instead,
    or why it is refused). ``values``: the rule holds for these values only (None: any value, or a switch), any
    other value gets ``otherwise`` (kind, note). ``requires``: (flag, value) another flag of the command line must
    have for the rule to hold; else ``otherwise``."""

    kind: str
    note: str
    values: tuple[str, ...] | None = None
    otherwise: tuple[str, str] | None = None
    requires: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        kinds = [self.kind] + ([self.otherwise[0]] if self.otherwise else [])
        assert all(k in KINDS for k in kinds), (self, KINDS)
        assert (self.values is None and self.requires is None) or self.otherwise is not None, self


_FP8 = "trained without FP8 (Transformer Engine's): in bf16 with --bf16, fp16 with --fp16, else fp32"
_PROFILER = "no profiler runs (use torch.profiler around launch/pretrain_gpt.py to profile)"
_MOE = "MoE is not built in hetu_ext's trainer (dense GPT models only); train MoE on Megatron-LM's grid"

MEGATRON_FLAGS: dict[str, FlagRule] = {
    # --- the trainer does this always (taken silently)
    "--calculate-per-token-loss": FlagRule("implemented", "always on: the loss is a sum over tokens normalised "
                                                          "once by the global batch's token count"),
    "--no-gradient-accumulation-fusion": FlagRule("implemented", "always off (no fused wgrad accumulation kernel)"),
    "--no-persist-layer-norm": FlagRule("implemented", "always off (torch norms)"),
    "--no-masked-softmax-fusion": FlagRule("implemented", "always off on CPU; torch softmax"),
    "--no-bias-gelu-fusion": FlagRule("implemented", "always off on CPU"),
    "--no-bias-swiglu-fusion": FlagRule("implemented", "always off on CPU"),
    "--no-bias-dropout-fusion": FlagRule("implemented", "always off on CPU"),
    "--no-rope-fusion": FlagRule("implemented", "always off on CPU (Transformer Engine's fused RoPE)"),
    "--use-cpu-initialization": FlagRule("implemented", "weights are initialised per global tensor from (seed, "
                                                        "name, layer), the same under every layout"),
    "--use-mcore-models": FlagRule("implemented", "Megatron-core's GPTModel is the only model hetu_ext builds"),
    "--no-position-embedding": FlagRule(
        "implemented", "rotary positions have no position table", requires=("--position-embedding-type", "rope"),
        otherwise=("refused", "Megatron-LM refuses --no-position-embedding without --position-embedding-type "
                              "rope; use --position-embedding-type none or rope")),
    # --- kernels, fusions, memory and performance knobs: accepted with a notice
    "--attention-backend": FlagRule("accepted", "torch's dot-product attention (the local spec's core attention; "
                                                "the backend picks among Transformer Engine's kernels)"),
    "--cross-entropy-loss-fusion": FlagRule("accepted", "Megatron-core's vocab-parallel cross entropy, native "
                                                        "implementation (the same formula)"),
    "--cross-entropy-fusion-impl": FlagRule("accepted", "Megatron-core's native vocab-parallel cross entropy"),
    "--manual-gc": FlagRule("accepted", "Python's garbage collector runs as usual"),
    "--manual-gc-interval": FlagRule("accepted", "Python's garbage collector runs as usual"),
    "--empty-unused-memory-level": FlagRule("accepted", "torch's caching allocator is not emptied between steps"),
    "--overlap-grad-reduce": FlagRule("accepted", "gradients are reduced after the backward pass, not overlapped "
                                                  "with it (the same sums)"),
    "--overlap-param-gather": FlagRule("accepted", "parameters are gathered after the optimizer step, not "
                                                   "overlapped with the forward pass (the same values)"),
    "--tiktoken-pattern": FlagRule("accepted", "read by TikTokenizer only; the tokenizer of --tokenizer-type "
                                               "runs"),
    "--no-create-attention-mask-in-dataloader": FlagRule("accepted", "the causal mask is built by the attention, "
                                                                     "never by the data loader"),
    "--no-mmap-bin-files": FlagRule("accepted", "the indexed dataset's .bin files are memory-mapped"),
    "--num-workers": FlagRule("accepted", "samples are read in the training process"),
    "--log-throughput": FlagRule("accepted", "the log line and the metrics record always carry tokens/s and "
                                             "TFLOP/s"),
    "--ckpt-format": FlagRule("accepted", "--save writes --hetu-ckpt-format's format (auto: hetu's "
                                          "layout-agnostic shards; torch_dist on the uniform runtime with "
                                          "--use-distributed-optimizer); --load reads either"),
    "--fp8-*": FlagRule("accepted", _FP8),
    "--profile*": FlagRule("accepted", _PROFILER),
    "--use-pytorch-profiler": FlagRule("accepted", _PROFILER),
    "--wandb-exp-name": FlagRule("accepted", "the W&B run keeps W&B's own name (--wandb-project is implemented)"),
    "--tp-comm-overlap": FlagRule("accepted", "TP communication is not overlapped (Transformer Engine's "
                                              "userbuffers)"),
    # --- change the numbers and are not built
    "--num-experts": FlagRule("refused", _MOE),
    "--moe-*": FlagRule("refused", _MOE),
    "--expert-model-parallel-size": FlagRule("refused", _MOE),
    "--expert-tensor-parallel-size": FlagRule("refused", _MOE),
    "--no-load-optim": FlagRule("refused", "hetu_ext's --load always restores the optimizer state (resharded "
                                           "into the plan); drop --no-load-optim"),
    "--no-load-rng": FlagRule("refused", "hetu_ext's --load restores the RNG states when the plan is the one that "
                                         "saved (else they are re-seeded per layout); drop --no-load-rng"),
}
"""Megatron-LM flag (``--x-*``: every flag with that prefix) -> its :class:`FlagRule` in hetu_ext's trainer.
Flags of :mod:`.schema` (``--num-layers``, ``--train-samples``, ...) are implemented and not listed."""


def rule_of(flag: str) -> FlagRule | None:
    """The rule of ``flag`` (exact entries first, then ``prefix*`` ones), or None when the table has none."""
    if flag in MEGATRON_FLAGS:
        return MEGATRON_FLAGS[flag]
    for key, rule in MEGATRON_FLAGS.items():
        if key.endswith("*") and flag.startswith(key[:-1]):
            return rule
    return None


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value ``flag`` has in ``argv`` (``--flag v`` or ``--flag=v``; "" for a switch), None when absent."""
    for i, token in enumerate(argv):
        name, eq, inline = token.partition("=")
        if name == flag:
            return inline if eq else (argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--")
                                      else "")
    return None


def resolve(flag: str, values: list[str], argv: list[str]) -> tuple[str, str] | None:
    """(kind, note) of ``flag`` given with ``values`` on the command line ``argv``; None when not in the table."""
    rule = rule_of(flag)
    if rule is None:
        return None
    holds = True
    if rule.values is not None:
        holds = " ".join(values) in rule.values
    if rule.requires is not None:
        holds = holds and flag_value(argv, rule.requires[0]) == rule.requires[1]
    return (rule.kind, rule.note) if holds else rule.otherwise


@dataclass
class TakenFlags:
    """A command line with the table's flags taken off: ``argv`` (for the trainer's parser), ``accepted`` (the
    flag as given with its values, what runs instead) for the notice, ``refused`` (flag as given, why)."""

    argv: list[str]
    accepted: list[tuple[str, str]]
    refused: list[tuple[str, str]]


def take_megatron_flags(argv: list[str], known: Iterable[str] = ()) -> TakenFlags:
    """Take the flags of :data:`MEGATRON_FLAGS` off ``argv`` (with their values: the tokens up to the next
    ``--flag``). Flags in ``known`` (the trainer's parser's) stay: the schema implements them."""
    known = set(known)
    out, accepted, refused, i = [], [], [], 0
    while i < len(argv):
        token = argv[i]
        flag, eq, inline = token.partition("=")
        verdict = None if flag in known or not flag.startswith("--") else rule_of(flag)
        if verdict is None:
            out.append(token)
            i += 1
            continue
        n = 0
        if not eq:
            while i + 1 + n < len(argv) and not argv[i + 1 + n].startswith("--"):
                n += 1
        values = [inline] if eq else argv[i + 1:i + 1 + n]
        kind, note = resolve(flag, values, argv)
        given = " ".join([flag, *values])
        if kind == "accepted":
            accepted.append((given, note))
        elif kind == "refused":
            refused.append((given, note))
        i += 1 + n
    return TakenFlags(argv=out, accepted=accepted, refused=refused)


def accepted_notice(accepted: list[tuple[str, str]]) -> str | None:
    """The one notice of the accepted flags: each flag as given and what runs instead, flags with the same
    instead listed together (None when there are none)."""
    if not accepted:
        return None
    by_note: dict[str, list[str]] = {}
    for given, instead in accepted:
        by_note.setdefault(instead, []).append(given)
    return ("Megatron-LM flags that do not change the numbers, accepted (what runs instead): "
            + "; ".join(f"{', '.join(flags)} -> {instead}" for instead, flags in by_note.items()))


def refusal(refused: tuple[str, str]) -> str:
    """The one error line of a refused flag."""
    given, why = refused
    return f"{given} is not supported by hetu_ext's trainer: {why}"


def classification_rows() -> list[tuple[str, str, str]]:
    """(flag, kind, note) rows for a docs table; a conditional rule gives a second row for its other case."""
    rows = []
    for flag, rule in MEGATRON_FLAGS.items():
        cond = f" {' / '.join(rule.values)}" if rule.values else ""
        cond += f" (with {' '.join(rule.requires)})" if rule.requires else ""
        rows.append((flag + cond, rule.kind, rule.note))
        if rule.otherwise:
            rows.append((flag + (" (other values)" if rule.values else " (otherwise)"), *rule.otherwise))
    return rows
