"""One plan for whatever survives (pure): nodes report their healthy devices, one function turns the reports into
a Malleus plan and places every rank of it on a healthy device of its node.

The launcher of the rendezvous' group rank 0 calls :func:`agree` once per round and publishes the result; every
other launcher reads it (``agent.py``), so all nodes run the same plan. Global ranks follow torch elastic's own
assignment: node after node in group-rank order, ``len(devices)`` consecutive ranks per node
(``SimpleElasticAgent._assign_worker_ranks``), local rank ``i`` of a node on its ``i``-th healthy device.

Malleus plans a cluster of equal nodes (``Cluster``: ``gpus_per_node`` each). Nodes short of devices are planned
as full nodes whose missing devices are very slow (``ABSENT_SLOWDOWNS``): the planner's straggler
cut-off leaves them unused, and they are then dropped and the ranks renumbered. TP groups stay inside a node.

A DeepSpeed job (``--launcher deepspeed``) needs no planner: :func:`data_parallel` makes every healthy device a
data-parallel rank, as many as divide the global batch (an agreement's ``nodes`` then list the devices used).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from hetu_ext.plan import ModelSpec, Plan, plan_from_dict, plan_to_dict, uniform_plan
from hetu_ext.plan.core.cluster import Cluster
from hetu_ext.plan.malleus import plan_malleus

ABSENT_SLOWDOWNS = (1e3, 1e6)
"""The slowdowns a missing device is planned with, tried in turn until the plan uses none: a pipeline through a
missing device is predicted a thousand times slower than one that avoids it, so the fastest plan leaves it
unused. (Malleus' layer split trims its allocation layer by layer from a level proportional to the slowdown; at
1e6 that took 2-3 s per agreement on the rehearsal's 5 ranks, at 1e3 milliseconds.)"""


@dataclass(frozen=True, kw_only=True)
class NodeReport:
    """What one node's launcher publishes in a rendezvous round."""

    node: str
    """The node's name (host and launcher id), for messages."""
    devices: tuple[int, ...]
    """Its healthy device indices (CUDA ordinals; CPU emulation: slots 0..nproc-1 less the lost ones)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))
        if not self.devices or len(set(self.devices)) != len(self.devices) or min(self.devices) < 0:
            raise ValueError(f"node {self.node}: healthy devices must be distinct indices >= 0, at least one "
                             f"(a node with none leaves the job before the rendezvous), got {list(self.devices)}")


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where one global rank runs."""

    node: int
    """Index of its node in the round (the rendezvous group rank)."""
    local_rank: int
    device: int


@dataclass(frozen=True, kw_only=True)
class Agreement:
    """The round's plan and the place of each of its ranks (``ranks[r]`` for global rank ``r``)."""

    plan: Plan
    nodes: tuple[NodeReport, ...]
    ranks: tuple[Placement, ...]

    def node_ranks(self, node: int) -> list[int]:
        """Global ranks of node ``node`` (consecutive, in local-rank order)."""
        return [r for r, p in enumerate(self.ranks) if p.node == node]

    def to_json(self) -> str:
        return json.dumps({"plan": plan_to_dict(self.plan),
                           "nodes": [{"node": n.node, "devices": list(n.devices)} for n in self.nodes]},
                          sort_keys=True)

    @staticmethod
    def from_json(text: str) -> Agreement:
        data = json.loads(text)
        nodes = tuple(NodeReport(node=n["node"], devices=tuple(n["devices"])) for n in data["nodes"])
        return Agreement(plan=plan_from_dict(data["plan"]), nodes=nodes, ranks=placements(nodes))


def placements(nodes: tuple[NodeReport, ...]) -> tuple[Placement, ...]:
    """torch elastic's rank order: node after node, local rank i of a node on its i-th healthy device."""
    return tuple(Placement(node=n, local_rank=i, device=d) for n, report in enumerate(nodes)
                 for i, d in enumerate(report.devices))


def agree(nodes: list[NodeReport] | tuple[NodeReport, ...], spec: ModelSpec, *, micro_batch: int,
          num_microbatches: int, gpu_memory_bytes: int = 80 * 2**30) -> Agreement:
    """The Malleus plan over the healthy devices of ``nodes`` (in rendezvous group-rank order), keeping the global
    batch (``num_microbatches`` of ``micro_batch``); ValueError when no plan fits."""
    nodes = tuple(nodes)
    if not nodes:
        raise ValueError("plan agreement: no node reported a healthy device")
    width = max(len(n.devices) for n in nodes)
    real: dict[int, int] = {}  # padded rank -> global rank
    absent: list[int] = []
    for n, report in enumerate(nodes):
        for slot in range(width):
            if slot < len(report.devices):
                real[n * width + slot] = len(real)
            else:
                absent.append(n * width + slot)
    for slowdown in ABSENT_SLOWDOWNS:
        cluster = Cluster(world_size=len(nodes) * width, gpus_per_node=width, gpu_memory_bytes=gpu_memory_bytes,
                          slowdowns={r: slowdown for r in absent})
        padded = plan_malleus(cluster, spec, micro_batch=micro_batch, num_microbatches=num_microbatches).plan
        if not set(padded.used_ranks) & set(absent):
            break
    else:
        raise ValueError(f"plan agreement: no plan fits the healthy devices alone ({[len(n.devices) for n in nodes]} "
                         f"per node); the model needs more devices or fewer layers per device")
    plan = Plan(pipelines=tuple(replace(p, stages=tuple(replace(s, ranks=tuple(real[r] for r in s.ranks))
                                                        for s in p.stages)) for p in padded.pipelines),
                unused_ranks=tuple(sorted(real[r] for r in padded.unused_ranks if r in real)))
    plan.validate(spec, len(real))
    return Agreement(plan=plan, nodes=nodes, ranks=placements(nodes))


def data_parallel(nodes: list[NodeReport] | tuple[NodeReport, ...], *, num_layers: int,
                  num_microbatches: int) -> Agreement:
    """DeepSpeed's layout over the healthy devices of ``nodes``: every used device one data-parallel rank holding
    the whole model (TP 1, PP 1), the global batch (``num_microbatches`` microbatches) kept. The world size is the
    largest count of healthy devices that divides ``num_microbatches`` (each rank runs the same number of them), at
    least one per node; the devices left over are dropped from the nodes with the most, the last first, and stay
    unused this round. ValueError when no such count exists."""
    nodes = tuple(nodes)
    if not nodes:
        raise ValueError("plan agreement: no node reported a healthy device")
    total = sum(len(n.devices) for n in nodes)
    world = next((w for w in range(total, len(nodes) - 1, -1) if num_microbatches % w == 0), None)
    if world is None:
        raise ValueError(f"plan agreement: no data-parallel world size from {len(nodes)} (one rank per node) to "
                         f"{total} (the healthy devices) divides the global batch's {num_microbatches} "
                         f"microbatches; choose --global-batch-size / --micro-batch-size with more divisors")
    used = [list(n.devices) for n in nodes]
    for _ in range(total - world):
        fullest = max(range(len(used)), key=lambda k: (len(used[k]), k))
        used[fullest].pop()
    kept = tuple(NodeReport(node=n.node, devices=tuple(u)) for n, u in zip(nodes, used))
    plan = uniform_plan(world_size=world, num_layers=num_layers, num_microbatches=num_microbatches // world)
    return Agreement(plan=plan, nodes=kept, ranks=placements(kept))
