"""Process groups of a :class:`~lightning_dynmo.plan.Topology` (every rank creates every group)."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from ..plan.layout import PipelineLayout
from ..plan.topology import Topology


def build_groups(topo: Topology, rank: int, timeout: timedelta):
    """Create every pipeline and data-parallel group (all ranks must call) and return this rank's
    ``(pipeline group, data-parallel group, every replica's pipeline group)``."""
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


@dataclass(frozen=True)
class PipelineGroups:
    """This rank's process groups: its pipeline's (``None``: the world, or none on a released
    rank), its stage's data-parallel group, and every replica's pipeline group."""

    pipeline: dist.ProcessGroup | None = None
    data_parallel: dist.ProcessGroup | None = None
    replicas: tuple = ()


def groups_of_layout(layout: PipelineLayout, rank: int, timeout: timedelta) -> PipelineGroups:
    """:func:`build_groups` for ``layout``; where it was packed (a ``trainer.test``/``validate``
    after a fit that re-packed) the pipeline groups are the packed ones fit ended with."""
    pp_group, dp_group, pp_groups = build_groups(layout.topology, rank, timeout)
    if layout.packed_pp is not None:
        pp_groups = build_packed_groups(layout.topology, layout.packed_pp, timeout)
        pp_group = None if layout.released else pp_groups[layout.dp_rank]
    return PipelineGroups(pp_group, dp_group, tuple(pp_groups))


def packed_groups(layout: PipelineLayout, data_parallel, timeout: timedelta) -> PipelineGroups:
    """The groups after re-packing onto ``layout.pp_size`` ranks per replica (collective over the
    world); the data-parallel groups stay."""
    groups = build_packed_groups(layout.topology, layout.pp_size, timeout)
    return PipelineGroups(None if layout.released else groups[layout.dp_rank], data_parallel, tuple(groups))


def build_packed_groups(topo: Topology, active: int, timeout: timedelta) -> list:
    """Every replica's pipeline group over its first ``active`` ranks (all world ranks call this,
    in the same order, as ``new_group`` requires)."""
    return [dist.new_group(topo.pipeline_ranks(d, active), timeout=timeout) for d in range(topo.dp)]


def group_ranks(group) -> list[int]:
    """Global ranks of ``group`` (``None``: the world)."""
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
