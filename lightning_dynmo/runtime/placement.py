"""Where this rank sits in the pipeline (:class:`Placement`, what an engine is built for) and which
layers it holds: the others are swapped for :class:`RemoteLayer` placeholders."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..plan.layout import PipelineLayout
from ..plan.partition import Partition
from ..plan.schedules import ScheduleSpec
from ..protocol import RemoteLayer, ReportsLoad
from .expert_parallel import ExpertParallel
from .materialize import materialize_pipeline
from .optimizer_layout import OptimizerLayout
from .tied import TiedParameters


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

    @classmethod
    def of(cls, layout: PipelineLayout, layers: nn.ModuleList, group, device: torch.device) -> "Placement":
        return cls(layers, layout.partition, layout.spec, layout.pp_rank, layout.pp_size, group, device)


def place_local_layers(module: nn.Module, layers: nn.ModuleList, layout: PipelineLayout, rank: int,
                       tied: TiedParameters, timeout, optimizers=(), optimizer_layout: OptimizerLayout | None = None,
                       expert_parallel: ExpertParallel | None = None,
                       after_materialize: Callable[[int], None] | None = None,
                       materialize_in_shards: Callable[[int], bool] | None = None) -> None:
    """Keep what ``layout`` gives this rank: its layers (placeholders for the others, checked
    present), its tied-parameter groups, its parameters in ``optimizers``, allocated and
    initialised if the module was built on the meta device (``after_materialize(i)`` right after
    each layer, ``materialize_in_shards(i)`` instead where it can; see
    :func:`materialize_pipeline`), and its expert shards."""
    drop_remote_layers(layers, layout)
    check_local_layers_present(layers, layout.local_layer_indices(), rank)
    tied.update(layout, timeout)
    OptimizerLayout.keep_only_local(module, optimizers)
    materialize_pipeline(module, layers, layout.local_layer_indices(), optimizers, after_layer=after_materialize,
                         in_shards=materialize_in_shards)
    if expert_parallel:  # keep this rank's expert shard (the optimizers hold the shards instead)
        expert_parallel.shard_module(module, optimizers, optimizer_layout)


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
