"""The Plan: which rank holds which layers and how many microbatches each pipeline runs (pure: no torch).

Words, as in DESIGN.md: a **stage** is a tensor-parallel group of ranks holding a contiguous range of layers; a
**pipeline** (= replica) is an ordered list of stages that together hold every layer once; a **plan** is the
pipelines, each pipeline's microbatch count, and the unused ranks.

    >>> plan = uniform_plan(world_size=8, tp=2, pp=2, num_layers=4, num_microbatches=2)
    >>> plan.pipelines[1].stages[0].ranks
    (2, 3)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hetu_ext.model import inventory
from hetu_ext.model.spec import ModelSpec


class PlanError(ValueError):
    """A plan that breaks a rule; the message names the rule, the values and the fix."""


@dataclass(frozen=True, kw_only=True)
class Stage:
    """One TP group holding layers ``[layer_start, layer_stop)`` of one pipeline."""

    ranks: tuple[int, ...]
    """Global ranks of the stage, in TP-rank order (with CP: ``cp`` TP groups, CP rank ``k // tp`` and TP rank
    ``k % tp`` at position k)."""
    layer_start: int
    """First layer held (0-based, inclusive)."""
    layer_stop: int
    """One past the last layer held (exclusive); equal to layer_start for an embedding- or loss-only stage."""
    has_embedding: bool = False
    """Holds the word and position embeddings (the first stage of its pipeline)."""
    has_output: bool = False
    """Holds the final norm, output layer and loss (the last stage of its pipeline)."""
    cp: int = 1
    """Context-parallel degree (``--context-parallel-size``; YAML ``cp:``): the stage's ranks are ``cp`` TP groups,
    each holding two load-balanced chunks of every sequence."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(self.ranks))

    @property
    def tp(self) -> int:
        return len(self.ranks) // self.cp

    @property
    def num_layers(self) -> int:
        return self.layer_stop - self.layer_start

    def position(self, rank: int) -> tuple[int, int]:
        """``(cp rank, tp rank)`` of a rank of this stage (position k: CP rank ``k // tp``, TP rank ``k % tp``)."""
        return divmod(self.ranks.index(rank), self.tp)

    def tp_group(self, cp_rank: int) -> tuple[int, ...]:
        """The ranks of CP rank ``cp_rank``'s TP group, in TP-rank order."""
        return self.ranks[cp_rank * self.tp:(cp_rank + 1) * self.tp]

    def cp_group(self, tp_rank: int) -> tuple[int, ...]:
        """The ranks that split every sequence with TP rank ``tp_rank`` (one per CP rank, in CP-rank order)."""
        return self.ranks[tp_rank::self.tp]

    @property
    def layers(self) -> range:
        return range(self.layer_start, self.layer_stop)


@dataclass(frozen=True, kw_only=True)
class Pipeline:
    """One replica of the model: stages in pipeline order and the microbatches it runs per step."""

    stages: tuple[Stage, ...]
    num_microbatches: int
    """Microbatches this pipeline runs per global batch (>= 1)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))

    @property
    def pp(self) -> int:
        return len(self.stages)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(r for s in self.stages for r in s.ranks)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Pipelines (each with its own stage count, layer split, TP degrees and microbatches) and unused ranks."""

    pipelines: tuple[Pipeline, ...]
    unused_ranks: tuple[int, ...] = field(default=())
    """Ranks that hold nothing this plan; they stay alive so a later plan may use them."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "pipelines", tuple(self.pipelines))
        object.__setattr__(self, "unused_ranks", tuple(self.unused_ranks))

    @property
    def world_size(self) -> int:
        return len(self.used_ranks) + len(self.unused_ranks)

    @property
    def used_ranks(self) -> tuple[int, ...]:
        return tuple(r for p in self.pipelines for r in p.ranks)

    @property
    def num_microbatches(self) -> int:
        """Microbatches of one global batch, over all pipelines."""
        return sum(p.num_microbatches for p in self.pipelines)

    @property
    def is_uniform(self) -> bool:
        """True when every pipeline has the same TP degrees, layer split and microbatch count."""
        first = self.pipelines[0]
        shape = [(s.tp, s.layer_start, s.layer_stop) for s in first.stages]
        return all([(s.tp, s.layer_start, s.layer_stop) for s in p.stages] == shape
                   and p.num_microbatches == first.num_microbatches for p in self.pipelines)

    def stage_of(self, rank: int) -> tuple[int, int] | None:
        """``(pipeline index, stage index)`` of a rank, or None if the rank is unused."""
        for i, pipeline in enumerate(self.pipelines):
            for j, stage in enumerate(pipeline.stages):
                if rank in stage.ranks:
                    return i, j
        return None

    def layers_of(self, rank: int) -> range:
        where = self.stage_of(rank)
        if where is None:
            return range(0)
        return self.pipelines[where[0]].stages[where[1]].layers

    def validate(self, model: ModelSpec | None = None, world_size: int | None = None) -> "Plan":
        """Check every rule; raise :class:`PlanError` naming the rule, the values and the fix. Returns self."""
        validate_plan(self, model, world_size)
        return self


def validate_plan(plan: Plan, model: ModelSpec | None = None, world_size: int | None = None) -> None:
    if not plan.pipelines:
        raise PlanError("plan: at least one pipeline is required, got none; add a pipeline under 'pipelines:'")
    seen: dict[int, str] = {}
    for rank in plan.unused_ranks:
        _claim(seen, rank, "unused_ranks")
    num_layers = None
    for i, pipeline in enumerate(plan.pipelines):
        where = f"pipeline {i}"
        if not isinstance(pipeline.num_microbatches, int) or pipeline.num_microbatches < 1:
            raise PlanError(f"{where}: num_microbatches must be an integer >= 1, got "
                            f"{pipeline.num_microbatches!r}; give every pipeline at least one microbatch")
        if not pipeline.stages:
            raise PlanError(f"{where}: a pipeline needs at least one stage, got none; add a stage")
        expected_start = 0
        for j, stage in enumerate(pipeline.stages):
            here = f"{where} stage {j}"
            if not stage.ranks:
                raise PlanError(f"{here}: a stage needs at least one rank, got ranks=[]; list its TP group's ranks")
            if isinstance(stage.cp, bool) or not isinstance(stage.cp, int) or stage.cp < 1 \
                    or len(stage.ranks) % stage.cp:
                raise PlanError(f"{here}: cp {stage.cp!r} must be an integer >= 1 dividing its {len(stage.ranks)} "
                                "ranks (cp TP groups of equal size); change cp or the ranks")
            for rank in stage.ranks:
                if not isinstance(rank, int) or rank < 0:
                    raise PlanError(f"{here}: ranks must be integers >= 0, got {rank!r}")
                _claim(seen, rank, here)
            if stage.layer_start != expected_start or stage.layer_stop < stage.layer_start:
                raise PlanError(f"{here}: layers must be contiguous and in order: expected it to start at layer "
                                f"{expected_start}, got layers [{stage.layer_start}, {stage.layer_stop}); make each "
                                "stage start where the previous one stops")
            expected_start = stage.layer_stop
            if stage.has_embedding != (j == 0):
                raise PlanError(f"{here}: has_embedding={stage.has_embedding} but the embedding belongs to the first "
                                "stage of each pipeline only; set has_embedding on stage 0 and nowhere else")
            if stage.has_output != (j == pipeline.pp - 1):
                raise PlanError(f"{here}: has_output={stage.has_output} but the output layer belongs to the last "
                                "stage of each pipeline only; set has_output on the last stage and nowhere else")
        if num_layers is None:
            num_layers = expected_start
        elif expected_start != num_layers:
            raise PlanError(f"{where}: holds layers [0, {expected_start}) but pipeline 0 holds [0, {num_layers}); "
                            "every pipeline must hold every layer once")
    if model is not None:
        _validate_against_model(plan, model, num_layers or 0)
    if world_size is not None:
        bad = sorted(r for r in seen if r >= world_size)
        missing = sorted(set(range(world_size)) - set(seen))
        if bad or missing:
            raise PlanError(f"plan: ranks must be exactly 0..{world_size - 1} (world size {world_size}); "
                            f"out of range: {bad}, not placed: {missing}; list missing ranks under unused_ranks "
                            "or launch with the plan's world size")


def _claim(seen: dict[int, str], rank: int, where: str) -> None:
    if rank in seen:
        raise PlanError(f"{where}: rank {rank} is already in {seen[rank]}; a rank may be in one stage (or unused) "
                        "only, so remove it from one of them")
    seen[rank] = where


def _validate_against_model(plan: Plan, model: ModelSpec, num_layers: int) -> None:
    if num_layers != model.num_layers:
        raise PlanError(f"plan: the pipelines hold {num_layers} layers but the model has num_layers="
                        f"{model.num_layers}; make the last stage stop at layer {model.num_layers}")
    for i, pipeline in enumerate(plan.pipelines):
        for j, stage in enumerate(pipeline.stages):
            if stage.cp > 1 and model.seq_length % (2 * stage.cp):
                raise PlanError(f"pipeline {i} stage {j}: --seq-length {model.seq_length} must be divisible by 2 x "
                                f"cp = {2 * stage.cp} (two chunks per CP rank); change cp or --seq-length")
            for what, size in inventory.tp_problems(model, stage.tp)[:1]:
                raise PlanError(f"pipeline {i} stage {j}: TP degree {stage.tp} must divide {what} ({size}); "
                                f"use a TP degree among {_divisors(size)}")


def _divisors(n: int, limit: int = 16) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def uniform_plan(*, world_size: int, tp: int = 1, pp: int = 1, num_layers: int,
                 num_microbatches: int = 1, cp: int = 1) -> Plan:
    """Megatron-LM's TP x CP x PP x DP grid as a Plan (rank order ``tp-cp-dp-pp``, Megatron's default).

    Rank ``r = t + tp * (c + cp * (d + dp * p))`` is TP rank t of CP rank c of stage p of pipeline d. Layers are
    split as Megatron splits them: evenly, ``num_layers / pp`` per stage.
    """
    for name, value in (("tensor-model-parallel-size", tp), ("pipeline-model-parallel-size", pp),
                        ("context-parallel-size", cp)):
        if value < 1:
            raise PlanError(f"--{name} must be >= 1, got {value}")
    if world_size % (tp * cp * pp):
        sizes = f"tensor x pipeline parallel size {tp}x{pp}" if cp == 1 else \
            f"tensor x context x pipeline parallel size {tp}x{cp}x{pp}"
        raise PlanError(f"world size {world_size} is not divisible by {sizes}={tp * cp * pp}; launch a multiple of "
                        f"{tp * cp * pp} ranks or change the parallel sizes")
    if num_layers % pp:
        raise PlanError(f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {pp}; "
                        "use a divisor of the layer count or give an explicit --hetu-plan")
    dp = world_size // (tp * cp * pp)
    per_stage = num_layers // pp
    pipelines = []
    for d in range(dp):
        stages = [Stage(ranks=tuple(t + tp * (c + cp * (d + dp * p)) for c in range(cp) for t in range(tp)),
                        layer_start=p * per_stage, layer_stop=(p + 1) * per_stage, has_embedding=p == 0,
                        has_output=p == pp - 1, cp=cp)
                  for p in range(pp)]
        pipelines.append(Pipeline(stages=tuple(stages), num_microbatches=num_microbatches))
    return Plan(pipelines=tuple(pipelines))


def uniform_shape(plan: Plan) -> tuple[int, int, int] | None:
    """``(tp, pp, dp)`` if the plan is exactly Megatron's grid with rank order tp-dp-pp (no CP), else None."""
    if not plan.is_uniform or plan.unused_ranks or any(s.cp > 1 for p in plan.pipelines for s in p.stages):
        return None
    first = plan.pipelines[0]
    tps = {s.tp for s in first.stages}
    if len(tps) != 1:
        return None
    tp, pp, dp = tps.pop(), first.pp, len(plan.pipelines)
    if plan.num_microbatches % dp:
        return None
    num_layers = first.stages[-1].layer_stop
    if num_layers % pp:
        return None
    expected = uniform_plan(world_size=tp * pp * dp, tp=tp, pp=pp, num_layers=num_layers,
                            num_microbatches=first.num_microbatches)
    return (tp, pp, dp) if expected == plan else None


@dataclass(frozen=True)
class Neighbours:
    """Point-to-point peers of one rank inside its pipeline (activations are replicated across a TP group)."""

    stage: int
    num_stages: int
    recv_forward_from: int | None
    send_forward_to: tuple[int, ...]
    recv_backward_from: int | None
    send_backward_to: tuple[int, ...]


def neighbours(plan: Plan, rank: int) -> Neighbours:
    """Who sends to and receives from ``rank`` when adjacent stages differ in TP degree.

    A receiver with TP index t takes the tensor from the adjacent stage's rank ``t mod tp_sender``; every TP
    rank of a stage holds the same stage input and output (no sequence parallelism), so any copy serves. A
    sender therefore sends to each adjacent rank whose index maps to it (one, or several when the adjacent
    stage has the larger TP degree). Under context parallelism (every stage of a pipeline has the same ``cp``)
    this holds within each CP rank's TP groups: CP rank c's chunks pass between the stages' CP-rank-c groups.
    """
    where = plan.stage_of(rank)
    if where is None:
        raise PlanError(f"rank {rank} is unused in this plan; it has no pipeline neighbours")
    stages = plan.pipelines[where[0]].stages
    j = where[1]
    if len({s.cp for s in stages}) > 1:
        raise PlanError(f"pipeline {where[0]}: its stages have cp {[s.cp for s in stages]}, but the stages of one "
                        "pipeline must share one CP degree (each CP rank passes its own chunks of the sequence "
                        "along); give every stage of the pipeline the same cp")
    c, t = stages[j].position(rank)

    def source(adjacent: Stage) -> int:
        return adjacent.tp_group(c)[t % adjacent.tp]

    def targets(adjacent: Stage) -> tuple[int, ...]:
        return tuple(r for u, r in enumerate(adjacent.tp_group(c)) if u % stages[j].tp == t)

    prev = stages[j - 1] if j > 0 else None
    nxt = stages[j + 1] if j + 1 < len(stages) else None
    return Neighbours(stage=j, num_stages=len(stages),
                      recv_forward_from=source(prev) if prev else None,
                      send_forward_to=targets(nxt) if nxt else (),
                      recv_backward_from=source(nxt) if nxt else None,
                      send_backward_to=targets(prev) if prev else ())
