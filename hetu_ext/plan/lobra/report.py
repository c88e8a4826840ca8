"""``python -m hetu_ext.plan lobra``'s work (pure): a deployment for the command line's settings and the report
(table) it prints; the flags are declared in :mod:`hetu_ext.plan.cli`."""

from __future__ import annotations

from hetu_ext.data.cost import load_cost_table
from hetu_ext.model.spec import ModelSpec
from hetu_ext.plan.core.plan import Plan
from hetu_ext.plan.lobra.deployment import deployment_plan, plan_deployment
from hetu_ext.plan.lobra.pool import MIN_CAPACITY, lobra_cost_model, strategy_pool
from hetu_ext.plan.lobra.step_time import homogeneous_s, sequential_s
from hetu_ext.plan.lobra.tenants import sample_steps, tenant_lengths


def deployment_report(args) -> tuple[Plan, str]:
    """Plan a deployment for ``args`` (the flags of :func:`hetu_ext.plan.cli.lobra_arguments`); the Plan and a
    report (table) to print."""
    from hetu_ext.config.tenants import load_tenants

    for flag in ("world_size", "gpus_per_node", "num_layers", "hidden_size", "num_attention_heads", "seq_length",
                 "steps"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    spec = ModelSpec(num_layers=args.num_layers, hidden_size=args.hidden_size,
                     num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
                     vocab_size=args.vocab_size, seq_length=args.seq_length)
    tenants = tenant_lengths(load_tenants(args.tenants), seed=args.seed)
    table = load_cost_table(args.cost_model) if args.cost_model else None
    pool = strategy_pool(spec, lobra_cost_model(), gpu_memory_bytes=args.gpu_memory_gib * 2**30,
                         gpus_per_node=args.gpus_per_node, max_gpus=args.world_size, table=table,
                         min_capacity=min(MIN_CAPACITY, args.seq_length))
    if not pool:
        raise ValueError(f"no (tp, pp) of at most {args.world_size} GPUs holds one token of this model in "
                         f"{args.gpu_memory_gib} GiB per GPU; use more GPUs or GPUs with more memory")
    batches = sample_steps(tenants, steps=args.steps, seed=args.seed, max_len=args.seq_length)
    best = plan_deployment(pool, batches, world_size=args.world_size, max_len=args.seq_length)
    strategy, homo = homogeneous_s(pool, batches, world_size=args.world_size, max_len=args.seq_length)
    seq = sequential_s(pool, batches, world_size=args.world_size, max_len=args.seq_length)
    plan = deployment_plan(best, num_layers=args.num_layers, gpus_per_node=args.gpus_per_node)
    n = args.world_size
    lines = ["strategy  GPUs  capacity (tokens)  replicas",
             "--------  ----  -----------------  --------"]
    chosen = dict((s.name, k) for s, k in best.counts)
    lines += [f"{s.name:<8}  {s.gpus:>4}  {s.capacity:>17}  {chosen.get(s.name, 0):>8}" for s in pool]
    lines += ["", f"deployment: {best.describe()} ({best.gpus} of {n} GPUs)",
              f"predicted step: LobRA {best.step_s:.3f} s ({best.step_s * n:.1f} GPU-s); homogeneous "
              f"{n // strategy.gpus} x {strategy.name}, Megatron-style packs {homo:.3f} s ({homo * n:.1f} GPU-s); "
              f"tenants one after another {seq:.3f} s ({seq * n:.1f} GPU-s)"]
    return plan, "\n".join(lines)
