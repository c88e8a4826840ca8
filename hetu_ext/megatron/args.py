"""Command-line flags: Megatron-LM's names for the common options, plus ``--hetu-*``.

Unknown flags are an argparse error (exit code 2). Values are checked by :func:`validate_args`, which raises
ValueError naming the rule, the values and the fix; the launcher turns that into one error line and exit code 2.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from pathlib import Path

from .data import TOKENIZER_TYPES
from .packed_data import PACKING_METHODS

LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")


class UsageError(ValueError):
    """Bad command-line input: one ``error:`` line on rank 0, exit code 2."""


def report_error(prog: str, message: str) -> None:
    """Print ``prog: error: message`` once per job (rank 0 of a torchrun job; other ranks stay silent)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)


class FlagParser(argparse.ArgumentParser):
    """argparse with one-line errors: no usage block, the closest valid flag for an unknown one, rank 0 only
    (torchrun starts one parser per rank; 4 ranks printed the 54-line usage block 4 times)."""

    def parse_known_args(self, args=None, namespace=None):
        # an unknown flag first: a typo of a required flag (--num-layer) would else read "--num-layers is required"
        tokens = sys.argv[1:] if args is None else list(args)
        known = {s for a in self._actions for s in a.option_strings}
        unknown = [t for t in tokens if t.startswith("--") and t != "--" and t.split("=", 1)[0] not in known]
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}")
        return super().parse_known_args(args, namespace)

    def error(self, message: str):  # argparse's hook for every parse error
        if message.startswith("unrecognized arguments:"):
            message += self._suggestion(message.split(":", 1)[1].split())
        report_error(self.prog, message)
        sys.exit(2)

    def _suggestion(self, unknown: list[str]) -> str:
        flags = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
        for token in unknown:
            if token.startswith("--"):
                close = difflib.get_close_matches(token.split("=", 1)[0], flags, n=1, cutoff=0.6)
                if close:
                    return f"; did you mean {close[0]}? ({self.prog} --help lists every flag)"
        return f" ({self.prog} --help lists every flag)"


def build_parser(prog: str = "pretrain_gpt.py") -> argparse.ArgumentParser:
    p = FlagParser(prog=prog, description="Train Megatron-core's GPTModel under a hetu_ext plan.",
                   allow_abbrev=False)
    g = p.add_argument_group("launcher (without torchrun: this script starts torchrun's agent itself)")
    g.add_argument("--nproc-per-node", type=int, default=None,
                   help="ranks on this machine (default 1); under torchrun this flag is torchrun's, not ours")
    g.add_argument("--nnodes", type=int, default=1, help="machines of the job (torchrun's flag)")
    g.add_argument("--node-rank", type=int, default=0, help="this machine's index (torchrun's flag)")
    g.add_argument("--master-addr", default="127.0.0.1", help="rank 0's machine (torchrun's flag)")
    g.add_argument("--master-port", type=int, default=None, help="default: a free port (single node)")
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, required=True)
    g.add_argument("--hidden-size", type=int, required=True)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 x hidden size")
    g.add_argument("--num-attention-heads", type=int, required=True)
    g.add_argument("--seq-length", type=int, required=True)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default: --seq-length")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--position-embedding-type", choices=["learned_absolute"], default="learned_absolute")

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--distributed-backend", choices=["gloo", "nccl"], default=None,
                   help="default: nccl with CUDA, gloo without")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, required=True)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="default: micro batch size x data-parallel size")
    g.add_argument("--train-iters", type=int, required=True)
    g.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    g.add_argument("--lr", type=float, required=True)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=LR_DECAY_STYLES, default="linear")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true")

    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--hetu-ckpt-format", choices=["auto", "hetu", "torch_dist"], default="auto",
                   help="--save format: hetu (layout-agnostic shards, async, any plan) or torch_dist (Megatron's "
                        "dist_checkpointing, uniform runtime); auto: hetu, or torch_dist with "
                        "--use-distributed-optimizer. --load recognises either")
    g.add_argument("--hetu-ckpt-fallback", action="store_true",
                   help="if the latest checkpoint is corrupt or incomplete, load the previous complete one")
    g.add_argument("--hetu-ckpt-keep", type=int, default=2, help="complete hetu checkpoints kept (>= 1)")
    g.add_argument("--hetu-ckpt-read", choices=["node", "once"], default="node",
                   help="hetu --load: node (each host reads the shards its ranks need, through its page cache; no "
                        "network traffic) or once (each shard read by one rank, sent point to point)")

    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=1)

    g = p.add_argument_group("data")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--data-path", nargs="+", default=None)
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default="ByteLevelTokenizer")
    g.add_argument("--vocab-size", type=int, default=None, help="for NullTokenizer")
    g.add_argument("--data-cache-path", default=None)

    g = p.add_argument_group("hetu_ext")
    g.add_argument("--hetu-config", default=None, help="YAML file of hetu_ext settings (see configs/)")
    g.add_argument("--hetu-plan", default=None, help="plan YAML; default: the uniform plan of the TP/PP flags")
    g.add_argument("--hetu-runtime", choices=["auto", "megatron", "plan"], default="auto",
                   help="megatron: parallel_state's uniform grid; plan: any plan (stage models with their own groups)"
                        "; auto: megatron for uniform plans, plan otherwise")
    g.add_argument("--hetu-emulate-slowdown", default=None, metavar="SCHEDULE",
                   help='emulate stragglers: "step=20:rank=3:x=4[,step=60:rank=3:x=1]" pads each layer of rank 3 '
                        "to 4x its time from step 20")
    g.add_argument("--hetu-emulate-layer-ms", type=float, default=None,
                   help="emulated device time of one layer's forward per microbatch (backward 2x) on every rank, "
                        "so CPU ranks sharing cores keep an emulated cluster's pace (needs the straggler monitor)")
    g.add_argument("--hetu-straggler-interval", type=int, default=0,
                   help="measure per-rank slowdowns every N steps and propose a Malleus plan (0: off)")
    g.add_argument("--hetu-straggler-threshold", type=float, default=1.3)
    g.add_argument("--hetu-straggler-min-change", type=float, default=0.2)
    g.add_argument("--hetu-straggler-window", type=int, default=5)
    g.add_argument("--hetu-straggler-replan", choices=["off", "online"], default="off",
                   help="online: migrate to the Malleus plan the monitor proposes, without restarting")
    g.add_argument("--hetu-gpus-per-node", type=int, default=None, help="for planning (default: one node)")
    g.add_argument("--hetu-replan-output", default=None, help="write the proposed plan here (YAML)")
    g.add_argument("--hetu-migrate", default=None, metavar="SCHEDULE",
                   help='move the running job to other plans: "step=3:plan=a.yaml[,step=8:plan=b.yaml]" (after '
                        "step 3, ...), parameters and optimizer state resharded online")
    g.add_argument("--hetu-cpu-patches", choices=["auto", "on", "off"], default="auto",
                   help="Megatron-core CPU patches: auto applies them only when no CUDA device is present")

    g = p.add_argument_group("hetu_ext packing (Hydraulis)")
    g.add_argument("--hetu-packing", choices=PACKING_METHODS, default="off",
                   help="off: Megatron's fixed-length samples; else documents packed into THD microbatches of at "
                        "most --seq-length tokens: unpacked (one per microbatch), concat (Megatron-style cut, "
                        "per-document attention), concat-causal (the same packs, attention over the whole pack), "
                        "ffd, greedy (DeepSpeed-style by tokens), balanced (two-stage, length-aware)")
    g.add_argument("--hetu-global-batch-tokens", type=int, default=None,
                   help="with --hetu-packing: a global batch is as many sequences as fit in this many tokens "
                        "(default: --global-batch-size sequences)")
    g.add_argument("--hetu-cost-model", default=None, metavar="YAML",
                   help="per-layer time a*s^2+b*s+c per TP degree (python -m hetu_ext.data.calibrate); default: "
                        "built-in coefficients")
    g.add_argument("--hetu-varlen-mock", default=None, metavar="JSON",
                   help='with --mock-data and --hetu-packing: document lengths, {"mode": "file", "path": ...} or '
                        '{"mode": "distribution", "type": "lognormal", "min_seq_len": ..., "max_seq_len": ..., '
                        '"mean_seq_len": ..., "lognormal_sigma": ...}')
    g.add_argument("--hetu-mock-documents", type=int, default=100_000,
                   help="documents drawn for --hetu-varlen-mock")
    return p


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


def _validate_files(args: argparse.Namespace) -> None:
    """Every file a flag names exists and parses, before any process group (a missing --data-path gave 114 lines
    of three ranks' tracebacks)."""
    if args.load is not None and not Path(args.load).is_dir():
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
    if args.hetu_cost_model is not None:
        from hetu_ext.data.cost import load_cost_table

        try:
            load_cost_table(args.hetu_cost_model)
        except ValueError as exc:
            raise ValueError(f"--hetu-cost-model: {exc}") from exc
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
    _positive(args, "nproc_per_node", "nnodes", "num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
              "global_batch_size", "train_iters", "tensor_model_parallel_size", "pipeline_model_parallel_size",
              "log_interval", "save_interval", "lr_decay_iters")
    if args.lr_warmup_iters < 0:
        raise ValueError(f"--lr-warmup-iters must be >= 0, got {args.lr_warmup_iters}")
    if args.lr < 0 or args.min_lr < 0 or args.min_lr > args.lr:
        raise ValueError(f"learning rates must satisfy 0 <= --min-lr <= --lr, got --lr {args.lr} --min-lr "
                         f"{args.min_lr}")
    if args.clip_grad < 0:
        raise ValueError(f"--clip-grad must be >= 0 (0 disables clipping), got {args.clip_grad}")
    if not (0 <= args.hidden_dropout < 1 and 0 <= args.attention_dropout < 1):
        raise ValueError(f"dropout must be in [0, 1), got --hidden-dropout {args.hidden_dropout} "
                         f"--attention-dropout {args.attention_dropout}")
    if bool(args.mock_data) == bool(args.data_path):
        raise ValueError("give exactly one data source: --mock-data or --data-path PREFIX "
                         f"(got --mock-data={args.mock_data}, --data-path={args.data_path})")
    _validate_packing(args)
    _validate_files(args)
    if args.hetu_emulate_layer_ms is not None and (args.hetu_emulate_layer_ms <= 0 or
                                                    not args.hetu_straggler_interval):
        raise ValueError(f"--hetu-emulate-layer-ms must be > 0 and needs --hetu-straggler-interval N (got "
                         f"{args.hetu_emulate_layer_ms}, interval {args.hetu_straggler_interval})")
    if args.hetu_straggler_interval < 0:
        raise ValueError(f"--hetu-straggler-interval must be >= 0, got {args.hetu_straggler_interval}")
    if args.hetu_emulate_slowdown:
        from hetu_ext.runtime.straggler import parse_schedule

        parse_schedule(args.hetu_emulate_slowdown)
    _positive(args, "hetu_ckpt_keep")
    if args.hetu_ckpt_format == "hetu" and args.use_distributed_optimizer and args.save:
        raise ValueError("--hetu-ckpt-format hetu cannot save --use-distributed-optimizer's flat ZeRO-1 shards yet; "
                         "use --hetu-ckpt-format torch_dist (or auto)")
    if args.save_interval is not None and args.save is None:
        raise ValueError(f"--save-interval {args.save_interval} needs --save DIR to save into")
