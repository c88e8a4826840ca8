"""``python -m hetu_ext.plan show FILE``: print a plan as a table, after validating it.
``python -m hetu_ext.plan malleus ...``: plan around stragglers (Malleus) and write the plan as YAML.
``python -m hetu_ext.plan lobra ...``: replicas for many tenants' LoRA fine-tuning (LobRA), written as YAML.
``python -m hetu_ext.plan hydraulis ...``: candidate heterogeneous strategies chosen per step (Hydraulis).
``python -m hetu_ext.plan predict ...``: step time, TFLOP/s, MFU and memory per GPU of a run (or ``--table CSV``)."""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from hetu_ext.data.tokenizer import TOKENIZER_TYPES, tokenizer_vocab_size

from hetu_ext.plan.core.cluster import Cluster
from hetu_ext.plan.cost.stage import CostModel
from hetu_ext.plan.core.io import dump_plan, format_plan, load_plan
from hetu_ext.plan.malleus import plan_malleus
from hetu_ext.model.spec import ModelSpec
from hetu_ext.plan.core.plan import PlanError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hetu_ext.plan", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show", help="print a plan file as a table of stages and of each rank's layers")
    show.add_argument("file")
    show.add_argument("--world-size", type=int, default=None, help="also check the plan covers exactly these ranks")
    _add_model_flags(show)
    mal = sub.add_parser("malleus", help="plan around stragglers and write the plan (YAML) for --hetu-plan")
    mal.add_argument("--world-size", type=int, required=True)
    mal.add_argument("--gpus-per-node", type=int, default=8)
    mal.add_argument("--gpu-memory-gib", type=float, default=80.0)
    mal.add_argument("--slowdown", action="append", default=[], metavar="RANK=X",
                     help="a straggler's slowdown (repeatable), e.g. --slowdown 3=5.0")
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length", "--micro-batch-size",
                 "--global-batch-size"):
        mal.add_argument(flag, type=int, required=True)
    mal.add_argument("--ffn-hidden-size", type=int, default=None)
    mal.add_argument("--vocab-size", type=int, default=50257, help="the tokenizer's vocabulary, before padding")
    mal.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    mal.add_argument("--output", "-o", default=None, help="write the plan here (default: print only)")
    mal.add_argument("--use-distributed-optimizer", action="store_true",
                     help="the run shards optimizer state over each element's holders: plan with that memory")
    # --- LobRA (issue 16): deployment of heterogeneous replicas for tenants' LoRA fine-tuning ---
    from hetu_ext.plan import lobra

    lobra.add_arguments(sub.add_parser("lobra", help="choose replicas (TP x PP each) for many tenants' LoRA "
                                                     "fine-tuning and write the plan (YAML) for --hetu-plan"))
    # --- end LobRA ---
    # --- Hydraulis (issue 15): candidate heterogeneous strategies, chosen per step ---
    from hetu_ext.plan import hydraulis

    hydraulis.add_arguments(sub.add_parser("hydraulis", help="candidate heterogeneous strategies from a length "
                                                             "file, which one each sampled batch would train "
                                                             "under, and a strategies YAML"))
    # --- end Hydraulis ---
    # --- step-time model (issue 35) ---
    from hetu_ext.plan.cost import predict

    predict.add_arguments(sub.add_parser("predict", help="step time, TFLOP/s per GPU, MFU and memory per GPU of a "
                                                         "Megatron-LM run, or --table CSV against published runs"))
    # --- end step-time model ---
    args = parser.parse_args(argv)
    if args.command == "predict":  # step-time model (issue 35)
        return predict.run(args)
    if args.command == "malleus":
        return _malleus(args, parser)
    if args.command == "lobra":  # LobRA (issue 16)
        return _lobra(args)
    if args.command == "hydraulis":  # Hydraulis (issue 15)
        return _hydraulis(args)
    try:
        plan = load_plan(args.file)
        model, checked = _model_to_check(args, plan)
        plan.validate(model, args.world_size)
    except (PlanError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_plan(plan))
    if checked:
        print(f"\nchecked against the model: {checked}")
    return 0


def _add_model_flags(show: argparse.ArgumentParser) -> None:
    """The model flags training takes that a plan is checked against (Megatron-LM's names and defaults)."""
    g = show.add_argument_group("model (as given to training; each check needs the flags it names)")
    g.add_argument("--num-layers", type=int, default=None, help="check the layer count and the padded vocabulary")
    g.add_argument("--hidden-size", type=int, default=None, help="with --num-attention-heads: check TP degrees")
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 x hidden size")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--tokenizer-type", default="ByteLevelTokenizer", choices=TOKENIZER_TYPES)
    g.add_argument("--vocab-size", type=int, default=None, help="for NullTokenizer")


def _model_to_check(args: argparse.Namespace, plan) -> tuple[ModelSpec | None, str]:
    """The model the plan is checked against, and what is checked. Only ``--num-layers``: the layer count and the
    padded vocabulary (the sizes not given are set so that they check nothing); with ``--hidden-size`` and
    ``--num-attention-heads`` also: every TP degree divides the heads and the MLP width, as training checks."""
    if args.num_layers is None:
        given = [f for f in ("hidden_size", "num_attention_heads", "ffn_hidden_size") if getattr(args, f) is not None]
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} is checked only with the model's --num-layers; "
                             "give --num-layers too")
        return None, ""
    if (args.hidden_size is None) != (args.num_attention_heads is None):
        raise ValueError("give --hidden-size and --num-attention-heads together (the TP degrees must divide the "
                         "heads and the MLP width), or neither to check only layers and vocabulary")
    vocab = tokenizer_vocab_size(args.tokenizer_type, args.vocab_size)
    shape = {"vocab_size": vocab, "make_vocab_size_divisible_by": args.make_vocab_size_divisible_by}
    if args.num_attention_heads is not None:
        spec = ModelSpec(num_layers=args.num_layers, hidden_size=args.hidden_size,
                         num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size, **shape)
        return spec, (f"{args.num_layers} layers, {spec.num_attention_heads} heads, ffn {spec.ffn_hidden_size}, "
                      f"padded vocabulary {spec.padded_vocab_size}")
    tp = math.lcm(*(stage.tp for pipeline in plan.pipelines for stage in pipeline.stages))
    spec = ModelSpec(num_layers=args.num_layers, hidden_size=tp, num_attention_heads=tp, **shape)
    return spec, (f"{args.num_layers} layers, padded vocabulary {spec.padded_vocab_size} (heads and MLP width "
                  "not checked: give --hidden-size and --num-attention-heads)")


def _malleus(args, parser) -> int:
    try:
        slowdowns = {}
        for item in args.slowdown:
            rank, _, x = item.partition("=")
            if not rank.isdigit() or not x:
                raise ValueError(f"--slowdown {item!r}: expected RANK=X, e.g. 3=5.0")
            slowdowns[int(rank)] = float(x)
        spec = ModelSpec(num_layers=args.num_layers, hidden_size=args.hidden_size,
                         num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
                         vocab_size=args.vocab_size, seq_length=args.seq_length,
                         make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
        cluster = Cluster(world_size=args.world_size, gpus_per_node=args.gpus_per_node,
                          gpu_memory_bytes=int(args.gpu_memory_gib * 2**30), slowdowns=slowdowns)
        if args.global_batch_size % args.micro_batch_size:
            raise ValueError(f"--global-batch-size {args.global_batch_size} must be a multiple of "
                             f"--micro-batch-size {args.micro_batch_size}")
        planned = plan_malleus(cluster, spec, micro_batch=args.micro_batch_size,
                               num_microbatches=args.global_batch_size // args.micro_batch_size,
                               cost=CostModel(optimizer_sharded=args.use_distributed_optimizer))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.output:  # before anything is printed: `... -o plan.yaml | head` must not lose the file
        _write_atomically(Path(args.output), dump_plan(planned.plan))
    try:
        print(format_plan(planned.plan))
        print(f"\npredicted step time {planned.predicted_step_s:.4g} s ({planned.template})")
        if args.output:
            print(f"wrote {args.output} (train with --hetu-plan {args.output})")
        sys.stdout.flush()
    except BrokenPipeError:  # the reader stopped early (| head): the plan is written, the rest is not wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at interpreter exit
    return 0


def _lobra(args) -> int:  # --- LobRA (issue 16) ---
    from hetu_ext.plan.lobra import run

    try:
        plan, report = run(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.output:
        _write_atomically(Path(args.output), dump_plan(plan))
    print(format_plan(plan))
    print(report)
    if args.output:
        print(f"wrote {args.output} (train with --hetu-plan {args.output} --hetu-lora-tenants {args.tenants})")
    return 0


def _hydraulis(args) -> int:  # --- Hydraulis (issue 15) ---
    from hetu_ext.plan.hydraulis import run, strategies_yaml

    try:
        strategies, report, _ = run(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report)
    if args.output:
        out = Path(args.output)
        text, plans = strategies_yaml(strategies, lambda k: f"{out.stem}.plan{k}.yaml")
        out.parent.mkdir(parents=True, exist_ok=True)
        for name, plan in plans.items():  # beside the strategies file: its plan: paths are relative to it
            _write_atomically(out.parent / name, dump_plan(plan))
        _write_atomically(out, text)
        print(f"wrote {args.output} (the candidates: a strategies file in HotSPa's format)")
    return 0  # --- end Hydraulis ---


def _write_atomically(path: Path, text: str) -> None:
    """Write ``text`` under a temporary name and rename: the file is whole or absent, never a prefix."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
