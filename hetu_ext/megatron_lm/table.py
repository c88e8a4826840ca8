"""What each path does with each Megatron-LM flag: the table of docs/megatron-lm.md, generated.

Two paths take a Megatron-LM command line:

* **Megatron-LM's loop** (``-m hetu_ext.megatron_lm pretrain_gpt.py ...`` without a hand-off flag): Megatron-LM
  parses and implements every flag itself. hetu_ext changes a flag only on a machine without CUDA
  (:mod:`.rehearsal`: CUDA-only kernels dropped or switched off, in one notice) and refuses the few combinations its
  ``--hetu-*`` features have no rule for (:mod:`.flags`);
* **hetu_ext's trainer** (``launch/pretrain_gpt.py``, and the hand-off of ``--hetu-plan``, ``--hetu-runtime plan``
  and the other flags Megatron-LM's grid cannot hold): the flags of its schema are implemented, the others follow
  :data:`hetu_ext.config.megatron_flags.MEGATRON_FLAGS` (implemented / accepted with a notice / refused).

:func:`flag_rows` classifies a list of flags on both paths; a flag neither path knows is ``UNCLASSIFIED``
(tests/test_megatron_lm_recipe.py fails on one). :func:`markdown_table` renders the rows.
"""

from __future__ import annotations

from hetu_ext.config import build_parser
from hetu_ext.config.megatron_flags import rule_of

from .flags import HETU_CKPT_UNCOVERED
from .moe import CKPT_RULES as MOE_CKPT_RULES
from .moe import is_moe_flag
from .rehearsal import CPU_DROPPED, CPU_SWITCHES

UNCLASSIFIED = "UNCLASSIFIED"

WITH_HETU_FEATURES: dict[str, str] = {
    "--context-parallel-size": "values > 1 refused with --hetu-ckpt-format hetu or --hetu-straggler-interval "
                               "(context parallelism: not built yet), and on CPU (Megatron-core's local spec has "
                               "no context parallelism)",
    "--rampup-batch-size": "refused with --hetu-straggler-interval (the weighting fixes each rank's microbatches)",
    "--dataloader-type": "cyclic/external refused with --hetu-straggler-interval (it needs the sequential sampler)",
    "--no-load-optim": "refused with --hetu-ckpt-format hetu when --load holds a hetu checkpoint (its --load restores "
                       "the optimizer state); a first run, whose --load is its empty --save, takes it",
    "--no-load-rng": "refused with --hetu-ckpt-format hetu when --load holds a hetu checkpoint (its --load restores the "
                     "RNG state under the saving grid); a first run takes it",
    "--finetune": "refused with --hetu-ckpt-format hetu (its --load resumes the saved run)",
}
"""Megatron-LM flags that a ``--hetu-*`` feature of Megatron-LM's loop refuses (:func:`.flags._check_native`)."""


def megatron_loop(flag: str) -> str:
    """What Megatron-LM's loop under ``-m hetu_ext.megatron_lm`` does with ``flag``."""
    notes = ["Megatron-LM"]
    if flag in CPU_DROPPED:
        notes.append(f"CPU: dropped, {CPU_DROPPED[flag][1]}")
    elif flag in CPU_SWITCHES:
        value = CPU_SWITCHES[flag]
        notes.append(f"CPU: set ({flag} {value})" if value else "CPU: added if absent")
    if flag in HETU_CKPT_UNCOVERED:
        notes.append(f"refused with --hetu-ckpt-format hetu ({HETU_CKPT_UNCOVERED[flag]})")
    elif is_moe_flag(flag):
        notes.append(f"--hetu-ckpt-format hetu: {MOE_CKPT_RULES[flag]}" if flag in MOE_CKPT_RULES else
                     "refused with --hetu-ckpt-format hetu (an MoE option it has no rule for)")
    if flag == "--expert-model-parallel-size":
        notes.append("values > 1 refused with --hetu-straggler-interval (the experts' all-to-all needs the same "
                     "microbatches on every rank of the EP group)")
    if flag in WITH_HETU_FEATURES:
        notes.append(WITH_HETU_FEATURES[flag])
    if flag in LOOP_NOTES:
        notes.append(LOOP_NOTES[flag])
    return "; ".join(notes)


LOOP_NOTES: dict[str, str] = {
    "--sequence-parallel": "at TP 1 Megatron-LM turns it off (its notice); on the local spec hetu_ext's norms take it",
    "--apply-layernorm-1p": "on the local spec: hetu_ext's zero-centred torch norms",
    "--rampup-batch-size": "Megatron-LM core_v0.16.1 itself refuses it with --train-iters ('expected no "
                           "batch-size rampup for iteration-based training'): examples/gpt3 as written fails there; "
                           "with --train-samples it runs",
    "--fp16": "on CPU the dynamic loss scaler is patched onto the CPU; --hetu-ckpt-format hetu saves and restores "
              "its state (scale, growth and hysteresis trackers)",
    "--eval-iters": "on CPU evaluation's .cuda() calls are patched",
}
"""What hetu_ext adds to Megatron-LM's own handling of a flag on its loop (facts measured on CPU)."""


def trainer(flag: str, known: set[str] | None = None) -> tuple[str, str]:
    """(kind, note) of ``flag`` in hetu_ext's trainer: ``implemented`` for the flags of its schema, else the
    table's rule (a rule that depends on the value or on another flag says both cases), else
    :data:`UNCLASSIFIED`."""
    if known is None:
        known = {s for a in build_parser()._actions for s in a.option_strings}
    if flag in known:
        return "implemented", "a setting of hetu_ext's schema (docs/configuration.md)"
    rule = rule_of(flag)
    if rule is None:
        return UNCLASSIFIED, ""
    if rule.otherwise is None:
        return rule.kind, rule.note
    when = f"with {' / '.join(rule.values)}" if rule.values else f"with {' '.join(rule.requires)}"
    other_kind, other_note = rule.otherwise
    return rule.kind, f"{when}: {rule.note}; otherwise **{other_kind}**: {other_note}"


def flag_rows(argv: list[str]) -> list[tuple[str, str, str, str]]:
    """(flag, Megatron-LM's loop, trainer kind, trainer note) for each distinct flag of ``argv``, in order."""
    known = {s for a in build_parser()._actions for s in a.option_strings}
    seen: dict[str, None] = {}
    for token in argv:
        if token.startswith("--"):
            seen.setdefault(token.split("=", 1)[0], None)
    return [(flag, megatron_loop(flag), *trainer(flag, known)) for flag in seen]


def markdown_table(rows: list[tuple[str, str, str, str]]) -> str:
    lines = ["| flag | Megatron-LM's loop (`-m hetu_ext.megatron_lm`) | hetu_ext's trainer (hand-off, "
             "`launch/pretrain_gpt.py`) |", "|---|---|---|"]
    for flag, loop, kind, note in rows:
        lines.append(f"| `{flag}` | {loop} | **{kind}**{': ' + note if note else ''} |")
    return "\n".join(lines) + "\n"
