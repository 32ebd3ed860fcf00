"""Where this rank sits in the pipeline (:class:`Placement`, what an engine is built for) and which
layers it holds: the others are swapped for :class:`RemoteLayer` placeholders."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..plan.layout import PipelineLayout
from ..plan.partition import Partition
from ..plan.schedules import ScheduleSpec
from ..protocol import RemoteLayer, ReportsLoad


@dataclass(frozen=True, eq=False)
class Placement:
    """Where this rank sits in the pipeline: the layer list, the partition, the schedule's
    stage-to-rank layout, this rank's position, the pipeline group and the device."""

    layers: nn.ModuleList
    partition: Partition
    spec: ScheduleSpec
    pp_rank: int
    pp_size: int
    group: dist.ProcessGroup | None
    device: torch.device


def drop_remote_layers(layers: nn.ModuleList, layout: PipelineLayout) -> None:
    """Keep this rank's layers; replace the others with placeholders (their memory is freed)."""
    owner = layout.owners()
    for i in range(len(layers)):
        if owner[i] != layout.pp_rank and not isinstance(layers[i], RemoteLayer):
            layers[i] = RemoteLayer(i, owner=owner[i])


def check_local_layers_present(layers: nn.ModuleList, local: list[int], rank: int) -> None:
    """A layer this rank owns must be real: a placeholder here means the module lost it (e.g. a module
    whose layers were dropped under another partition), and the pipeline would hang on it."""
    missing = [i for i in local if isinstance(layers[i], RemoteLayer)]
    if missing:
        raise RuntimeError(
            f"rank {rank}: layers {missing} belong to this rank under the current partition but the module holds "
            "only placeholders for them (they were dropped under another partition). Pass the module that trained "
            "with this strategy, or a freshly built one, to later trainer stages."
        )


def collect_load_factors(layers: nn.ModuleList, indices: list[int]) -> dict[int, float]:
    """``{layer: load factor}`` of the local layers implementing ReportsLoad; starts a new window."""
    loads = {}
    for i in indices:
        layer = layers[i]
        if isinstance(layer, ReportsLoad):
            value = layer.load_factor()
            layer.reset_load()
            if value is not None:
                loads[i] = float(value)
    return loads
