"""``python -m hetu_ext.plan hydraulis``'s work (pure): candidates for the command line's settings and the report
(tables) it prints; the flags are declared in :mod:`hetu_ext.plan.cli`."""

from __future__ import annotations

import numpy as np

from hetu_ext.data.cost import CostTable
from hetu_ext.data.lengths import split_long
from hetu_ext.model.spec import ModelSpec
from hetu_ext.plan.core.options import PLAIN, Options
from hetu_ext.plan.core.replicas import replica_specs
from hetu_ext.plan.core.strategies import StrategySet
from hetu_ext.plan.hydraulis.candidates import candidate_strategies, sample_batches
from hetu_ext.plan.hydraulis.dynamic_program import MAX_PP
from hetu_ext.plan.hydraulis.flops import flops_cost_table, sync_seconds
from hetu_ext.plan.hydraulis.selection import Selector
from hetu_ext.plan.hydraulis.strategies_file import replicas_of


def candidates_report(args) -> tuple[StrategySet, str, ModelSpec]:
    """Candidates for ``args`` (the flags of :func:`hetu_ext.plan.cli.hydraulis_arguments`) and a report (tables)
    to print; ValueError (one line) on bad input."""
    from hetu_ext.data.cost import load_cost_table
    from hetu_ext.data.lengths import read_lengths

    for flag in ("world_size", "gpus_per_node", "num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "batches", "limit"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not args.gpu_memory_gib > 0 or not args.bandwidth > 0:
        raise ValueError(f"--gpu-memory-gib and --bandwidth must be > 0, got {args.gpu_memory_gib}, "
                         f"{args.bandwidth}")
    model = ModelSpec(num_layers=args.num_layers, hidden_size=args.hidden_size,
                      num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
                      vocab_size=args.vocab_size, seq_length=args.seq_length)
    measured = load_cost_table(args.cost_model) if args.cost_model else None
    pieces = split_long(read_lengths(args.lengths), args.seq_length).length
    tokens = args.batch_tokens or 32768 * args.world_size
    if tokens < 1:
        raise ValueError(f"--batch-tokens must be >= 1, got {tokens}")
    if args.sampled_batches < 0:
        raise ValueError(f"--sampled-batches must be >= 0, got {args.sampled_batches}")
    rc = args.recompute_granularity
    sets = [Options(recompute=r, sequence_parallel=args.sequence_parallel,
                    distributed_optimizer=args.use_distributed_optimizer)
            for r in (("none", "full") if rc == "auto" else (rc,))]
    if measured is not None:
        sets = [PLAIN]  # a measured table is one set of options already
    best, errors = None, []
    for opts in sets:
        try:
            got = _plan_once(args, model, measured, opts, pieces, tokens)
        except ValueError as exc:  # nothing fits under these options; another set may
            errors.append(str(exc))
            continue
        if best is None or got[2] < best[2]:
            best = got
    if best is None:
        raise ValueError(errors[-1])
    strategies, lines = best[0], best[1]
    if measured is None:
        lines.insert(0, f"options: {best[3].name} (Megatron-LM flags: {' '.join(best[3].flags()) or 'none'}; "
                        f"searched: {', '.join(o.name for o in sets)}, by the mean predicted step of the sampled "
                        "batches)")
    return strategies, "\n".join(lines), model


def _plan_once(args, model: ModelSpec, measured: CostTable | None, opts: Options, pieces: np.ndarray,
               tokens: int) -> tuple[StrategySet, list[str], float, Options]:
    """run()'s candidates and report under one set of options; the mean predicted step of the sampled batches
    (inf when no homogeneous strategy to compare with; the dynamic choice's own mean otherwise)."""
    import time

    from hetu_ext.plan.hotspa import auto_strategies, group_seconds

    cost = measured
    if cost is None or cost.device_memory_bytes is None:
        memory = args.gpu_memory_gib * 2**30
        cost = flops_cost_table(model, memory_bytes=memory, options=opts, world_size=args.world_size) \
            if cost is None else CostTable(per_tp=cost.per_tp, device=cost.device, device_memory_bytes=memory,
                                           note=cost.note)
    start = time.perf_counter()
    strategies = candidate_strategies(model, args.world_size, cost, pieces, max_len=args.seq_length,
                                      gpus_per_node=args.gpus_per_node, limit=args.limit, batch_tokens=tokens,
                                      sampled_batches=args.sampled_batches, seed=args.seed + 1)
    plan_s = time.perf_counter() - start
    bandwidth = args.bandwidth * 1e9
    selector = Selector(strategies, model, cost, bandwidth=bandwidth)
    home_sync = sync_seconds(strategies.items[strategies.home].plan, model, bandwidth=bandwidth)
    lines = [f"cost: {cost.device}, {cost.device_memory_bytes / 2**30:.3g} GiB per GPU; {args.world_size} GPUs; "
             f"{len(strategies.items)} candidates in {plan_s:.2f} s",
             "", f"{'candidate':<36} {'GPUs':>4} {'max_len':>7} {'switch_s':>8}  replicas TPxPP (count): capacity",
             f"{'-' * 36} {'-' * 4} {'-' * 7} {'-' * 8}  {'-' * 40}"]
    for k, s in enumerate(strategies.items):
        caps = {}
        for p, spec in zip(s.plan.pipelines, replica_specs(s.plan, model, cost, max_pack_tokens=s.max_len)):
            caps[(p.stages[0].tp, p.pp, p.stages[0].cp)] = spec.token_capacity
        reps = ", ".join(f"{tp}x{pp}{f' CP{cp}' if cp > 1 else ''} ({n}): {caps[(tp, pp, cp)]}"
                         for tp, pp, n, cp in replicas_of(s))
        name = s.name + (" (home)" if k == strategies.home else "")
        lines.append(f"{name:<36} {len(s.plan.used_ranks):>4} {s.max_len:>7} {selector.switch_s[k]:>8.3f}  {reps}")
    batches = sample_batches(pieces, tokens=tokens, count=args.batches, seed=args.seed)
    homogeneous = [h for h in auto_strategies(model, args.world_size, cost, max_pp=MAX_PP).items
                   if h.max_len >= max(max(b) for b in batches)]
    homo_s = {h.name: [group_seconds(h.plan, model, cost, b, h.max_len)
                       + sync_seconds(h.plan, model, bandwidth=bandwidth) for b in batches] for h in homogeneous}
    best_homo = min(homo_s, key=lambda n: sum(homo_s[n])) if homo_s else None
    lines += ["", f"sampled batches ({tokens} tokens each; time = compute + switch + gradient all-reduce; "
              f"homogeneous: {best_homo or 'none holds the longest sequence'}, the same packer)",
              f"{'batch':>5} {'seqs':>5} {'longest':>7} {'chosen':<36} {'select_ms':>9} {'dynamic_s':>9} "
              f"{'homog_s':>8} {'gain':>6}"]
    dyn_all = []
    for g, b in enumerate(batches):
        start = time.perf_counter()
        k, t, _ = selector.choose(b)
        ms = (time.perf_counter() - start) * 1e3
        dyn = t + home_sync
        dyn_all.append(dyn)
        homo = homo_s[best_homo][g] if best_homo else float("nan")
        lines.append(f"{g:>5} {len(b):>5} {max(b):>7} {strategies.items[k].name:<36} {ms:>9.1f} {dyn:>9.3f} "
                     f"{homo:>8.3f} {homo / dyn:>5.2f}x")
    if best_homo:
        lines.append(f"mean: dynamic {np.mean(dyn_all):.3f} s, homogeneous {best_homo} {np.mean(homo_s[best_homo]):.3f}"
                     f" s, predicted gain {np.mean(homo_s[best_homo]) / np.mean(dyn_all):.2f}x")
    return strategies, lines, float(np.mean(dyn_all)), opts
