"""The cluster a planner plans over (pure): ranks, their nodes, GPU memory and measured slowdowns."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Ranks ``0..world_size-1`` laid out node after node (``gpus_per_node`` each, the last node may be short)."""

    world_size: int
    gpus_per_node: int
    gpu_memory_bytes: int
    """Usable memory per GPU, in bytes."""
    slowdowns: dict[int, float] = field(default_factory=dict)
    """Rank -> slowdown x_r (time of a unit of work over the healthy time); ranks not listed are 1.0."""

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.gpus_per_node < 1:
            raise ValueError(f"cluster: world_size and gpus_per_node must be >= 1, got {self.world_size}, "
                             f"{self.gpus_per_node}")
        if self.gpu_memory_bytes <= 0:
            raise ValueError(f"cluster: gpu_memory_bytes must be > 0, got {self.gpu_memory_bytes}")
        for rank, x in self.slowdowns.items():
            if not 0 <= rank < self.world_size:
                raise ValueError(f"cluster: slowdown given for rank {rank}, outside 0..{self.world_size - 1}")
            if x < 1.0:
                raise ValueError(f"cluster: slowdown of rank {rank} is {x}; slowdowns are >= 1.0 (1.0 = healthy)")

    def slowdown(self, rank: int) -> float:
        return self.slowdowns.get(rank, 1.0)

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    @property
    def nodes(self) -> list[list[int]]:
        return [list(range(n, min(n + self.gpus_per_node, self.world_size)))
                for n in range(0, self.world_size, self.gpus_per_node)]
