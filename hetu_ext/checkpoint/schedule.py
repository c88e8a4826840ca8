"""Resuming the LR / weight-decay schedule: the checkpoint's settings against the flags', as Megatron-LM rules.

Megatron-core's ``OptimizerParamScheduler.load_state_dict`` checks each setting (``_check_and_set``): with
``override_opt_param_scheduler`` the class values (the flags) win, with ``use_checkpoint_opt_param_scheduler``
the checkpoint's win, and with neither (Megatron-LM's default) a difference is an error. Megatron-core's class
defaults to taking the checkpoint's values silently, so a resume with a longer ``--train-iters`` kept the old
decay length and trained at the minimum LR. :func:`resolve_schedule` applies Megatron-LM's rule to a saved
``state_dict()`` (pure: dicts in, a dict out, no scheduler, no process group), so every rank, idle ones
included, reaches the same decision.
"""

from __future__ import annotations

from typing import Any

from .manifest import CheckpointError

POLICIES = ("check", "override", "checkpoint")
"""``check``: a differing setting is an error (Megatron-LM's default); ``override``: the flags win
(``--override-opt_param-scheduler``); ``checkpoint``: the checkpoint wins (``--use-checkpoint-opt_param-scheduler``)."""

SETTINGS = {"max_lr": "--lr", "min_lr": "--min-lr", "lr_warmup_steps": "--lr-warmup-iters",
            "lr_decay_steps": "--lr-decay-iters", "lr_decay_style": "--lr-decay-style",
            "start_wd": "--weight-decay", "end_wd": "--weight-decay", "wd_incr_steps": "--lr-decay-iters",
            "wd_incr_style": "(weight-decay increment style)"}
"""The settings of ``OptimizerParamScheduler.state_dict()`` (its position, ``num_steps``, aside) and the flag
that sets each (steps are samples, or steps with packing: the flag's iterations times the scheduler unit)."""
_STEPS = ("lr_warmup_steps", "lr_decay_steps", "wd_incr_steps")
_LEGACY = {"start_lr": "max_lr", "warmup_iter": "lr_warmup_steps", "warmup_steps": "lr_warmup_steps",
           "end_iter": "lr_decay_steps", "decay_steps": "lr_decay_steps", "decay_style": "lr_decay_style",
           "num_iters": "num_steps"}
"""Older Megatron-LM names of the same fields (what ``load_state_dict`` also accepts)."""


def normalise(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved scheduler state with Megatron-LM's older field names renamed to the current ones."""
    return {_LEGACY.get(k, k): v for k, v in saved.items()}


def _ignored(key: str, saved: dict[str, Any], flags: dict[str, Any]) -> bool:
    """Settings with no effect on either side: the decay length and minimum LR of a constant LR, the increment
    length of a constant weight decay."""
    if key in ("lr_decay_steps", "min_lr"):
        return saved.get("lr_decay_style") == flags["lr_decay_style"] == "constant"
    if key == "wd_incr_steps":
        return saved.get("wd_incr_style") == flags["wd_incr_style"] == "constant"
    return False


def _shown(key: str, value: Any, unit: int) -> str:
    if key in _STEPS and unit > 1 and value % unit == 0:
        return str(value // unit)
    return repr(value) if isinstance(value, str) else f"{value:g}" if isinstance(value, float) else str(value)


def differences(saved: dict[str, Any], flags: dict[str, Any], unit: int = 1) -> list[str]:
    """``flag here vs checkpoint`` for each setting that differs and matters (a setting shared by two fields
    is named once)."""
    saved = normalise(saved)
    out: dict[str, str] = {}
    for key, flag in SETTINGS.items():
        if key not in saved or _ignored(key, saved, flags) or saved[key] == flags[key] or flag in out:
            continue
        out[flag] = f"{flag} {_shown(key, flags[key], unit)} (checkpoint: {_shown(key, saved[key], unit)})"
    return list(out.values())


def resolve_schedule(saved: dict[str, Any], flags: dict[str, Any], *, policy: str, unit: int = 1,
                     where: str = "the checkpoint") -> dict[str, Any]:
    """The scheduler state to load: the saved position (``num_steps``) with each setting chosen by ``policy``.

    ``saved``: the checkpoint's ``OptimizerParamScheduler.state_dict()``; ``flags``: the settings the flags give
    (the same keys); ``unit``: samples per iteration of the step fields (for messages). Raises
    :class:`CheckpointError` under ``check`` when a setting that matters differs.
    """
    if policy not in POLICIES:
        raise ValueError(f"schedule policy {policy!r}: choose one of {POLICIES}")
    saved = normalise(saved)
    diff = differences(saved, flags, unit)
    if diff and policy == "check":
        raise CheckpointError(
            f"the LR schedule of the flags differs from {where}'s: {'; '.join(diff)}; resume with the checkpoint's "
            "values, or pass --override-opt_param-scheduler to use the flags' (a longer --train-iters also needs "
            "a longer --lr-decay-iters), or --use-checkpoint-opt_param-scheduler to keep the checkpoint's")
    out = {"num_steps": saved["num_steps"]}
    for key in SETTINGS:
        take_flags = policy == "override" or key not in saved or (policy == "check" and _ignored(key, saved, flags))
        out[key] = flags[key] if take_flags else saved[key]
    return out
