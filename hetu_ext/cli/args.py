"""pretrain_gpt.py's command line: Megatron-LM's flag names plus ``--hetu-*``, generated from the typed
configuration (:mod:`hetu_ext.config`), and the checks that need no process group.

Unknown flags are an argparse error (exit code 2, one line, the closest valid flag). Values are checked by
:func:`validate_args`, which raises ValueError naming the rule, the values and the fix; the launcher turns that
into one error line and exit code 2. :func:`parse_run_config` does all of it and returns the typed
:class:`~hetu_ext.config.RunConfig` that the trainer's components receive.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hetu_ext.config import RunConfig, build_parser, from_namespace, parse_namespace
from hetu_ext.config.megatron_flags import accepted_notice, refusal, take_megatron_flags

__all__ = ["build_parser", "parse_run_config", "take_megatron_lm_flags", "validate_args"]


def take_megatron_lm_flags(argv: list[str], parser: argparse.ArgumentParser) -> tuple[list[str], str | None]:
    """``argv`` without the Megatron-LM flags the trainer accepts or implies (hetu_ext.config.megatron_flags), and
    the one notice listing the accepted ones (None: none given). ValueError (one line) for a refused flag."""
    taken = take_megatron_flags(argv, known={s for a in parser._actions for s in a.option_strings})
    if taken.refused:
        raise ValueError(refusal(taken.refused[0]))
    return taken.argv, accepted_notice(taken.accepted)


def parse_run_config(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> RunConfig:
    """Flags (over the ``--hetu-config`` file) -> checked :class:`RunConfig`; exits 2 on a bad flag, ValueError
    on a bad value or file. Megatron-LM flags that do not change the numbers are taken off first (no notice)."""
    parser = parser or build_parser()
    argv, _ = take_megatron_lm_flags(list(sys.argv[1:] if argv is None else argv), parser)
    args = parse_namespace(argv, parser)
    validate_args(args)
    return from_namespace(args)


def _positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} must be >= 1, got {value}")


def _validate_packing(args: argparse.Namespace) -> None:
    _positive(args, "hetu_global_batch_tokens", "hetu_mock_documents")
    if args.hetu_packing == "off":
        for flag in ("hetu_global_batch_tokens", "hetu_varlen_mock"):
            if getattr(args, flag) is not None:
                raise ValueError(f"--{flag.replace('_', '-')} needs --hetu-packing other than off (packed "
                                 "documents); add e.g. --hetu-packing balanced")
        return
    if args.micro_batch_size != 1:
        raise ValueError(f"--hetu-packing {args.hetu_packing}: a THD pack is one row, so --micro-batch-size must "
                         f"be 1 (got {args.micro_batch_size}); --seq-length is the most tokens of a pack")
    if args.mock_data and args.hetu_varlen_mock is None:
        raise ValueError(f"--hetu-packing {args.hetu_packing} with --mock-data needs --hetu-varlen-mock JSON (the "
                         "document lengths), e.g. '{\"mode\": \"distribution\", \"type\": \"lognormal\", ...}'")
    if args.data_path and len(args.data_path) != 1:
        raise ValueError(f"--hetu-packing {args.hetu_packing} reads the documents of one indexed dataset; got "
                         f"--data-path {' '.join(args.data_path)} (blends are not supported with packing)")
    if args.global_batch_size is None and args.hetu_global_batch_tokens is None:
        raise ValueError(f"--hetu-packing {args.hetu_packing}: define a global batch by --global-batch-size "
                         "(sequences) or --hetu-global-batch-tokens (tokens)")


def _validate_schedule(args: argparse.Namespace) -> None:
    """Iteration- or sample-based training (Megatron-LM's rules), then ``args.train_iters`` set from
    ``--train-samples`` (samples // global batch, the partial last batch dropped, as Megatron-LM does)."""
    _positive(args, "train_iters", "train_samples", "lr_decay_iters", "lr_decay_samples")
    for name in ("lr_warmup_iters", "lr_warmup_samples"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.train_iters is None and args.train_samples is None:
        raise ValueError("--train-iters is required: give the flag, or training.train_iters in --hetu-config (or "
                         "--train-samples N: Megatron-LM's sample-based training)")
    if args.train_iters is not None and args.train_samples is not None:
        raise ValueError(f"give exactly one of --train-iters (steps) and --train-samples (samples), got "
                         f"--train-iters {args.train_iters} --train-samples {args.train_samples}")
    fraction = args.lr_warmup_fraction
    if fraction is not None and not 0 <= fraction <= 1:
        raise ValueError(f"--lr-warmup-fraction must be in [0, 1], got {fraction}")
    if args.rampup_batch_size is not None:
        _validate_rampup(args)
    if args.train_iters is not None:
        if args.lr_decay_samples is not None or args.lr_warmup_samples:
            raise ValueError("--lr-decay-samples / --lr-warmup-samples count samples and go with --train-samples; "
                             "with --train-iters give --lr-decay-iters / --lr-warmup-iters")
        if fraction is not None and args.lr_warmup_iters:
            raise ValueError(f"--lr-warmup-fraction {fraction} and --lr-warmup-iters {args.lr_warmup_iters} both "
                             "set the warmup; give one")
        return
    if args.lr_decay_iters is not None or args.lr_warmup_iters:
        raise ValueError("--lr-decay-iters / --lr-warmup-iters count steps and go with --train-iters; with "
                         "--train-samples give --lr-decay-samples / --lr-warmup-samples")
    if fraction is not None and args.lr_warmup_samples:
        raise ValueError(f"--lr-warmup-fraction {fraction} and --lr-warmup-samples {args.lr_warmup_samples} both set "
                         "the warmup; give one")
    if args.hetu_packing != "off":
        raise ValueError(f"--train-samples counts fixed-length samples; with --hetu-packing {args.hetu_packing} a "
                         "step's sequence count varies: give --train-iters")
    if args.global_batch_size is None:
        raise ValueError(f"--train-samples {args.train_samples} needs --global-batch-size (steps = samples // "
                         "global batch size)")
    if args.rampup_batch_size is not None:  # Megatron-LM's update_train_iters: the ramp's steps, then whole batches
        from hetu_ext.plan.core.batches import BatchRamp

        start, increment, samples = args.rampup_batch_size
        args.train_iters = BatchRamp(start=start, increment=increment, samples=samples,
                                     global_batch=args.global_batch_size).train_iters(args.train_samples)
        return
    if args.train_samples < args.global_batch_size:
        raise ValueError(f"--train-samples {args.train_samples} is less than one global batch "
                         f"(--global-batch-size {args.global_batch_size}); give at least that many")
    args.train_iters = args.train_samples // args.global_batch_size


_RAMPUP_REFUSED = (("hetu_straggler_interval", "straggler weighting re-plans each rank's microbatches"),
                   ("hetu_migrate", "a migration changes the plan the ramp's microbatches are shared by"),
                   ("hetu_lora_tenants", "LoRA tenants take their own batches"),
                   ("hetu_hotspa", "HotSPa's steps are packed documents"),
                   ("hetu_strategies", "Hydraulis' steps are packed documents"))


def _validate_rampup(args: argparse.Namespace) -> None:
    """--rampup-batch-size START INCREMENT SAMPLES (Megatron-LM's rules; ``args.rampup_batch_size`` made ints)."""
    given = " ".join(str(v) for v in args.rampup_batch_size)
    flag = f"--rampup-batch-size {given}"
    try:
        start, increment, samples = (int(v) for v in args.rampup_batch_size)
    except ValueError:
        raise ValueError(f"{flag}: give three integers START INCREMENT SAMPLES") from None
    args.rampup_batch_size = [start, increment, samples]
    if args.train_iters is not None:
        raise ValueError(f"{flag} goes with --train-samples, not --train-iters (Megatron-LM: 'expected no "
                         "batch-size rampup for iteration-based training'): give --train-samples N")
    for name, why in _RAMPUP_REFUSED:
        if getattr(args, name):
            raise ValueError(f"{flag} cannot go with --{name.replace('_', '-')} ({why}); drop one of them")
    if args.hetu_packing != "off":
        raise ValueError(f"{flag} cannot go with --hetu-packing {args.hetu_packing} (a packed step's sequence "
                         "count varies); drop one of them")
    if min(start, increment, samples) < 1:
        raise ValueError(f"{flag}: START, INCREMENT and SAMPLES must be >= 1")
    gbs, mbs = args.global_batch_size, args.micro_batch_size
    if gbs is None or start >= gbs or (gbs - start) % increment:
        raise ValueError(f"{flag}: START must be less than --global-batch-size ({gbs}) and the difference a "
                         "multiple of INCREMENT (Megatron-LM's rule)")
    if start % mbs or increment % mbs:
        raise ValueError(f"{flag}: every step's global batch must be whole microbatches, so START and INCREMENT "
                         f"must be multiples of --micro-batch-size {mbs}")


def _validate_tokenizer(args: argparse.Namespace) -> None:
    """File tokenizers: their files read now (nothing downloaded), ``args.vocab_size`` set from them; files given to
    a tokenizer that does not read them refused."""
    from hetu_ext.data.tokenizer import FILE_TOKENIZER_TYPES, TOKENIZER_FILES, check_tokenizer_files

    kind = args.tokenizer_type
    check_tokenizer_files(kind, {name: getattr(args, name) for name in TOKENIZER_FILES})
    if kind not in FILE_TOKENIZER_TYPES:
        return
    from hetu_ext.megatron.tokenizers import open_file_tokenizer

    size = open_file_tokenizer(kind, tokenizer_model=args.tokenizer_model, vocab_file=args.vocab_file,
                               merge_file=args.merge_file).vocab_size
    if args.vocab_size is not None and args.vocab_size != size:
        raise ValueError(f"--vocab-size {args.vocab_size} differs from the {size} ids of --tokenizer-type {kind}'s "
                         "files; drop --vocab-size (it is read from them)")
    args.vocab_size = size


def _validate_files(args: argparse.Namespace) -> None:
    """Every file a flag names exists and parses, before any process group (a missing --data-path gave 114 lines
    of three ranks' tracebacks)."""
    # Megatron-LM's recipes give --save DIR --load DIR: the first run finds no DIR yet and starts from scratch
    if args.load is not None and not Path(args.load).is_dir() and args.load != args.save:
        raise ValueError(f"--load {args.load}: no such directory; give the --save directory of an earlier run (a "
                         "folder without a checkpoint yet starts from scratch), or drop --load")
    for prefix in args.data_path or ():
        if _is_number(prefix):  # a blend's weight: --data-path 0.3 A 0.7 B
            continue
        missing = [suffix for suffix in (".bin", ".idx") if not Path(prefix + suffix).is_file()]
        if missing:
            raise ValueError(f"--data-path {prefix}: {' and '.join(prefix + s for s in missing)} not found; give the "
                             "prefix python -m hetu_ext.megatron.preprocess_data wrote (--output-prefix P makes "
                             "P_text_document.bin/.idx: pass P_text_document)")
    for flag in ("hetu_cost_model", "hetu_emulate_cost"):
        if getattr(args, flag) is not None:
            from hetu_ext.data.cost import load_cost_table

            try:
                load_cost_table(getattr(args, flag))
            except ValueError as exc:
                raise ValueError(f"--{flag.replace('_', '-')}: {exc}") from exc
    if args.hetu_varlen_mock is not None:
        from hetu_ext.data.lengths import parse_length_spec

        try:
            spec = parse_length_spec(args.hetu_varlen_mock)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"--hetu-varlen-mock {args.hetu_varlen_mock}: {exc}") from exc
        path = getattr(spec, "path", None)
        if path is not None and not Path(path).is_file():
            raise ValueError(f"--hetu-varlen-mock: length file {path!r} not found; give a file of one token count "
                             "a line (e.g. hetu_ext/data/samples/wikipedia_lengths_20k.txt.gz)")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def validate_args(args: argparse.Namespace) -> None:
    """Checks that need no process group; plan-dependent checks happen when the plan is built."""
    _positive(args, "nproc_per_node", "nnodes", "num_layers", "hidden_size", "num_attention_heads", "seq_length",
              "micro_batch_size",
              "global_batch_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
              "context_parallel_size", "log_interval", "save_interval", "exit_duration_in_mins")
    _validate_schedule(args)
    _validate_tokenizer(args)
    _validate_optimizer(args)
    if args.hetu_hang_timeout < 0:
        raise ValueError(f"--hetu-hang-timeout must be >= 0 seconds (0: no watchdog), got {args.hetu_hang_timeout}")
    _validate_model(args)
    if args.clip_grad < 0:
        raise ValueError(f"--clip-grad must be >= 0 (0 disables clipping), got {args.clip_grad}")
    if not (0 <= args.hidden_dropout < 1 and 0 <= args.attention_dropout < 1):
        raise ValueError(f"dropout must be in [0, 1), got --hidden-dropout {args.hidden_dropout} "
                         f"--attention-dropout {args.attention_dropout}")
    _validate_data_source(args)
    _validate_packing(args)
    _validate_files(args)
    _validate_emulation(args)
    _positive(args, "hetu_ckpt_keep")
    if args.save_interval is not None and args.save is None:
        raise ValueError(f"--save-interval {args.save_interval} needs --save DIR to save into")


def _validate_optimizer(args: argparse.Namespace) -> None:
    """Gradient precision, the LR schedule's source and the learning rates."""
    if args.grad_reduce_in_bf16 and not args.bf16:
        raise ValueError("--grad-reduce-in-bf16 reduces the bf16 model's gradients in bf16; without --bf16 they are "
                         "fp32: add --bf16 or drop --grad-reduce-in-bf16")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise ValueError("--override-opt_param-scheduler (the flags' LR schedule) and "
                         "--use-checkpoint-opt_param-scheduler (the checkpoint's) contradict each other; give one")
    if args.lr < 0 or args.min_lr < 0 or args.min_lr > args.lr:
        raise ValueError(f"learning rates must satisfy 0 <= --min-lr <= --lr, got --lr {args.lr} --min-lr "
                         f"{args.min_lr}")
    decoupled, decoupled_min = args.decoupled_lr, args.decoupled_min_lr
    if decoupled_min is not None and decoupled is None:
        raise ValueError(f"--decoupled-min-lr {decoupled_min} needs --decoupled-lr (Megatron-core applies the "
                         "embedding and output layer's minimum LR only with their peak LR); add --decoupled-lr")
    if decoupled is not None:
        top, bottom = args.lr if decoupled is None else decoupled, args.min_lr if decoupled_min is None else \
            decoupled_min
        if top < 0 or bottom < 0 or bottom > top:
            raise ValueError(f"the embedding and output layer's learning rates must satisfy 0 <= --decoupled-min-lr "
                             f"<= --decoupled-lr, got {top} and {bottom} (unset ones default to --lr / --min-lr)")


def _validate_model(args: argparse.Namespace) -> None:
    """Rotary positions, query groups, recomputation, the layer spec and the loss chunk."""
    if args.position_embedding_type != "rope" and (args.rotary_base != 10000 or args.rotary_percent != 1.0
                                                   or args.use_rope_scaling):
        raise ValueError(f"--rotary-base {args.rotary_base} / --rotary-percent {args.rotary_percent} / "
                         f"--use-rope-scaling {args.use_rope_scaling} set rotary positions, but "
                         f"--position-embedding-type is {args.position_embedding_type}; add "
                         "--position-embedding-type rope or drop them")
    if not 0 < args.rotary_percent <= 1:
        raise ValueError(f"--rotary-percent must be in (0, 1], got {args.rotary_percent}")
    if args.group_query_attention and (args.num_query_groups < 1 or args.num_attention_heads % args.num_query_groups):
        raise ValueError(f"--num-query-groups {args.num_query_groups} must divide --num-attention-heads "
                         f"{args.num_attention_heads}; choose a divisor")
    if args.recompute_granularity != "full" and (args.recompute_method or args.recompute_num_layers):
        raise ValueError(f"--recompute-method / --recompute-num-layers choose which layers full recomputation "
                         f"covers; got --recompute-granularity {args.recompute_granularity}: add "
                         "--recompute-granularity full or drop them")
    if args.recompute_granularity == "full" and (args.recompute_method is None or args.recompute_num_layers is None):
        raise ValueError("--recompute-granularity full needs --recompute-method (uniform or block) and "
                         "--recompute-num-layers N (as Megatron-LM); e.g. --recompute-method uniform "
                         "--recompute-num-layers 1 recomputes every layer")
    if args.recompute_modules and args.recompute_granularity != "selective":
        raise ValueError("--recompute-modules names what selective recomputation recomputes; add "
                         "--recompute-granularity selective or drop it")
    from hetu_ext.megatron.chunked_loss import parse_loss_chunk

    parse_loss_chunk(args.hetu_loss_chunk_tokens)  # N >= 0 or auto (the stage builder reads the setting)
    from hetu_ext.megatron.layer_spec import check_transformer_impl

    # --transformer-impl transformer_engine where Transformer Engine cannot run: one line, before any rank
    check_transformer_impl(args.transformer_impl, args.hetu_attention, lora=args.hetu_lora_tenants is not None)


def _validate_data_source(args: argparse.Namespace) -> None:
    """Exactly one data source: mock data, a --data-path prefix, or LobRA's tenants file (with its checks)."""
    if args.pretrained_checkpoint is not None and args.hetu_lora_tenants is None:  # LobRA pretrained base (issue 16)
        raise ValueError("--pretrained-checkpoint is supported with --hetu-lora-tenants; use --load to resume a run")
    if args.hetu_lora_tenants is not None:  # --- LobRA (issue 16): the tenants file gives the data ---
        from hetu_ext.lora.args import validate_lora_args

        validate_lora_args(args)
    elif bool(args.mock_data) == bool(args.data_path):
        raise ValueError("give exactly one data source: --mock-data or --data-path PREFIX "
                         f"(got --mock-data={args.mock_data}, --data-path={args.data_path})")


def _validate_emulation(args: argparse.Namespace) -> None:
    """Emulated layer times and slowdowns (CPU rehearsals of a GPU job) and the straggler monitor's interval."""
    if args.hetu_emulate_layer_ms is not None and (args.hetu_emulate_layer_ms <= 0 or
                                                    not args.hetu_straggler_interval):
        raise ValueError(f"--hetu-emulate-layer-ms must be > 0 and needs --hetu-straggler-interval N (got "
                         f"{args.hetu_emulate_layer_ms}, interval {args.hetu_straggler_interval})")
    if args.hetu_emulate_cost and args.hetu_emulate_layer_ms is not None:
        raise ValueError(f"--hetu-emulate-cost {args.hetu_emulate_cost} and --hetu-emulate-layer-ms "
                         f"{args.hetu_emulate_layer_ms} both set a layer's emulated time; give one")
    if args.hetu_straggler_interval < 0:
        raise ValueError(f"--hetu-straggler-interval must be >= 0, got {args.hetu_straggler_interval}")
    if args.hetu_emulate_slowdown:
        from hetu_ext.runtime.straggler import parse_schedule

        parse_schedule(args.hetu_emulate_slowdown)
