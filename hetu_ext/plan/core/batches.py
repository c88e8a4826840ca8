"""Which samples of a global batch each pipeline's microbatches get (pure).

Global batch ``g`` is samples ``[g B, (g + 1) B)`` with ``B = micro_batch_size x (microbatches of all pipelines)``.
Pipelines take consecutive runs of it in pipeline order, pipeline i receiving ``num_microbatches_i`` microbatches
of ``micro_batch_size`` consecutive samples. Every sample is used exactly once per global batch under any plan,
so a plan change never skips or repeats a sample.

With ``--rampup-batch-size`` (:class:`BatchRamp`) global batch ``g`` is instead the samples consumed before it
onward, its size the ramp's; its microbatches are shared among the pipelines in proportion to their planned
counts (:func:`split_microbatches`).
"""

from __future__ import annotations

from dataclasses import dataclass

from hetu_ext.config import PackingConfig, TrainingConfig

from hetu_ext.plan.core.plan import Plan


def global_batch_size(plan: Plan, micro_batch_size: int) -> int:
    return micro_batch_size * plan.num_microbatches


def microbatch_samples(plan: Plan, pipeline: int, iteration: int, micro_batch_size: int,
                       ramp: BatchRamp | None = None) -> list[range]:
    """Sample ids of each microbatch pipeline ``pipeline`` runs in ``iteration`` (0-based); with a ``ramp``
    the step starts at the samples consumed before it and its microbatches are :func:`split_microbatches`'."""
    if ramp is None:
        start = iteration * global_batch_size(plan, micro_batch_size)
    else:
        start = ramp.consumed(iteration)
    counts = step_microbatches(plan, ramp, iteration, micro_batch_size)
    start += micro_batch_size * sum(counts[:pipeline])
    return [range(start + m * micro_batch_size, start + (m + 1) * micro_batch_size)
            for m in range(counts[pipeline])]


def scheduler_unit(training: TrainingConfig, packing: PackingConfig, plan: Plan) -> int:
    """What one step advances the LR schedule by: its samples, as Megatron-LM counts; with --hetu-packing a
    global batch's sequence count varies (token budgets), so the schedule counts steps."""
    return 1 if packing.method != "off" else global_batch_size(plan, training.micro_batch_size)


@dataclass(frozen=True)
class BatchRamp:
    """Megatron-LM's ``--rampup-batch-size START INCREMENT SAMPLES``: the global batch of each step, in samples.

    A step that begins after ``consumed`` samples has ``START + INCREMENT x int(consumed / (SAMPLES / n))``
    samples, ``n = (global_batch - START) / INCREMENT`` increments (megatron-core's
    ``RampupBatchsizeNumMicroBatchesCalculator``, the same float arithmetic), and ``global_batch`` once
    ``consumed > SAMPLES``. The data position of step ``i`` is the samples consumed before it (not ``i x global
    batch``), and the LR schedule advances by each step's global batch (Megatron-LM's ``train_step``)."""

    start: int
    increment: int
    samples: int
    global_batch: int
    ramp: tuple[int, ...] = ()
    """The global batches of the steps that begin at or before ``samples`` consumed samples (derived)."""

    def __post_init__(self) -> None:
        assert 0 < self.start < self.global_batch and self.increment > 0 and self.samples > 0, self
        assert (self.global_batch - self.start) % self.increment == 0, self
        if not self.ramp:
            ramp, consumed = [], 0
            while consumed <= self.samples:
                ramp.append(self.batch_at(consumed))
                consumed += ramp[-1]
            object.__setattr__(self, "ramp", tuple(ramp))

    def batch_at(self, consumed: int) -> int:
        """The global batch of a step that begins after ``consumed`` samples (megatron-core's formula)."""
        if consumed > self.samples:
            return self.global_batch
        per_increment = self.samples / ((self.global_batch - self.start) // self.increment)
        return self.start + int(consumed / per_increment) * self.increment

    def batch(self, iteration: int) -> int:
        """The global batch of step ``iteration`` (0-based)."""
        return self.ramp[iteration] if iteration < len(self.ramp) else self.global_batch

    def consumed(self, iteration: int) -> int:
        """Samples consumed before step ``iteration`` (0-based): the data position."""
        done = min(iteration, len(self.ramp))
        return sum(self.ramp[:done]) + (iteration - done) * self.global_batch

    def train_iters(self, train_samples: int) -> int:
        """Steps of a ``--train-samples`` run, as Megatron-LM's ``update_train_iters``: the ramp's steps while
        at most SAMPLES and at most ``train_samples`` samples were consumed before them, then whole global
        batches (a partial last one is dropped)."""
        iterations = consumed = 0
        while consumed <= self.samples and consumed <= train_samples:
            consumed += self.batch(iterations)
            iterations += 1
        if train_samples > consumed:
            iterations += (train_samples - consumed) // self.global_batch
        return iterations

    def sizes(self) -> list[int]:
        """Every distinct global batch of the ramp, and the final one."""
        return sorted(set(self.ramp) | {self.global_batch})


def batch_ramp(training: TrainingConfig) -> BatchRamp | None:
    """The run's :class:`BatchRamp` (None without ``--rampup-batch-size``)."""
    if not training.rampup_batch_size:
        return None
    start, increment, samples = (int(v) for v in training.rampup_batch_size)
    return BatchRamp(start=start, increment=increment, samples=samples, global_batch=training.global_batch_size)


def split_microbatches(plan: Plan, num_microbatches: int) -> list[int]:
    """A step's ``num_microbatches`` shared among the plan's pipelines in proportion to their planned
    ``num_microbatches`` (largest remainder: each pipeline gets the floor of its quota, the microbatches left
    go one each to the largest remainders, ties to the lower pipeline index). At the planned total every
    pipeline gets its planned count; on a uniform plan the counts are equal when the total divides evenly."""
    weights = [p.num_microbatches for p in plan.pipelines]
    total = sum(weights)
    counts = [num_microbatches * w // total for w in weights]
    left = num_microbatches - sum(counts)
    order = sorted(range(len(weights)), key=lambda i: (-(num_microbatches * weights[i] % total), i))
    for i in order[:left]:
        counts[i] += 1
    return counts


def step_microbatches(plan: Plan, ramp: BatchRamp | None, iteration: int, micro_batch_size: int) -> list[int]:
    """Each pipeline's microbatches in step ``iteration`` (the plan's without a ramp)."""
    if ramp is None:
        return [p.num_microbatches for p in plan.pipelines]
    return split_microbatches(plan, ramp.batch(iteration) // micro_batch_size)


def check_ramp(plan: Plan, ramp: BatchRamp | None, micro_batch_size: int) -> None:
    """Every global batch of the ramp gives every pipeline at least one microbatch (a pipeline's schedule cannot
    run none); ValueError naming the batch and the shares otherwise."""
    if ramp is None:
        return
    for batch in ramp.sizes():
        counts = split_microbatches(plan, batch // micro_batch_size)
        if min(counts) < 1:
            raise ValueError(f"--rampup-batch-size {ramp.start} {ramp.increment} {ramp.samples}: a global batch of "
                             f"{batch} samples ({batch // micro_batch_size} microbatches) gives the plan's "
                             f"{len(counts)} pipelines {counts} microbatches (in proportion to their planned "
                             f"{[p.num_microbatches for p in plan.pipelines]}); every pipeline needs at least one: "
                             "give a larger START")
