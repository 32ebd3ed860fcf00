"""Rank layout: world = data-parallel replicas x pipeline ranks; a replica's ranks are adjacent.

Global rank ``g`` is pipeline rank ``g % pp`` of replica ``g // pp``, so one pipeline sits on
consecutive ranks (one node first) and data-parallel all-reduces cross nodes.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist


@dataclass(frozen=True)
class Topology:
    world_size: int
    pp: int

    def __post_init__(self) -> None:
        if self.pp < 1:
            raise ValueError(f"pipeline_parallel must be >= 1, got {self.pp}")
        if self.world_size % self.pp:
            raise ValueError(
                f"the {self.world_size} processes (devices x num_nodes) cannot be split into pipelines of "
                f"pipeline_parallel={self.pp} ranks: the world size must be a multiple of pipeline_parallel. "
                f"Use devices={self.pp * max(1, self.world_size // self.pp)} or change pipeline_parallel."
            )

    @property
    def dp(self) -> int:
        return self.world_size // self.pp

    def pp_rank(self, rank: int) -> int:
        return rank % self.pp

    def dp_rank(self, rank: int) -> int:
        return rank // self.pp

    def pipeline_ranks(self, replica: int) -> list[int]:
        return [replica * self.pp + s for s in range(self.pp)]

    def replica_ranks(self, pp_rank: int) -> list[int]:
        return [d * self.pp + pp_rank for d in range(self.dp)]


def build_groups(topo: Topology, rank: int, timeout: timedelta):
    """Create every pipeline and data-parallel group (all ranks must call) and return this rank's."""
    if topo.dp == 1:
        pp_group = None  # the default (world) group
        pp_groups = [None]
    else:
        pp_groups = [dist.new_group(topo.pipeline_ranks(d), timeout=timeout) for d in range(topo.dp)]
        pp_group = pp_groups[topo.dp_rank(rank)]
    dp_group = None
    if topo.dp > 1:
        dp_groups = [dist.new_group(topo.replica_ranks(s), timeout=timeout) for s in range(topo.pp)]
        dp_group = dp_groups[topo.pp_rank(rank)]
    return pp_group, dp_group, pp_groups
