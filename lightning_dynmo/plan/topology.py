"""Rank layout: world = data-parallel replicas x pipeline ranks; a replica's ranks are adjacent.

Global rank ``g`` is pipeline rank ``g % pp`` of replica ``g // pp``, so one pipeline sits on
consecutive ranks (one node first) and data-parallel all-reduces cross nodes. Global rank ``g``
runs on node ``g // ranks_per_node`` (None: one node).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    world_size: int
    pp: int
    ranks_per_node: int | None = None  # processes per node (None: every rank on one node)

    def __post_init__(self) -> None:
        if self.pp < 1:
            raise ValueError(f"pipeline_parallel must be >= 1, got {self.pp}")
        if self.world_size % self.pp:
            raise ValueError(
                f"the {self.world_size} processes (devices x num_nodes) cannot be split into pipelines of "
                f"pipeline_parallel={self.pp} ranks: the world size must be a multiple of pipeline_parallel. "
                f"Use devices={self.pp * max(1, self.world_size // self.pp)} or change pipeline_parallel."
            )
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1 or None, got {self.ranks_per_node}")

    def node_of(self, rank: int) -> int:
        return 0 if self.ranks_per_node is None else rank // self.ranks_per_node

    @property
    def dp(self) -> int:
        return self.world_size // self.pp

    def pp_rank(self, rank: int) -> int:
        return rank % self.pp

    def dp_rank(self, rank: int) -> int:
        return rank // self.pp

    def pipeline_ranks(self, replica: int, active: int | None = None) -> list[int]:
        """Global ranks of ``replica``'s pipeline (its first ``active`` ranks after re-packing)."""
        return [replica * self.pp + s for s in range(self.pp if active is None else active)]

    def replica_ranks(self, pp_rank: int) -> list[int]:
        return [d * self.pp + pp_rank for d in range(self.dp)]

    def released_ranks(self, active: int) -> list[int]:
        """Global ranks left without layers when each pipeline keeps its first ``active`` ranks."""
        return [d * self.pp + k for d in range(self.dp) for k in range(active, self.pp)]
