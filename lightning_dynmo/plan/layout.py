"""Where this rank sits in the pipeline: topology, schedule layout, partition, active ranks.

A value every part of the strategy reads (placement, rebalancing, checkpoints) instead of each
re-deriving ranks and stages. It is never changed in place: a migration returns a new one
(:meth:`with_partition`, :meth:`packed`) that the strategy adopts. Re-packing shrinks
``pp_size``; ranks beyond it are released.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from .partition import Partition
from .schedules import ScheduleSpec
from .topology import Topology


@dataclass(frozen=True)
class PipelineLayout:
    topology: Topology
    spec: ScheduleSpec
    virtual: int
    global_rank: int
    partition: Partition | None = None
    packed_pp: int | None = None  # pipeline ranks after re-packing (None: not packed)

    def with_partition(self, partition: Partition) -> "PipelineLayout":
        return replace(self, partition=partition)

    def packed(self, ranks: int, partition: Partition) -> "PipelineLayout":
        """This layout re-packed onto ``ranks`` pipeline ranks per replica, split as ``partition``."""
        return replace(self, packed_pp=ranks, partition=partition)

    @property
    def pp_size(self) -> int:
        """Ranks in each pipeline now (fewer than ``topology.pp`` after re-packing)."""
        return self.packed_pp or self.topology.pp

    @property
    def pp_rank(self) -> int:
        return self.topology.pp_rank(self.global_rank)

    @property
    def dp_rank(self) -> int:
        return self.topology.dp_rank(self.global_rank)

    @property
    def released_ranks(self) -> list[int]:
        """Global ranks that re-packing took out of every pipeline (empty before any packing)."""
        return self.topology.released_ranks(self.packed_pp) if self.packed_pp is not None else []

    @property
    def released(self) -> bool:
        """True on a rank that re-packing took out of the pipeline (it holds no layers)."""
        return self.pp_rank >= self.pp_size

    @property
    def num_stages(self) -> int:
        return self.pp_size * self.virtual

    def rank_of_stage(self, stage: int, pp: int | None = None) -> int:
        return self.spec.rank_of_stage(stage, pp or self.pp_size)

    def local_layer_indices(self) -> list[int]:
        """Global indices of the layers this rank owns, in pipeline order."""
        assert self.partition is not None
        return [i for s in range(self.partition.num_stages) if self.rank_of_stage(s) == self.pp_rank
                for i in self.partition.layers_of(s)]

    def boundary_bandwidth(self, link_bandwidth: float | tuple[float, float] | None,
                           pp: int | None = None) -> float | tuple[float, ...] | None:
        """The cost model's ``bandwidth`` for this layout on ``pp`` pipeline ranks (default: now),
        from ``link_bandwidth``: None, one float (every boundary alike), or ``(intra_node,
        inter_node)``: each stage boundary by whether the ranks of its two stages share a node
        (inter-node if they do not in any replica: the slowest replica sets the step); a boundary
        between two stages of one rank counts as intra-node. One float when all are alike."""
        if link_bandwidth is None or not isinstance(link_bandwidth, tuple):
            return link_bandwidth
        intra, inter = link_bandwidth
        topo, pp = self.topology, pp or self.pp_size
        ranks = [self.rank_of_stage(s, pp) for s in range(pp * self.virtual)]
        per = tuple(
            inter if any(topo.node_of(d * topo.pp + a) != topo.node_of(d * topo.pp + b) for d in range(topo.dp))
            else intra
            for a, b in zip(ranks, ranks[1:])
        )
        return per[0] if len(set(per)) == 1 else (per or None)

    def stage_speed(self, rank_speed: Sequence[float] | None, pp: int | None = None) -> tuple[float, ...] | None:
        """The cost model's ``speed`` on ``pp`` pipeline ranks (default: now): each (virtual)
        stage at its rank's speed, ``rank_speed`` one per pipeline rank (reduced over replicas:
        :func:`~lightning_dynmo.plan.speed.slowest_replicas`). None when every rank is at 1.0 (or
        ``rank_speed`` is None), so that the default cost model is unchanged."""
        if rank_speed is None:
            return None
        pp = pp or self.pp_size
        if len(rank_speed) < pp:
            raise ValueError(f"rank_speed has {len(rank_speed)} speeds for {pp} pipeline ranks")
        if all(float(v) == 1.0 for v in rank_speed[:pp]):
            return None
        return tuple(float(rank_speed[self.rank_of_stage(s, pp)]) for s in range(pp * self.virtual))

    def owners(self) -> list[int]:
        """Pipeline rank owning each layer."""
        assert self.partition is not None, "owners() needs a layout with a partition"
        return [self.rank_of_stage(s) for s in self.partition.owner_map()]
