"""Checks of pretrain_gpt.py's flags with ``--hetu-lora-tenants`` (pure; called by validate_args before any
process group): one-line errors naming the rule, the values and the fix."""

from __future__ import annotations

import argparse

from hetu_ext.config.tenants import load_tenants


def validate_lora_args(args: argparse.Namespace) -> None:
    """The tenants file parses and names data that exists; flags that do not combine with tenants are refused."""
    given = [flag for flag, value in (("--mock-data", args.mock_data), ("--data-path", args.data_path),
                                      ("--hetu-varlen-mock", args.hetu_varlen_mock),
                                      ("--hetu-global-batch-tokens", args.hetu_global_batch_tokens)) if value]
    if given:
        raise ValueError(f"--hetu-lora-tenants: the tenants file gives each tenant's data and share of a step; "
                         f"drop {' '.join(given)}")
    if args.micro_batch_size != 1:
        raise ValueError(f"--hetu-lora-tenants: tenants' sequences are packed (a THD pack is one row), so "
                         f"--micro-batch-size must be 1 (got {args.micro_batch_size}); --seq-length is the most "
                         "tokens of a pack")
    if args.hetu_packing in ("concat", "concat-causal"):
        raise ValueError(f"--hetu-lora-tenants with --hetu-packing {args.hetu_packing}: a cut sequence would mix "
                         "no tenants but Megatron-style packs are not supported here; use balanced (default), ffd, "
                         "greedy or unpacked")
    if args.hetu_ckpt_format == "torch_dist":
        raise ValueError("--hetu-lora-tenants does not combine with --hetu-ckpt-format torch_dist yet; drop it")
    if args.fp16:
        raise ValueError("--fp16 is not supported with --hetu-lora-tenants: the tenants' step clips and skips per "
                         "tenant outside Megatron's loss-scaled step; use --bf16")
    tenants = load_tenants(args.hetu_lora_tenants)
    for tenant in tenants:
        if tenant.data_path is not None:
            from pathlib import Path

            missing = [s for s in (".bin", ".idx") if not Path(tenant.data_path + s).is_file()]
            if missing:
                raise ValueError(f"tenant {tenant.name!r} of --hetu-lora-tenants: data_path {tenant.data_path}: "
                                 f"{' and '.join(tenant.data_path + s for s in missing)} not found; give the prefix "
                                 "python -m hetu_ext.megatron.preprocess_data wrote")
    base = _check_pretrained(args)
    if args.load is not None:  # LobRA checkpoints (issue 16): the checkpoint's tenants are the file's
        _check_load(args, tenants, base)


def _check_pretrained(args: argparse.Namespace) -> dict | None:
    """--pretrained-checkpoint names a committed hetu checkpoint of this model's shape: its base record (None
    without the flag)."""
    if args.pretrained_checkpoint is None:
        return None
    from hetu_ext.checkpoint import CheckpointError

    from .pretrained import base_record, check_shape, pretrained_manifest

    try:
        manifest = pretrained_manifest(args.pretrained_checkpoint)
        check_shape(manifest.config, vars(args), where=f"{args.pretrained_checkpoint} (iteration "
                                                        f"{manifest.iteration})")
    except CheckpointError as exc:
        raise ValueError(str(exc)) from None
    return base_record(manifest, seed=args.seed, directory=args.pretrained_checkpoint)


def _check_load(args: argparse.Namespace, tenants, base: dict | None) -> None:
    from pathlib import Path

    from hetu_ext.checkpoint import CheckpointError

    from .checkpoint import check_tenants, latest_manifest

    if not Path(args.load).is_dir():
        return  # validate_args' own check names it
    try:
        manifest = latest_manifest(args.load)
    except CheckpointError:
        return  # a corrupt or missing latest checkpoint: the load reports it (or falls back with --hetu-ckpt-fallback)
    if manifest is None:
        return  # nothing saved yet: the run starts from scratch
    error = check_tenants(manifest.state.get("lora"), tenants, seed=args.seed, seq_length=args.seq_length,
                          where=f"--load {args.load} (iteration {manifest.iteration})", base=base)
    if error is not None:
        raise ValueError(error)
