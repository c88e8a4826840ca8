"""What a launch is, decided from the settings alone: the model, the plan (validated against the world size), the
runtime, pending migrations, the checkpoint format. Imports no Megatron (about 10 s of imports), so
pretrain_gpt.py's launcher checks all of it before it starts any rank, and every rank builds on the same answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetu_ext.config import CheckpointConfig, PackingConfig, ParallelConfig, RunConfig, TrainingConfig
from hetu_ext.config.spec import model_spec
from hetu_ext.plan.core.batches import global_batch_size
from hetu_ext.data.tokenizer import tokenizer_vocab_size
from hetu_ext.plan import ModelSpec, Plan, PlanError, load_plan, uniform_plan, uniform_shape


def plan_of(parallel: ParallelConfig, training: TrainingConfig, packing: PackingConfig, spec: ModelSpec,
            world_size: int) -> Plan:
    """The plan to run: ``--hetu-plan`` if given, else Megatron's uniform grid of the TP/PP/batch flags."""
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    cp = parallel.context_parallel_size
    mbs, gbs_flag = training.micro_batch_size, training.global_batch_size
    packed = packing.method != "off"  # microbatches are chosen per step by the packer
    if parallel.plan:
        plan = load_plan(parallel.plan)
    else:
        if world_size % (tp * cp * pp):
            cp_flag = f" x --context-parallel-size {cp}" if cp > 1 else ""
            raise PlanError(f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp}{cp_flag} "
                            f"x --pipeline-model-parallel-size {pp}; launch a multiple of {tp * cp * pp} ranks")
        dp = world_size // (tp * cp * pp)
        gbs = mbs * dp if packed else gbs_flag or mbs * dp
        if gbs % (mbs * dp):
            raise PlanError(f"--global-batch-size {gbs} must be a multiple of --micro-batch-size "
                            f"{mbs} x data-parallel size {dp} = {mbs * dp}")
        plan = uniform_plan(world_size=world_size, tp=tp, pp=pp, num_layers=spec.num_layers,
                            num_microbatches=gbs // (mbs * dp), cp=cp)
    plan.validate(spec, world_size)
    if not packed and gbs_flag and global_batch_size(plan, mbs) != gbs_flag:
        raise PlanError(f"the plan runs {plan.num_microbatches} microbatches of {mbs} = "
                        f"{global_batch_size(plan, mbs)} samples per step but --global-batch-size "
                        f"is {gbs_flag}; make them agree")
    return plan


def check_runnable(plan: Plan) -> None:
    """What the plan runtime runs of a valid plan: every stage holds a transformer layer, and the stages of one
    pipeline share one CP degree."""
    for i, pipeline in enumerate(plan.pipelines):
        for j, stage in enumerate(pipeline.stages):
            if stage.num_layers == 0:
                raise PlanError(f"pipeline {i} stage {j}: holds no transformer layer; the plan runtime needs at "
                                "least one layer per stage, so merge it into an adjacent stage")
            groups = [list(stage.cp_group(t)) for t in range(stage.tp)] if stage.cp > 1 else []
            if any(group != sorted(group) for group in groups):
                raise PlanError(f"pipeline {i} stage {j}: ranks {list(stage.ranks)} with cp {stage.cp}: the CP groups "
                                f"{groups} (the ranks at positions t, t + {stage.tp}, ...) must list their ranks in "
                                "increasing order (torch numbers a group's ranks so, and CP rank k holds chunks k and "
                                "2 cp - 1 - k); list the stage's TP groups in increasing rank order")
        cps = [stage.cp for stage in pipeline.stages]
        if len(set(cps)) > 1:
            raise PlanError(f"pipeline {i}: its stages have cp {cps}; the plan runtime runs one CP degree per "
                            "pipeline (each CP rank passes its own chunks of every sequence from stage to stage), "
                            "so give every stage of the pipeline the same cp (pipelines may differ)")


def parse_migrations(text: str) -> list[tuple[int, str]]:
    """``"step=3:plan=a.yaml,step=8:plan=b.yaml"`` -> [(3, "a.yaml"), (8, "b.yaml")] (after step 3, ...)."""
    out = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        fields = dict(kv.split("=", 1) for kv in item.split(":") if "=" in kv)
        if set(fields) != {"step", "plan"} or not fields["step"].isdigit() or int(fields["step"]) < 1:
            raise ValueError(f"--hetu-migrate {item!r}: expected step=N:plan=FILE with N >= 1 (migrate after step "
                             "N), several separated by commas")
        out.append((int(fields["step"]), fields["plan"]))
    steps = [s for s, _ in out]
    if steps != sorted(set(steps)):
        raise ValueError(f"--hetu-migrate: steps must increase, got {steps}")
    return out


def save_format(checkpoint: CheckpointConfig, parallel: ParallelConfig, runtime: str = "megatron") -> str:
    """The format ``--save`` writes: ``hetu`` or ``torch_dist`` (``auto`` resolved: torch_dist for Megatron's
    ZeRO-1 on its uniform runtime, as Megatron-LM saves it, hetu otherwise, the plan runtime's sharded optimizer
    included). ``hetu`` saves Megatron's ZeRO-1 too: its flat ranges as pieces (distopt_state.py)."""
    if checkpoint.format == "auto":
        return "torch_dist" if parallel.use_distributed_optimizer and runtime == "megatron" else "hetu"
    return checkpoint.format


def check_plan_runtime(checkpoint: CheckpointConfig, parallel: ParallelConfig) -> None:
    """The plan runtime saves the hetu format only (dist_checkpointing needs parallel_state's uniform grid)."""
    if checkpoint.save and save_format(checkpoint, parallel, "plan") == "torch_dist":
        raise PlanError("--hetu-ckpt-format torch_dist runs on Megatron's uniform runtime only; this plan runs on "
                        "the plan runtime, so save with --hetu-ckpt-format hetu (or auto)")


# ---------------------------------------------------------------- pieces of the training state


def select_runtime(config: RunConfig, plan: Plan) -> str:
    """``megatron`` (its parallel_state grid) for uniform plans unless asked otherwise; ``plan`` for the rest."""
    parallel, straggler = config.parallel, config.straggler
    if parallel.runtime == "megatron" and uniform_shape(plan) is None:
        raise PlanError("--hetu-runtime megatron can only run a uniform TP x PP x DP plan (same shape, TP degree "
                        "and microbatches in every pipeline, Megatron's rank order, no unused ranks); use "
                        "--hetu-runtime plan or auto")
    online = straggler.migrate or straggler.replan == "online"
    if online and parallel.runtime == "megatron":
        raise PlanError("changing plans online (--hetu-migrate, --hetu-straggler-replan online) needs the plan "
                        "runtime (Megatron's parallel_state cannot change layout in a running job); drop "
                        "--hetu-runtime megatron")
    if parallel.runtime == "plan" or uniform_shape(plan) is None or online:
        check_plan_runtime(config.checkpoint, parallel)
        return "plan"
    return "megatron"


@dataclass(frozen=True)
class LaunchCheck:
    """What a launch is, decided from the settings alone (no process group): the launcher checks it before it
    starts any rank, and every rank builds on it."""

    spec: ModelSpec
    plan: Plan
    migrations: list[tuple[int, Plan]]
    runtime: str
    """``megatron`` or ``plan`` (select_runtime)."""
    strategies: object = None
    """--hetu-hotspa / --hetu-strategies: the :class:`hetu_ext.plan.hotspa.StrategySet` (``plan`` is then the home
    strategy's)."""
    notices: tuple[str, ...] = ()
    """Lines the launcher prints and goes on (a setting that has no effect, as Megatron-LM warns and goes on)."""


def check_launch(config: RunConfig, world_size: int) -> LaunchCheck:
    """The model, the plan (validated against the model and ``world_size``), pending migrations and the runtime;
    PlanError / ValueError naming the rule, the values and the fix for anything that cannot run."""
    spec = model_spec(config.model, tokenizer_vocab_size(config.data.tokenizer_type, config.data.vocab_size))
    plan = plan_of(config.parallel, config.training, config.packing, spec, world_size)
    migrations = []
    for step, path in parse_migrations(config.straggler.migrate or ""):
        target = load_plan(path).validate(spec, world_size)
        if target.num_microbatches != plan.num_microbatches and config.packing.method == "off":
            raise PlanError(f"--hetu-migrate plan {path!r} runs {target.num_microbatches} microbatches per step but "
                            f"the run has {plan.num_microbatches}; keep the global batch the same")
        check_runnable(target)
        migrations.append((step, target))
    if (config.packing.hotspa or config.packing.strategies) and config.training.fp16:
        flag = "--hetu-hotspa" if config.packing.hotspa else "--hetu-strategies"
        raise ValueError(f"--fp16 is not supported with {flag}: the strategies' compute placements have no loss "
                         "scaler (the home's, which a rank idle at home lacks, would have to scale their loss); "
                         "use --bf16")
    strategies = hotspa_strategies(config, spec, world_size) \
        if config.packing.hotspa or config.packing.strategies else None
    if strategies is not None:
        plan = strategies.items[strategies.home].plan
        for strategy in strategies.items:
            check_runnable(strategy.plan)
    runtime = "plan" if strategies is not None else select_runtime(config, plan)
    if runtime == "plan":
        check_runnable(plan)
    check_context_parallel(config, [plan] + [target for _, target in migrations], strategies)
    notices = check_sequence_parallel(config, spec, [plan] + [target for _, target in migrations])
    return LaunchCheck(spec=spec, plan=plan, migrations=migrations, runtime=runtime, strategies=strategies,
                       notices=notices)


def check_context_parallel(config: RunConfig, plans: list[Plan], strategies=None) -> None:
    """Context parallelism (a stage with cp > 1) runs on hetu_ext's trainer with the local spec's SDPA attention
    (megatron/context_parallel.py); what it is not built with is refused here, in one line."""
    if strategies is not None:
        plans = plans + [s.plan for s in strategies.items]
    cps = sorted({stage.cp for plan in plans for pipeline in plan.pipelines for stage in pipeline.stages})
    if cps[-1] == 1:
        return
    model, parallel = config.model, config.parallel
    refused = [
        (strategies is not None, "--hetu-hotspa / --hetu-strategies (the switching layer moves whole sequences)",
         "drop cp from the strategies"),
        (bool(config.lora.tenants), "--hetu-lora-tenants (the adapters' reduction knows no CP ranks)",
         "drop --hetu-lora-tenants"),
        (parallel.sequence_parallel, "--sequence-parallel", "drop --sequence-parallel"),
        (model.transformer_impl != "local", f"--transformer-impl {model.transformer_impl}",
         "give --transformer-impl local"),
        (model.attention != "sdpa", f"--hetu-attention {model.attention}", "give --hetu-attention sdpa"),
        (config.straggler.interval > 0, "--hetu-straggler-interval (its FLOP counts assume whole sequences)",
         "drop --hetu-straggler-interval"),
    ]
    for bad, what, fix in refused:
        if bad:
            raise ValueError(f"context parallelism (cp {cps[-1]} in the plan) is not built with {what}; {fix}, "
                             "or use cp 1")


def check_sequence_parallel(config: RunConfig, spec: ModelSpec, plans: list[Plan]) -> tuple[str, ...]:
    """--sequence-parallel against the plans: it acts in stages of TP > 1 (Megatron-LM turns it off at TP 1 with a
    warning; so do we, as a notice), whose sequence must split evenly; packs and LoRA adapters do not take it."""
    if not config.parallel.sequence_parallel:
        return ()
    tps = sorted({stage.tp for plan in plans for pipeline in plan.pipelines for stage in pipeline.stages})
    if tps == [1]:
        return ("--sequence-parallel has no effect at TP 1 (every stage of the plan has TP 1); turned off, as "
                "Megatron-LM does",)
    uneven = [tp for tp in tps if spec.seq_length % tp]
    if uneven:
        raise PlanError(f"--sequence-parallel splits each sequence over a stage's TP ranks, but --seq-length "
                        f"{spec.seq_length} is not divisible by TP {uneven[0]}; choose a multiple of {uneven[0]}")
    if config.packing.method != "off":
        raise ValueError(f"--sequence-parallel does not take packed microbatches (--hetu-packing "
                         f"{config.packing.method}): a pack's documents would be cut between TP ranks; drop one")
    if config.lora.tenants:
        raise ValueError("--sequence-parallel with --hetu-lora-tenants: the adapters read whole sequences; drop "
                         "--sequence-parallel")
    return ()


HOTSPA_METHODS = ("unpacked", "ffd", "greedy", "balanced")


def hotspa_strategies(config: RunConfig, spec: ModelSpec, world_size: int):
    """--hetu-hotspa or --hetu-strategies, FILE or auto: the strategies, checked against the run (one-line
    errors). Both run through the switching layer with the home strategy holding the optimizer."""
    from hetu_ext.data.cost import CostTable, load_cost_table
    from hetu_ext.plan.hotspa import auto_strategies, load_strategies

    packing, straggler = config.packing, config.straggler
    if packing.hotspa and packing.strategies:
        raise ValueError(f"--hetu-hotspa {packing.hotspa} and --hetu-strategies {packing.strategies} both choose "
                         "the step's strategies; keep one (HotSPa: one strategy per length group; Hydraulis: one "
                         "candidate plan per step)")
    flag, value = ("--hetu-hotspa", packing.hotspa) if packing.hotspa else ("--hetu-strategies", packing.strategies)
    if packing.method not in HOTSPA_METHODS:
        raise ValueError(f"{flag} needs --hetu-packing one of {list(HOTSPA_METHODS)} (each step's sequences are "
                         f"packed for the strategy that runs them), got --hetu-packing {packing.method}")
    if straggler.migrate or straggler.replan == "online" or config.parallel.use_distributed_optimizer:
        raise ValueError(f"{flag} runs with a fixed home plan and a replicated optimizer: drop --hetu-migrate, "
                         "--hetu-straggler-replan online and --use-distributed-optimizer")
    if config.parallel.plan:
        raise ValueError(f"{flag} sets the plans (its home strategy holds the optimizer); drop --hetu-plan "
                         f"{config.parallel.plan} or give that plan as a strategy in the {flag} file")
    cost = load_cost_table(packing.cost_model) if packing.cost_model else CostTable()
    if value == "auto" and flag == "--hetu-hotspa":
        strategies = auto_strategies(spec, world_size, cost)
    elif value == "auto":
        strategies = hydraulis_candidates(config, spec, world_size, cost)
    else:
        strategies = load_strategies(value, model=spec, world_size=world_size, flag=flag)
    if strategies.capacity < spec.seq_length:
        raise ValueError(f"{flag}: sequences of up to --seq-length {spec.seq_length} tokens are longer than "
                         f"every strategy takes (the largest capacity is {strategies.capacity} tokens); give a "
                         f"strategy max_len {spec.seq_length} or lower --seq-length to {strategies.capacity}")
    home = strategies.items[strategies.home]
    if set(home.plan.used_ranks) != set(range(world_size)):
        raise ValueError(f"{flag}: the home strategy {home.name!r} uses ranks {list(home.plan.used_ranks)} "
                         f"of {world_size}; the home holds the optimizer and must use every rank")
    return strategies


def hydraulis_candidates(config: RunConfig, spec: ModelSpec, world_size: int, cost):
    """--hetu-strategies auto: Hydraulis's candidate plans for the training sequences' length histogram (the
    corpus of --data-path or --hetu-varlen-mock, cut at --seq-length as training cuts it)."""
    import numpy as np

    from hetu_ext.data.lengths import parse_length_spec
    from hetu_ext.data.sequences import SequenceTable
    from hetu_ext.plan.hydraulis import candidate_strategies

    from .packed_data import IndexedDocuments

    packing = config.packing
    if config.data.data_path:
        token_counts = IndexedDocuments(config.data.data_path[0]).token_counts
    elif packing.varlen_mock:
        token_counts = np.asarray(parse_length_spec(packing.varlen_mock).sample(packing.mock_documents,
                                                                                config.training.seed)) + 1
    else:
        raise ValueError("--hetu-strategies auto needs the corpus' lengths: give --data-path or --mock-data with "
                         "--hetu-varlen-mock, or a --hetu-strategies FILE of candidate plans")
    lengths = SequenceTable.from_documents(np.asarray(token_counts, dtype=np.int64), spec.seq_length).length
    return candidate_strategies(spec, world_size, cost, lengths.tolist(), max_len=spec.seq_length,
                                gpus_per_node=config.straggler.gpus_per_node or world_size)
