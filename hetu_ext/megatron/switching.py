"""The switching layer: one training step run as one or several schedules under strategies other than the
optimizer's (HotSPa: a strategy per length group; Hydraulis: one candidate plan per step).

A *home* placement holds the optimizer (fp32 masters and moments under ``--bf16``, the grad norm, the LR
schedule); *compute* placements, one per other strategy, are built on first use (every rank, collectively; the
same plan runtime, without an optimizer) and kept. A step runs its length groups one after another
(hetu_ext.plan.hotspa decides them); for a group under a compute strategy:

1. **push**: the home's weights, in the model's dtype (bf16 under ``--bf16``), resharded into the strategy's layout;
2. its own schedule (Megatron's 1F1B over its pipelines) on the group's packs; its gradients are reduced over its
   own holders and divided by the **whole step's** token count (not the group's);
3. **pull**: its gradients added into the home's gradient buffer by an adding reshard.

The pull of one group and the push of the next go in one batched exchange (``reshard(op={"param": "copy",
"grad": "add"})``), senders on the receiver's node first, then the least loaded. A group under the home strategy
runs in place; if gradients were already pulled into the home's buffer, they are set aside while it runs (its
reduction would otherwise add them once per holder) and added back after. The home's optimizer then steps once.
Every switch's bytes and seconds go into the step's metrics.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from hetu_ext.plan.hotspa import Group, GroupPricer, StrategySet, auto_groups, fixed_groups, run_order, switch_seconds
from hetu_ext.plan.hydraulis import select_candidate
from hetu_ext.runtime.reshard import Piece, reshard

from .packed_data import PackedSteps, StepData
from .placement import Placement
from .weights import local_shards

MODES = ("fixed", "auto", "select")
"""How a step's sequences meet the strategies: HotSPa's fixed length groups (each sequence to the smallest strategy
holding it) or ``auto`` grouping (a dynamic program per step); Hydraulis's ``select``: the whole step under the
one candidate with the lowest predicted time (hetu_ext.plan.hydraulis.select_candidate)."""


@dataclass
class GroupStep:
    strategy: int
    data: StepData | None
    """This rank's microbatches under the strategy (None: the strategy leaves this rank idle)."""
    sequences: int
    tokens: int
    predicted_s: float


@dataclass
class SwitchedStep:
    groups: list[GroupStep]
    sequences: int
    tokens: int


class SwitchedSteps:
    """Step ``g`` -> its length groups, each packed for its strategy's pipelines (deterministic on every rank);
    the next step is planned in the background, as packing does."""

    def __init__(self, per_strategy: list[PackedSteps], strategies: StrategySet, *, mode: str, spec, cost,
                 switch_s: list[float]) -> None:
        if mode not in MODES:
            raise ValueError(f"SwitchedSteps: mode must be one of {MODES}, got {mode!r}")
        self.per_strategy, self.strategies, self.mode = per_strategy, strategies, mode
        self.spec, self.cost, self.switch_s = spec, cost, switch_s
        first = per_strategy[0]
        self.table, self.batches = first.table, first.batches
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hetu-hotspa")
        self._ahead: dict = {}
        self._pricer: GroupPricer | None = None

    def consumed(self, g: int) -> int:
        with self._lock:
            return self.batches.consumed(g)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def groups(self, lengths: list[int]) -> list[Group]:
        if self.mode == "fixed":
            return fixed_groups(lengths, self.strategies)
        if self._pricer is None:
            self._pricer = GroupPricer(self.strategies, self.spec, self.cost)
        if self.mode == "auto":
            fixed = [0.0 if k == self.strategies.home else sw for k, sw in enumerate(self.switch_s)]
            return auto_groups(lengths, self.strategies, self._pricer.estimate, self.switch_s,
                               exact=self._pricer.exact,
                               relaxed=lambda ls, price: self._pricer.relaxed(ls, fixed, upper_s=price),
                               slowest=self._pricer.slowest, fill=self._pricer.fill)
        k, predicted = select_candidate(lengths, self.strategies, estimate=self._pricer.bound,
                                        exact=self._pricer.exact, switch_s=self.switch_s)
        return [Group(strategy=k, indices=tuple(range(len(lengths))), predicted_s=predicted)]

    def plan_step(self, g: int):
        with self._lock:
            ids = self.batches[g]
        lengths = self.table.length[ids].tolist()
        planned = []
        for group in run_order(self.groups(lengths), self.strategies):
            sub = ids[np.asarray(group.indices, dtype=np.int64)]
            steps = self.per_strategy[group.strategy]
            # --- Hydraulis (issue 15): the selection (or auto grouping's exact pricing) packed this group already;
            # pass that packing on (GroupPricer.packed checks it is for these lengths and replicas, else None)
            packed = None
            if self.mode != "fixed":
                packed = self._pricer.packed(group.strategy, self.table.length[sub].tolist(), steps.replicas)
            # ---
            planned.append((group.strategy, sub, steps.plan_sequences(sub, packed)))
        return ids, planned

    def step(self, g: int) -> SwitchedStep:
        future = self._ahead.pop(g, None)
        ids, planned = future.result() if future is not None else self.plan_step(g)
        self._ahead = {g + 1: self._pool.submit(self.plan_step, g + 1)}
        groups = []
        for k, sub, (sub_ids, per, predicted) in planned:
            steps = self.per_strategy[k]
            data = steps.step_data(g, sub_ids, per, predicted) if steps.pipeline is not None else None
            groups.append(GroupStep(strategy=k, data=data, sequences=int(sub.size),
                                    tokens=int(self.table.length[sub].sum()),
                                    predicted_s=max(predicted) if predicted else 0.0))
        return SwitchedStep(groups=groups, sequences=int(ids.size), tokens=int(self.table.length[ids].sum()))


def _pieces(placement: Placement, kind: str, plugin=None) -> list[Piece]:
    """This rank's weights (``param``: the model's own dtype) or gradients (``grad``: the fp32 main_grad; a frozen
    parameter has none), and a plug-in's (``plugin(placement, kind)``: LoRA's adapters) after them."""
    if not placement.active:
        return []
    out = []
    for s in local_shards(placement.model, **placement.shard_kwargs):
        if kind == "grad" and not s.param.requires_grad:
            continue
        box = tuple((sl.start, sl.stop) for sl in s.slices)
        tensor = s.data.data if kind == "param" else s.view(s.param.main_grad)
        out.append(Piece(f"{kind}:{s.key}", s.index, box, tensor))
    return out + (plugin(placement, kind) if plugin is not None else [])


@dataclass
class SwitchReport:
    strategy_from: int | None
    strategy_to: int | None
    bytes_sent: int
    seconds: float


@dataclass
class Switching:
    """HotSPa's placements on this rank: the home (the trainer's placement) and the cached compute ones."""

    strategies: StrategySet
    home: Placement
    build: object
    """strategy index -> its compute Placement (collective: every rank calls it at the same point)."""
    ranks_per_node: int | None = None
    per_group_normalisation: bool = False
    """A negative control for tests only: divide each group by its own tokens (wrong)."""
    plugin_pieces: object = None
    """``(placement, kind) -> pieces``: a plug-in's weights (``param``) or gradients (``grad``) outside the model's
    sharded state dict (LoRA's adapters), switched with the model's."""
    placements: dict = field(default_factory=dict)

    def placement(self, k: int) -> Placement:
        if k == self.strategies.home:
            return self.home
        if k not in self.placements:
            self.placements[k] = self.build(k)
        return self.placements[k]

    def _exchange(self, pull: int | None, push: int | None) -> SwitchReport:
        """Gradients of ``pull``'s placement added into the home, weights of the home copied into ``push``'s,
        in one batched exchange (collective over the world)."""
        start = time.perf_counter()
        sources, destinations = [], []
        plugin = self.plugin_pieces
        if pull is not None:
            sources += _pieces(self.placement(pull), "grad", plugin)
            destinations += _pieces(self.home, "grad", plugin)
        if push is not None:
            sources += _pieces(self.home, "param", plugin)
            destinations += _pieces(self.placement(push), "param", plugin)
        report = reshard(sources, destinations, op={"param": "copy", "grad": "add"},
                         ranks_per_node=self.ranks_per_node)
        return SwitchReport(pull, push, report.bytes_sent, time.perf_counter() - start)

    def run(self, step: SwitchedStep, run_schedule) -> tuple[list[tuple[int, list]], list[SwitchReport]]:
        """Run every group of ``step`` (``run_schedule(placement, data)`` runs one schedule, returns its loss
        reports); gradients end in the home's buffer, divided by the step's tokens. Returns each group's
        (strategy, reports) and the switches."""
        home_k = self.strategies.home
        self.home.model.zero_grad_buffer()
        self.home.optimizer.zero_grad()
        results, switches, pending, pulled = [], [], None, False
        for group in step.groups:
            k = group.strategy
            target = self.placement(k)  # built before any exchange that needs it
            if pending is not None or k != home_k:
                switches.append(self._exchange(pending, k if k != home_k else None))
                pulled = pulled or pending is not None
            tokens = group.tokens if self.per_group_normalisation else step.tokens
            stash = None
            if k == home_k and pulled:  # set aside what the other groups added, restore after the home's reduction
                stash = [b.grad_data.clone() for b in self.home.model.buffers]
                self.home.model.zero_grad_buffer()
            if target.active:
                target.normaliser["tokens"] = tokens
                if k != home_k:
                    target.model.zero_grad_buffer()
                reports = run_schedule(target, group.data)
                target.normaliser.pop("tokens", None)
            else:
                reports = []
            if stash is not None:
                for buffer, saved in zip(self.home.model.buffers, stash):
                    buffer.grad_data.add_(saved)
            results.append((k, reports))
            pending = k if k != home_k else None
        if pending is not None:
            switches.append(self._exchange(pending, None))
        return results, switches


def predicted_switch_s(strategies: StrategySet, spec, *, weight_bytes: int, bandwidth: float) -> list[float]:
    """Per strategy, the predicted seconds of switching to it from home and back (0 for the home)."""
    home = strategies.items[strategies.home].plan
    return [0.0 if k == strategies.home else
            switch_seconds(home, s.plan, spec, weight_bytes=weight_bytes, bandwidth=bandwidth)
            for k, s in enumerate(strategies.items)]


def local_loss(results: list[tuple[int, list]], placements) -> torch.Tensor:
    """(loss sum, tokens) of the groups' last-stage reports on this rank (TP rank 0 of last stages only)."""
    total = torch.zeros(2, dtype=torch.float64)
    for k, reports in results:
        placement = placements(k)
        if placement.active and placement.is_last_stage and placement.tp_rank == 0:
            for report in reports:
                total += report["lm loss"].double().cpu()
    return total
