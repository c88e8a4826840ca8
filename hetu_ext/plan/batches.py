"""Which samples of a global batch each pipeline's microbatches get (pure).

Global batch ``g`` is samples ``[g B, (g + 1) B)`` with ``B = micro_batch_size x (microbatches of all pipelines)``.
Pipelines take consecutive runs of it in pipeline order, pipeline i receiving ``num_microbatches_i`` microbatches
of ``micro_batch_size`` consecutive samples. Every sample is used exactly once per global batch under any plan,
so a plan change never skips or repeats a sample.
"""

from __future__ import annotations

from hetu_ext.config import PackingConfig, TrainingConfig

from .plan import Plan


def global_batch_size(plan: Plan, micro_batch_size: int) -> int:
    return micro_batch_size * plan.num_microbatches


def microbatch_samples(plan: Plan, pipeline: int, iteration: int, micro_batch_size: int) -> list[range]:
    """Sample ids of each microbatch pipeline ``pipeline`` runs in ``iteration`` (0-based)."""
    start = iteration * global_batch_size(plan, micro_batch_size)
    start += micro_batch_size * sum(p.num_microbatches for p in plan.pipelines[:pipeline])
    return [range(start + m * micro_batch_size, start + (m + 1) * micro_batch_size)
            for m in range(plan.pipelines[pipeline].num_microbatches)]


def scheduler_unit(training: TrainingConfig, packing: PackingConfig, plan: Plan) -> int:
    """What one step advances the LR schedule by: its samples, as Megatron-LM counts; with --hetu-packing a
    global batch's sequence count varies (token budgets), so the schedule counts steps."""
    return 1 if packing.method != "off" else global_batch_size(plan, training.micro_batch_size)
