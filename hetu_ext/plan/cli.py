"""The planners' command lines, in one place: ``python -m hetu_ext.plan {show,malleus,lobra,hydraulis,predict}``
(:func:`main`, :func:`build_parser`) and ``python -m hetu_ext.plan.cost.calibration`` (:func:`calibration_main`).

Model, layout and training flags a planner shares with training are generated from the configuration schema
(:mod:`hetu_ext.config.schema`: the flag's name, type, choices and help, as
:func:`hetu_ext.config.parse.add_section_flags` makes them for the training command lines), so the two cannot
drift; :func:`schema_flags` takes a planner's own default, requirement or help where it differs from training's. The
planners themselves are pure functions of the parsed namespace (``hetu_ext.plan.lobra.deployment_report``,
``hetu_ext.plan.hydraulis.candidates_report``, ``hetu_ext.plan.cost.predict.run``,
``hetu_ext.plan.malleus.plan_malleus``).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
from pathlib import Path
from typing import Any

from hetu_ext.config.parse import section_flag_specs
from hetu_ext.config.schema import DataConfig, ModelConfig, ParallelConfig, TrainingConfig
from hetu_ext.data.tokenizer import TOKENIZER_TYPES, tokenizer_vocab_size
from hetu_ext.model.spec import ModelSpec
from hetu_ext.plan.core.cluster import Cluster
from hetu_ext.plan.core.io import dump_plan, format_plan, load_plan
from hetu_ext.plan.core.plan import PlanError
from hetu_ext.plan.cost.stage import CostModel
from hetu_ext.plan.malleus import plan_malleus

DESCRIPTION = """``python -m hetu_ext.plan show FILE``: print a plan as a table, after validating it.
``python -m hetu_ext.plan malleus ...``: plan around stragglers (Malleus) and write the plan as YAML.
``python -m hetu_ext.plan lobra ...``: replicas for many tenants' LoRA fine-tuning (LobRA), written as YAML.
``python -m hetu_ext.plan hydraulis ...``: candidate heterogeneous strategies chosen per step (Hydraulis).
``python -m hetu_ext.plan predict ...``: step time, TFLOP/s, MFU and memory per GPU of a run (or ``--table CSV``)."""
"""``python -m hetu_ext.plan --help``'s description."""

PLANNER_VOCAB = {"default": 50257, "help": "the tokenizer's vocabulary, before padding"}
"""The planners' --vocab-size: GPT-2's by default (training's comes from its tokenizer)."""

SCHEMA_SECTIONS = (ModelConfig, DataConfig, ParallelConfig, TrainingConfig)
"""The schema's sections a planner's flags are drawn from (model shape, vocabulary, layout, batch)."""


@functools.lru_cache(maxsize=None)
def _training_flags() -> dict[str, tuple[str, dict[str, Any]]]:
    """Setting name -> (flag, argparse keywords) as training's command lines declare it
    (:func:`~hetu_ext.config.parse.section_flag_specs`, the schema's own declaration)."""
    return {kwargs["dest"]: (flag, kwargs) for cls in SCHEMA_SECTIONS for flag, kwargs in section_flag_specs(cls)}


def schema_flags(parser, *names: str, required: tuple[str, ...] = (), **overrides: dict[str, Any]) -> None:
    """Add training's flags for the settings ``names`` to ``parser`` (a parser or an argument group): the name,
    type, choices, help and default the schema gives them (bool settings ``store_true``; a required setting has no
    default). ``required``: settings this planner cannot do without; ``overrides[name]``: argparse keywords
    (``default``, ``help``, ``choices``) where the planner's differ from training's."""
    flags = _training_flags()
    for name in names:
        if name not in flags:
            raise KeyError(f"no setting {name!r} in the configuration schema's sections")
        flag, declared = flags[name]
        kwargs = {key: value for key, value in declared.items() if value is not None or key == "default"}
        if name in required:
            kwargs.update(required=True)
            kwargs.pop("default")
        kwargs.update(overrides.get(name, {}))
        parser.add_argument(flag, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    """``python -m hetu_ext.plan``'s parser: one subcommand per planner."""
    parser = argparse.ArgumentParser(prog="python -m hetu_ext.plan", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    show_arguments(sub.add_parser("show", help="print a plan file as a table of stages and of each rank's layers"))
    malleus_arguments(sub.add_parser("malleus", help="plan around stragglers and write the plan (YAML) for "
                                                     "--hetu-plan"))
    lobra_arguments(sub.add_parser("lobra", help="choose replicas (TP x PP each) for many tenants' LoRA "
                                                 "fine-tuning and write the plan (YAML) for --hetu-plan"))
    hydraulis_arguments(sub.add_parser("hydraulis", help="candidate heterogeneous strategies from a length file, "
                                                         "which one each sampled batch would train under, and a "
                                                         "strategies YAML"))
    predict_arguments(sub.add_parser("predict", help="step time, TFLOP/s per GPU, MFU and memory per GPU of a "
                                                     "Megatron-LM run, or --table CSV against published runs"))
    return parser


def show_arguments(show: argparse.ArgumentParser) -> None:
    """``show``: the plan file, and the model flags training takes that a plan is checked against."""
    show.add_argument("file")
    show.add_argument("--world-size", type=int, default=None, help="also check the plan covers exactly these ranks")
    g = show.add_argument_group("model (as given to training; each check needs the flags it names)")
    schema_flags(g, "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                 "make_vocab_size_divisible_by", "tokenizer_type", "vocab_size",
                 num_layers={"help": "check the layer count and the padded vocabulary"},
                 hidden_size={"help": "with --num-attention-heads: check TP degrees"},
                 tokenizer_type={"choices": TOKENIZER_TYPES}, vocab_size={"help": "for NullTokenizer"})


def malleus_arguments(mal: argparse.ArgumentParser) -> None:
    """``malleus``: the cluster with its stragglers, the model and the batch."""
    mal.add_argument("--world-size", type=int, required=True)
    mal.add_argument("--gpus-per-node", type=int, default=8)
    mal.add_argument("--gpu-memory-gib", type=float, default=80.0)
    mal.add_argument("--slowdown", action="append", default=[], metavar="RANK=X",
                     help="a straggler's slowdown (repeatable), e.g. --slowdown 3=5.0")
    needed = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
              "global_batch_size")
    schema_flags(mal, *needed, "ffn_hidden_size", "vocab_size", "make_vocab_size_divisible_by", required=needed,
                 vocab_size=PLANNER_VOCAB)
    mal.add_argument("--output", "-o", default=None, help="write the plan here (default: print only)")
    schema_flags(mal, "use_distributed_optimizer",
                 use_distributed_optimizer={"help": "the run shards optimizer state over each element's holders: "
                                                    "plan with that memory"})


def lobra_arguments(parser: argparse.ArgumentParser) -> None:
    """``lobra``: the tenants, the cluster and the model."""
    parser.add_argument("--tenants", required=True, help="tenants file (YAML, as --hetu-lora-tenants)")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0, help="memory per GPU usable by a stage")
    needed = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
    schema_flags(parser, *needed, "ffn_hidden_size", "vocab_size", required=needed, vocab_size=PLANNER_VOCAB)
    parser.add_argument("--steps", type=int, default=8, help="sampled steps the deployment is evaluated on")
    parser.add_argument("--cost-model", default=None, metavar="YAML",
                        help="measured per-layer costs (python -m hetu_ext.cli.calibrate) instead of the FLOP "
                             "model; its device_memory_bytes, when set, replaces --gpu-memory-gib")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--output", "-o", default=None, help="write the plan here (YAML, for --hetu-plan)")


def hydraulis_arguments(parser: argparse.ArgumentParser) -> None:
    """``hydraulis``: the length file, the cluster, the model, the batches and the options priced."""
    parser.add_argument("--lengths", required=True, help="length file: one token count per line (.gz allowed)")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0, help="memory per GPU usable by a stage")
    needed = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
    schema_flags(parser, *needed, "ffn_hidden_size", "vocab_size", required=needed, vocab_size=PLANNER_VOCAB,
                 seq_length={"help": "the longest sequence (documents longer are split into pieces of this length)"})
    parser.add_argument("--batch-tokens", type=int, default=None,
                        help="tokens per global batch (default: 32768 per GPU)")
    parser.add_argument("--batches", type=int, default=4, help="sampled global batches to choose candidates for")
    parser.add_argument("--limit", type=int, default=24, help="most candidates (the home included)")
    parser.add_argument("--sampled-batches", type=int, default=16,
                        help="candidates also from the dynamic program on this many global batches drawn from the "
                        "lengths (plans fitted to one step's mix)")
    parser.add_argument("--recompute-granularity", choices=("none", "selective", "full", "auto"), default="none",
                        help="activation recomputation priced by the FLOP model (Megatron-LM's flag); auto: the "
                        "better of none and full on the sampled batches")
    schema_flags(parser, "sequence_parallel", "use_distributed_optimizer",
                 sequence_parallel={"help": "price sequence parallelism (TP > 1)"},
                 use_distributed_optimizer={"help": "price the distributed optimizer (Adam state once over the "
                                                    "world's ranks)"})
    parser.add_argument("--bandwidth", type=float, default=100.0,
                        help="GB/s per GPU for switching weights and gradients and for the gradient all-reduce")
    parser.add_argument("--cost-model", default=None, metavar="YAML",
                        help="measured per-layer costs (python -m hetu_ext.cli.calibrate) instead of the FLOP "
                             "model; its device_memory_bytes, when set, replaces --gpu-memory-gib")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--output", "-o", default=None,
                        help="write the candidates here as a strategies YAML (heterogeneous plans beside it)")


MOE_FLAGS = ("--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size", "--moe-shared-expert-intermediate-size",
             "--moe-shared-expert-gate", "--expert-model-parallel-size", "--expert-tensor-parallel-size")
"""The MoE flags ``predict`` takes; the planners refuse them by name."""


def predict_arguments(parser: argparse.ArgumentParser) -> None:
    """``predict``: a Megatron-LM run's model and layout (its own flags), or ``--table CSV``."""
    from hetu_ext.plan.cost.devices import shipped_devices
    from hetu_ext.plan.cost.predict import DEFAULT_DEVICE

    m = parser.add_argument_group("model (Megatron-LM's flags)")
    schema_flags(m, "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "group_query_attention",
                 "ffn_hidden_size", "kv_channels", "swiglu", "normalization", "position_embedding_type",
                 "disable_bias_linear", "untie_embeddings_and_output_weights", "seq_length", "vocab_size",
                 "make_vocab_size_divisible_by",
                 num_query_groups={"default": None, "help": "with --group-query-attention"},
                 seq_length={"default": 2048},
                 vocab_size={"default": 51200, "help": "the tokenizer's vocabulary, before padding"})
    e = parser.add_argument_group("mixture of experts (Megatron-LM's flags; every layer an MoE layer)")
    e.add_argument("--num-experts", type=int, default=None, help="experts per MoE layer (default: a dense model)")
    e.add_argument("--moe-router-topk", type=int, default=2, help="experts each token is routed to")
    e.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="each expert's width (default --ffn-hidden-size)")
    e.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None, help="the shared experts' width")
    e.add_argument("--moe-shared-expert-gate", action="store_true", help="a sigmoid gate on the shared experts")
    e.add_argument("--expert-model-parallel-size", type=int, default=1, help="EP: ranks that split the experts")
    e.add_argument("--expert-tensor-parallel-size", type=int, default=None, help="expert TP (default: TP)")
    r = parser.add_argument_group("layout and training")
    schema_flags(r, "tensor_model_parallel_size", "pipeline_model_parallel_size")
    r.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    r.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                   help="layers of the first stage (default: the even split)")
    r.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                   help="layers of the last stage (default: the even split)")
    r.add_argument("--context-parallel-size", type=int, default=1, help="ranks that split each sequence")
    r.add_argument("--cp-comm-type", default="p2p", choices=("p2p", "all_gather"),
                   help="K/V exchange of context parallelism: ring (p2p) or all-gather")
    r.add_argument("--tp-comm-overlap", action="store_true",
                   help="overlap the TP collectives with GEMMs (needs --sequence-parallel)")
    r.add_argument("--gpus", type=int, default=None, help="GPUs in all (default: TP x CP x PP, one replica)")
    schema_flags(r, "micro_batch_size", "global_batch_size", "recompute_granularity", "recompute_method",
                 "sequence_parallel", "use_distributed_optimizer",
                 micro_batch_size={"default": 1},
                 global_batch_size={"help": "default: micro batch x data parallel"},
                 recompute_method={"help": "full recomputation: uniform (every layer, one at a time) is what the "
                                           "model prices"})
    r.add_argument("--overlap-grad-reduce", action="store_true",
                   help="overlap the gradient reduction (and, distributed optimizer, the parameter gather)")
    r.add_argument("--use-flash-attn", action="store_true", help="causal attention, no materialised scores")
    r.add_argument("--device", default=None,
                   help=f"a shipped profile ({', '.join(shipped_devices())}; default {DEFAULT_DEVICE}) or a YAML file")
    parser.add_argument("--table", default=None, metavar="CSV", help="compare against a table of published runs")


def calibration_parser() -> argparse.ArgumentParser:
    """``python -m hetu_ext.plan.cost.calibration``'s parser."""
    from hetu_ext.plan.cost import calibration

    parser = argparse.ArgumentParser(prog="python -m hetu_ext.plan.cost.calibration", description=calibration.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", required=True, help="a cost table with a TP 1 entry (YAML)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", required=True, help="a shipped profile name or a profile YAML")
    needed = ("hidden_size", "num_attention_heads")
    schema_flags(parser, *needed, "ffn_hidden_size", required=needed)
    parser.add_argument("--tp", default="2,4,8", help="comma-separated TP degrees to add")
    return parser


def calibration_main(argv: list[str] | None = None) -> int:
    """``python -m hetu_ext.plan.cost.calibration``: a TP 1 cost table extended to ``--tp`` (exit code 2 with one
    ``error:`` line)."""
    from hetu_ext.data.cost import load_cost_table, save_cost_table
    from hetu_ext.plan.cost.calibration import REFERENCE_TOKENS, extend_by_tp
    from hetu_ext.plan.cost.devices import load_device

    args = calibration_parser().parse_args(argv)
    try:
        spec = ModelSpec(num_layers=1, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
                         ffn_hidden_size=args.ffn_hidden_size, seq_length=REFERENCE_TOKENS)
        tps = tuple(int(x) for x in args.tp.split(",") if x)
        table = extend_by_tp(load_cost_table(args.table), spec, load_device(args.device), tps)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    save_cost_table(table, args.out)
    for tp, c in table.per_tp.items():
        print(f"TP {tp}: a={c.a:.4g} b={c.b:.4g} c={c.c:.4g} memory/token={c.memory_per_token_bytes:.0f} B")
    print(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m hetu_ext.plan``: parse, run the planner, print (exit code 2 with one ``error:`` line)."""
    parser = build_parser()
    given = sys.argv[1:] if argv is None else argv
    moe = [t.split("=", 1)[0] for t in given if t.split("=", 1)[0] in MOE_FLAGS]
    if moe and given and given[0] != "predict":
        print(f"error: {moe[0]}: the planners (malleus, lobra, hydraulis, hotspa) plan dense models only (MoE in "
              "heterogeneous plans is not built); price an MoE run with `python -m hetu_ext.plan predict`",
              file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if args.command == "predict":  # step-time model (issue 35)
        from hetu_ext.plan.cost import predict

        return predict.run(args)
    if args.command == "malleus":
        return _malleus(args, parser)
    if args.command == "lobra":  # LobRA (issue 16)
        return _lobra(args)
    if args.command == "hydraulis":  # Hydraulis (issue 15)
        return _hydraulis(args)
    return _show(args)


def _show(args: argparse.Namespace) -> int:
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
    from hetu_ext.plan.lobra import deployment_report

    try:
        plan, report = deployment_report(args)
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
    from hetu_ext.plan.hydraulis import candidates_report, strategies_yaml

    try:
        strategies, report, _ = candidates_report(args)
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
