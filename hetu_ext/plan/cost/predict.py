"""``python -m hetu_ext.plan predict``: one run's step time, TFLOP/s per GPU, MFU and memory per GPU from the step
model (:mod:`hetu_ext.plan.cost.step_model`), or, with ``--table CSV``, the model against a table of published runs.

Model and layout flags carry Megatron-LM's names. The table's columns (one run per row; ``0|1`` for booleans)::

    source, model, num_layers, hidden_size, num_attention_heads, num_query_groups, ffn_hidden_size, swiglu,
    vocab_size, seq_length, tp, pp, dp, micro_batch_size, global_batch_size, recompute (none|selective|full),
    sequence_parallel, distributed_optimizer, device, tflops_per_gpu
    [, num_layers_per_virtual_pipeline_stage, overlap_grad_reduce, use_flash_attn, cp, cp_comm_type,
       first_stage_layers, last_stage_layers, tp_comm_overlap, normalization, position_embedding_type,
       disable_bias_linear, untie_embeddings_and_output_weights, tflops_count]
                                                                      (optional; empty = off / the default)

``cp`` is the context-parallel size (the GPUs are ``tp cp pp dp``), ``cp_comm_type`` Megatron-LM's
``--cp-comm-type`` (p2p or all_gather), ``first_stage_layers`` / ``last_stage_layers`` its
``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``.

The table mode prints each row's error (``predicted / published - 1``) and ends with one JSON line
``{"rows": [{"model", "published", "predicted", "error"}]}``. Bad input: one ``error:`` line, exit code 2.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

from hetu_ext.model.spec import ModelSpec

from . import step_model
from hetu_ext.plan.cost.devices import Device, load_device

COLUMNS = ("source", "model", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
           "ffn_hidden_size", "swiglu", "vocab_size", "seq_length", "tp", "pp", "dp", "micro_batch_size",
           "global_batch_size", "recompute", "sequence_parallel", "distributed_optimizer", "device", "tflops_per_gpu")
OPTIONAL = ("num_layers_per_virtual_pipeline_stage", "overlap_grad_reduce", "use_flash_attn", "cp", "cp_comm_type",
            "first_stage_layers", "last_stage_layers", "tp_comm_overlap", "normalization", "position_embedding_type",
            "disable_bias_linear", "untie_embeddings_and_output_weights", "tflops_count")
TFLOPS_COUNTS = ("megatron", "model")
"""How a table's ``tflops_per_gpu`` counts FLOPs: ``megatron`` (the default; Megatron-LM's papers: recomputation
counted, the whole attention square) or ``model`` (model FLOPs, the MFU convention: no recomputation, the causal
half of the square: the published TFLOP/s is MFU x peak)."""
DEFAULT_DEVICE = "a100-80gb-sxm"


def run(args: argparse.Namespace) -> int:
    """The ``predict`` command: print, and return the exit code (2 with one ``error:`` line on bad input)."""
    try:
        if args.table:
            return _table(args)
        spec, par = _from_flags(args)
        device = load_device(args.device or DEFAULT_DEVICE)
        result = step_model.predict(spec, par, device)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_prediction(spec, par, device, result))
    print(json.dumps({"step_s": result.step_s, "tflops_per_gpu": result.tflops_per_gpu, "mfu": result.mfu,
                      "memory_gib": result.memory_bytes / 2**30, "fits": result.memory_bytes <= device.memory_bytes,
                      "parts_s": result.parts}))
    return 0


def _from_flags(args: argparse.Namespace) -> tuple[ModelSpec, step_model.Parallel]:
    missing = [f for f in ("num_layers", "hidden_size", "num_attention_heads") if getattr(args, f) is None]
    if missing:
        flags = ", ".join(f"--{m.replace('_', '-')}" for m in missing)
        raise ValueError(f"predict needs the model: --num-layers, --hidden-size and --num-attention-heads (missing "
                         f"{flags}), or --table CSV")
    if args.num_query_groups is not None and not args.group_query_attention:
        raise ValueError("--num-query-groups takes effect with --group-query-attention (Megatron-LM's rule); "
                         "add --group-query-attention")
    groups = args.num_query_groups if args.group_query_attention else None
    if args.group_query_attention and groups is None:
        raise ValueError("--group-query-attention needs --num-query-groups N")
    spec = ModelSpec(num_layers=args.num_layers, hidden_size=args.hidden_size,
                     num_attention_heads=args.num_attention_heads, num_query_groups=groups,
                     ffn_hidden_size=args.ffn_hidden_size, kv_channels=args.kv_channels, swiglu=args.swiglu,
                     normalization=args.normalization, position_embedding_type=args.position_embedding_type,
                     add_bias_linear=not args.disable_bias_linear,
                     untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
                     seq_length=args.seq_length, max_position_embeddings=max(args.seq_length, 1),
                     vocab_size=args.vocab_size, make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                     **_moe_settings(args))
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    for flag, value in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                        ("--context-parallel-size", cp)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    gpus = args.gpus if args.gpus is not None else tp * pp * cp
    if gpus < 1 or gpus % (tp * pp * cp):
        raise ValueError(f"--gpus {gpus} must be a positive multiple of --tensor-model-parallel-size x "
                         f"--pipeline-model-parallel-size x --context-parallel-size = {tp} x {pp} x {cp}; change "
                         "--gpus or the parallel sizes")
    dp = gpus // (tp * pp * cp)
    if args.recompute_method is not None and args.recompute_granularity != "full":
        raise ValueError(f"--recompute-method {args.recompute_method} applies to --recompute-granularity full "
                         "only (Megatron-LM's rule); add --recompute-granularity full or drop it")
    if args.recompute_method == "block":
        raise ValueError("--recompute-method block (only some layers recomputed) is not modelled; price "
                         "--recompute-method uniform (every layer) instead")
    gbs = args.global_batch_size if args.global_batch_size is not None else args.micro_batch_size * dp
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    virtual = _virtual(spec.num_layers, pp, args.num_layers_per_virtual_pipeline_stage, first, last)
    par = step_model.Parallel(tp=tp, pp=pp, dp=dp, cp=cp, micro_batch_size=args.micro_batch_size,
                              global_batch_size=gbs, recompute=args.recompute_granularity or "none",
                              sequence_parallel=args.sequence_parallel,
                              distributed_optimizer=args.use_distributed_optimizer, virtual_stages=virtual,
                              overlap_grad_reduce=args.overlap_grad_reduce, flash_attention=args.use_flash_attn,
                              cp_comm_type=args.cp_comm_type, first_stage_layers=first, last_stage_layers=last,
                              tp_comm_overlap=args.tp_comm_overlap, ep=args.expert_model_parallel_size,
                              etp=args.expert_tensor_parallel_size)
    return spec, par


def _moe_settings(args: argparse.Namespace) -> dict:
    """The MoE flags as ModelSpec settings ({} for a dense model)."""
    if args.num_experts is None:
        given = [f for f in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size")
                 if getattr(args, f) is not None]
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} needs --num-experts N")
        return {}
    return {"num_experts": args.num_experts, "moe_router_topk": args.moe_router_topk,
            "moe_ffn_hidden_size": args.moe_ffn_hidden_size,
            "moe_shared_expert_intermediate_size": args.moe_shared_expert_intermediate_size,
            "moe_shared_expert_gate": args.moe_shared_expert_gate}


def _virtual(num_layers: int, pp: int, per_virtual: int | None, first: int | None = None,
             last: int | None = None) -> int:
    """Model chunks per stage from --num-layers-per-virtual-pipeline-stage (None: 1, no interleaving): the layers
    of a stage (a middle stage's, when the first or last stage is uneven) over it."""
    if per_virtual is None:
        return 1
    given = [x for x in (first, last) if x is not None]
    middle = pp - len(given)
    per_stage = (num_layers - sum(given)) / middle if middle > 0 else 0
    if per_virtual < 1 or pp < 2 or per_stage != int(per_stage) or int(per_stage) % per_virtual or not per_stage:
        raise ValueError(f"--num-layers-per-virtual-pipeline-stage {per_virtual} must divide the layers per "
                         f"{'middle ' if given else ''}stage ({num_layers - sum(given)} / {middle}) with "
                         "--pipeline-model-parallel-size > 1; change it or drop it")
    return int(per_stage) // per_virtual


def format_prediction(spec: ModelSpec, par: step_model.Parallel, device: Device, r: step_model.Prediction) -> str:
    from hetu_ext.model import inventory

    params = inventory.param_count(spec) / 1e9
    fits = "fits" if r.memory_bytes <= device.memory_bytes else "DOES NOT FIT"
    parts = ", ".join(f"{k} {v / r.step_s:.1%}" for k, v in r.parts.items() if v > 0)
    return "\n".join([
        f"model     {spec.num_layers} layers, hidden {spec.hidden_size}, {spec.num_attention_heads} heads "
        f"({spec.num_query_groups} query groups), ffn {spec.ffn_hidden_size}{' swiglu' if spec.swiglu else ''}, "
        f"seq {spec.seq_length}, vocab {spec.padded_vocab_size}: {params:.2f} B parameters",
        f"layout    TP {par.tp} x CP {par.cp} x PP {par.pp} x DP {par.dp} = {par.gpus} GPUs (stage layers "
        f"{_stages_text(step_model.stage_layers(spec, par))}); {par.microbatches} microbatches of "
        f"{par.micro_batch_size} per replica; recompute {par.recompute}; sequence parallel "
        f"{'on' if par.sequence_parallel else 'off'}; TP overlap {'on' if par.tp_comm_overlap else 'off'}; "
        f"distributed optimizer {'on' if par.distributed_optimizer else 'off'}; virtual stages "
        f"{par.virtual_stages}",
        f"device    {device.name} (peak {device.peak_flops / 1e12:.0f} TFLOP/s, {device.memory_gib:g} GiB)",
        f"step time          {r.step_s:.4g} s",
        f"TFLOP/s per GPU    {r.tflops_per_gpu:.1f} (recomputation counted, as Megatron-LM's papers count)",
        f"MFU                {r.mfu:.1%}",
        f"memory per GPU     {r.memory_bytes / 2**30:.1f} GiB of {device.memory_gib:g} ({fits})",
        f"time               {parts}",
    ])


def _stages_text(layers: list[int]) -> str:
    """``7, 8 x 14, 7`` for a pipeline's layer counts."""
    if len(layers) <= 2 or len(set(layers[1:-1])) > 1:
        return ", ".join(map(str, layers))
    middle = f"{layers[1]} x {len(layers) - 2}" if len(layers) > 3 else str(layers[1])
    return f"{layers[0]}, {middle}, {layers[-1]}"


def _flag(row: dict, key: str, where: str) -> bool:
    value = (row.get(key) or "0").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{where}: {key} must be 0 or 1, got {value!r}")
    return value == "1"


def _int(row: dict, key: str, where: str, default: int | None = None) -> int:
    value = (row.get(key) or "").strip()
    if not value and default is not None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{where}: {key} must be an integer, got {value!r}") from None


def row_run(row: dict, where: str) -> tuple[ModelSpec, step_model.Parallel, str, float]:
    """A table row as (model, layout, device name, published TFLOP/s per GPU); ValueError naming row and column."""
    try:
        heads = _int(row, "num_attention_heads", where)
        seq = _int(row, "seq_length", where)
        spec = ModelSpec(num_layers=_int(row, "num_layers", where), hidden_size=_int(row, "hidden_size", where),
                         num_attention_heads=heads, num_query_groups=_int(row, "num_query_groups", where, heads),
                         ffn_hidden_size=_int(row, "ffn_hidden_size", where, 0) or None,
                         swiglu=_flag(row, "swiglu", where), vocab_size=_int(row, "vocab_size", where),
                         seq_length=seq, max_position_embeddings=seq,
                         normalization=(row.get("normalization") or "").strip() or "LayerNorm",
                         position_embedding_type=(row.get("position_embedding_type") or "").strip()
                         or "learned_absolute", add_bias_linear=not _flag(row, "disable_bias_linear", where),
                         untie_embeddings_and_output_weights=_flag(row, "untie_embeddings_and_output_weights", where))
        pp = _int(row, "pp", where)
        per_virtual = _int(row, "num_layers_per_virtual_pipeline_stage", where, 0) or None
        first = _int(row, "first_stage_layers", where, 0) or None
        last = _int(row, "last_stage_layers", where, 0) or None
        par = step_model.Parallel(
            cp=_int(row, "cp", where, 1), cp_comm_type=(row.get("cp_comm_type") or "").strip() or "p2p",
            first_stage_layers=first, last_stage_layers=last, tp_comm_overlap=_flag(row, "tp_comm_overlap", where),
            tp=_int(row, "tp", where), pp=pp, dp=_int(row, "dp", where),
            micro_batch_size=_int(row, "micro_batch_size", where),
            global_batch_size=_int(row, "global_batch_size", where), recompute=(row.get("recompute") or "").strip(),
            sequence_parallel=_flag(row, "sequence_parallel", where),
            distributed_optimizer=_flag(row, "distributed_optimizer", where),
            virtual_stages=_virtual(spec.num_layers, pp, per_virtual, first, last),
            overlap_grad_reduce=_flag(row, "overlap_grad_reduce", where),
            flash_attention=_flag(row, "use_flash_attn", where))
        step_model.check(spec, par)
        published = float(row["tflops_per_gpu"])
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}" if not str(exc).startswith(where) else str(exc)) from None
    return spec, par, (row.get("device") or DEFAULT_DEVICE).strip(), published


def row_count(row: dict, where: str) -> str:
    """The row's ``tflops_count`` (:data:`TFLOPS_COUNTS`; empty: megatron); ValueError naming row and value."""
    count = (row.get("tflops_count") or "").strip() or "megatron"
    if count not in TFLOPS_COUNTS:
        raise ValueError(f"{where}: tflops_count must be one of {', '.join(TFLOPS_COUNTS)}, got {count!r}")
    return count


def counted_tflops(r: step_model.Prediction, device: Device, count: str) -> float:
    """The prediction's TFLOP/s per GPU counted as the published figure counts them (:data:`TFLOPS_COUNTS`)."""
    return r.tflops_per_gpu if count == "megatron" else r.mfu * device.peak_flops / 1e12


def read_table(path: str | Path) -> list[dict]:
    """The rows of a published-runs CSV; ValueError naming the file and the missing or unknown column."""
    try:
        with open(path, newline="") as fh:
            reader = csv.DictReader(fh)
            rows = list(reader)
            header = reader.fieldnames or []
    except OSError as exc:
        raise ValueError(f"--table {str(path)!r} cannot be read: {exc.strerror}; check the path") from None
    missing = [c for c in COLUMNS if c not in header]
    unknown = [c for c in header if c not in COLUMNS + OPTIONAL]
    if missing or unknown:
        what = f"missing column {missing[0]!r}" if missing else f"unknown column {unknown[0]!r}"
        raise ValueError(f"--table {str(path)!r}: {what}; the columns are {', '.join(COLUMNS)} (optional: "
                         f"{', '.join(OPTIONAL)})")
    if not rows:
        raise ValueError(f"--table {str(path)!r} has no rows")
    return rows


def _table(args: argparse.Namespace) -> int:
    rows = read_table(args.table)
    devices: dict[str, Device] = {}
    results = []
    for i, row in enumerate(rows, start=2):
        where = f"{Path(args.table).name} line {i} ({row.get('model') or '?'})"
        spec, par, name, published = row_run(row, where)
        name = args.device or name
        device = devices.setdefault(name, load_device(name))
        r = step_model.predict(spec, par, device)
        results.append((row.get("model") or f"line {i}", spec, par, device, published, r,
                        counted_tflops(r, device, row_count(row, where))))
    w = max(12, *(len(res[0]) for res in results))
    head = (f"{'model':<{w}} {'TP':>3} {'CP':>3} {'PP':>3} {'DP':>4} {'mbs':>4} {'gbs':>5} {'recomp':>7} "
            f"{'published':>9} {'predicted':>9} {'error':>7} {'memory GiB':>10}")
    print(f"TFLOP/s per GPU (counted as each row's source counts them: Megatron-LM's count, or model FLOPs where "
          f"tflops_count is model), predicted by hetu_ext.plan.cost.step_model against {args.table}")
    print(head)
    out = []
    for model, spec, par, device, published, r, predicted in results:
        error = predicted / published - 1
        fits = "" if r.memory_bytes <= device.memory_bytes else " > device"
        print(f"{model:<{w}} {par.tp:>3} {par.cp:>3} {par.pp:>3} {par.dp:>4} {par.micro_batch_size:>4} "
              f"{par.global_batch_size:>5} "
              f"{par.recompute:>7} {published:>9.1f} {predicted:>9.1f} {error:>+7.1%} "
              f"{r.memory_bytes / 2**30:>10.1f}{fits}")
        out.append({"model": model, "published": published, "predicted": round(predicted, 2),
                    "error": round(error, 4)})
    worst = max(abs(o["error"]) for o in out)
    print(f"rows {len(out)}, largest |error| {worst:.1%}")
    print(json.dumps({"rows": out}))
    return 0
