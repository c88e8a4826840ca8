"""Straggler measurement and per-data-parallel-rank microbatch weighting on Megatron-LM's own loop
(``--hetu-straggler-interval N``): Malleus's data weighting on Megatron's uniform grid.

Megatron-LM gives every data-parallel rank ``global batch / (micro batch x DP)`` microbatches per step, so the step
waits for the slowest rank. Here each rank's transformer layers are timed (hetu_ext's :class:`LayerTimer`, with
the same emulation of slow ranks as hetu_ext's trainer: ``--hetu-emulate-slowdown``, ``--hetu-emulate-layer-ms``);
every N steps the ranks exchange their compute seconds per microbatch-layer (one all_gather_object), and every rank
runs the same detector (hysteresis: ``--hetu-straggler-threshold/-min-change/-window``). When the stragglers
change, the step's microbatches are split over the data-parallel ranks in proportion to their measured speed
(Malleus's :func:`balance_microbatches`, at least one each): a slow rank runs fewer. The global batch stays the same
samples: step t reads samples ``[t G, (t + 1) G)`` of Megatron-LM's train dataset, and rank r takes a contiguous
block of ``count_r`` microbatches of them. With ``--calculate-per-token-loss`` (required, and added by the entry
point) Megatron-LM's loss and gradients are sums over the global batch's tokens divided by their count, so they
do not depend on which rank ran which sample.

Patch points (``megatron.training.training``): ``setup_model_and_optimizer`` (attach the timer),
``build_pretraining_data_loader`` (the train loader), ``train_step`` (emulation, measurement, detection),
``get_forward_backward_func`` (this rank's microbatch count). The monitor's lines go to Megatron-LM's log::

    straggler monitor: step 6 | slowest: rank 1 x3.02 | median: x2.01 | stragglers: rank 1 x3.02 |
    straggler monitor: step 6: stragglers rank 1 x3.02, 4 steps after onset
    straggler monitor: microbatches per data-parallel rank: 6, 2 (were 4, 4)
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from hetu_ext.patches.base import Patch
from hetu_ext.plan.malleus import balance_microbatches
from hetu_ext.plan.malleus.straggler_policy import StragglerDetector, StragglerPolicy
from hetu_ext.runtime.straggler import LayerTimer, exchange_timings, factor_at, onset_latency, parse_schedule

TRAINING = "megatron.training.training"


def weighted_counts(total: int, slowdowns: list[float], pp: int = 1) -> list[int]:
    """Microbatches per data-parallel rank for a step of ``total``, in proportion to speed (1 / slowdown), at
    least one each (a pipeline of ``pp`` stages pays a fill of ``pp`` microbatch times)."""
    if total < len(slowdowns):
        raise ValueError(f"{total} microbatches cannot give each of {len(slowdowns)} data-parallel ranks one")
    counts = balance_microbatches(total, list(slowdowns), [x * pp for x in slowdowns])
    for i in range(len(counts)):
        while counts[i] < 1:
            donor = max(range(len(counts)), key=lambda k: counts[k])
            counts[donor] -= 1
            counts[i] += 1
    return counts


@dataclass
class WeightedLoader:
    """Megatron-LM's train loader with microbatches per data-parallel rank given by ``counts`` (read at the start
    of each step): step t's samples are ``start + [t G, (t + 1) G)``; this rank's are a contiguous block."""

    dataset: Any
    start: int
    """Samples consumed before the first step (``--load``)."""
    micro_batch: int
    dp_rank: int
    counts: list[int]
    collate: Callable = torch.utils.data.default_collate

    def __iter__(self):
        step = 0
        global_batch = sum(self.counts) * self.micro_batch
        while True:
            counts = list(self.counts)
            if sum(counts) * self.micro_batch != global_batch:
                raise AssertionError(f"microbatch counts {counts} do not make the global batch {global_batch}")
            first = self.start + step * global_batch + sum(counts[:self.dp_rank]) * self.micro_batch
            for k in range(counts[self.dp_rank]):
                lo = first + k * self.micro_batch
                yield self.collate([self.dataset[i] for i in range(lo, lo + self.micro_batch)])
            step += 1


@dataclass
class StragglerWeighting:
    """The monitor and the weighting, one object per process."""

    interval: int
    policy: StragglerPolicy
    emulate: str | None = None
    layer_ms: float | None = None
    log: Callable[[str], None] = field(default=lambda line: print(line, flush=True))
    timer: LayerTimer = field(default_factory=LayerTimer)
    counts: list[int] = field(default_factory=list)
    loader: WeightedLoader | None = None
    detector: StragglerDetector = field(init=False)
    detections: list[tuple[int, dict[int, float]]] = field(default_factory=list)
    _samples: list[tuple[float, float]] = field(default_factory=list)
    _layers: int = 0
    _train_loader_built: bool = False

    def __post_init__(self) -> None:
        self.detector = StragglerDetector(policy=self.policy)
        self.events = parse_schedule(self.emulate) if self.emulate else []
        if self.layer_ms is not None:
            self.timer.nominal_s = self.layer_ms / 1e3

    # ------------------------------------------------------------------ grid
    def _grid(self) -> tuple[int, int, int]:
        from megatron.core import parallel_state as ps

        return (ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(),
                ps.get_pipeline_model_parallel_world_size())

    def _uniform(self) -> list[int]:
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        _, dp, _ = self._grid()
        return [get_num_microbatches()] * dp

    def my_count(self) -> int:
        if not self.counts:
            self.counts = self._uniform()
        return self.counts[self._grid()[0]]

    # ------------------------------------------------------------------ hooks
    def after_setup(self, model: list) -> None:
        layers = []
        for chunk in model:
            module = chunk
            while hasattr(module, "module"):
                module = module.module
            decoder = getattr(module, "decoder", None)
            layers += list(decoder.layers) if decoder is not None else []
        self._layers = len(layers)
        self.timer.attach(layers)

    def build_loader(self, original, dataset, consumed_samples, *args, **kwargs):
        from megatron.training import get_args

        if self._train_loader_built or dataset is None:
            self._train_loader_built = True
            return original(dataset, consumed_samples, *args, **kwargs)
        self._train_loader_built = True
        self.my_count()
        self.loader = WeightedLoader(dataset=dataset, start=consumed_samples, micro_batch=get_args().micro_batch_size,
                                     dp_rank=self._grid()[0], counts=self.counts)
        return self.loader

    def before_step(self, step: int) -> None:
        self.timer.factor = factor_at(self.events, dist.get_rank(), step)

    def after_step(self, step: int) -> None:
        work = float(self.my_count() * self._layers)
        seconds = self.timer.take()
        if work:
            self._samples.append((seconds, work))
        if step % self.interval:
            return
        everyone = exchange_timings(dist.get_rank(), self._samples)
        self._samples = []
        self.detector.add(everyone)
        found = self.detector.detect()
        if found is None:
            return
        rank0 = dist.get_rank() == 0
        say = self.log if rank0 else (lambda _: None)
        estimates = found.estimates
        if not found.changed:
            slowest = max(sorted(estimates), key=estimates.__getitem__)
            shown = ", ".join(f"rank {r} x{x:.2f}" for r, x in sorted(self.detector.assumed.items())) or "none"
            say(f"straggler monitor: step {step} | slowest: rank {slowest} x{estimates[slowest]:.2f} | median: "
                f"x{statistics.median(estimates.values()):.2f} | stragglers: {shown} |")
            return
        stragglers = found.stragglers
        self.detections.append((step, stragglers))
        latency = onset_latency(self.events, stragglers, step)
        shown = ", ".join(f"rank {r} x{x:.2f}" for r, x in sorted(stragglers.items())) or "none"
        say(f"straggler monitor: step {step}: stragglers {shown}"
            f"{f', {latency} steps after onset' if latency is not None else ''}")
        self._reweight(stragglers, say)

    def _reweight(self, stragglers: dict[int, float], say) -> None:
        """Every rank: the data-parallel ranks' slowdowns (the slowest rank of each replica) -> new counts."""
        _, dp, pp = self._grid()
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, self._grid()[0])
        slow = [1.0] * dp
        for rank, d in enumerate(gathered):
            slow[d] = max(slow[d], stragglers.get(rank, 1.0))
        was = list(self.counts)
        self.counts[:] = weighted_counts(sum(was), slow, pp)
        say(f"straggler monitor: microbatches per data-parallel rank: {', '.join(map(str, self.counts))} "
            f"(were {', '.join(map(str, was))})")

    # ------------------------------------------------------------------ patches
    def patches(self) -> list[Patch]:
        def make_setup(original):
            def setup_model_and_optimizer(*args, **kwargs):
                result = original(*args, **kwargs)
                self.after_setup(result[0])
                return result

            return setup_model_and_optimizer

        def make_loader(original):
            def build_pretraining_data_loader(dataset, consumed_samples, *args, **kwargs):
                return self.build_loader(original, dataset, consumed_samples, *args, **kwargs)

            return build_pretraining_data_loader

        def make_step(original):
            def train_step(*args, iteration=None, **kwargs):
                step = (iteration or 0) + 1
                self.my_count()
                self.before_step(step)
                result = original(*args, iteration=iteration, **kwargs)
                self.after_step(step)
                return result

            return train_step

        def make_fb(original):
            def get_forward_backward_func(*args, **kwargs):
                schedule = original(*args, **kwargs)

                def forward_backward(*f_args, **f_kwargs):
                    if not f_kwargs.get("forward_only"):  # evaluation keeps Megatron-LM's count
                        f_kwargs["num_microbatches"] = self.my_count()
                    return schedule(*f_args, **f_kwargs)

                return forward_backward

            return get_forward_backward_func

        return [
            Patch(name="straggler:setup_model_and_optimizer", target=f"{TRAINING}:setup_model_and_optimizer",
                  make=make_setup, reason="attach the layer timer to the built model"),
            Patch(name="straggler:build_pretraining_data_loader", target=f"{TRAINING}:build_pretraining_data_loader",
                  make=make_loader, reason="the train loader serves each data-parallel rank its weighted share"),
            Patch(name="straggler:train_step", target=f"{TRAINING}:train_step", make=make_step,
                  reason="emulate, measure and detect around each step"),
            Patch(name="straggler:get_forward_backward_func", target=f"{TRAINING}:get_forward_backward_func",
                  make=make_fb, reason="this rank's weighted microbatch count"),
        ]
