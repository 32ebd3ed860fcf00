"""This rank's pipeline as values, passed between the strategy and its helpers.

:class:`RankPipeline` is what the strategy hands the rebalancer and the checkpoint functions for
one call (they never hold the strategy, so they cannot write its fields); :class:`Relayout` is
what a migration or a re-pack hands back, for the strategy to adopt.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ..plan.layout import PipelineLayout
from ..runtime.engine import EngineCache
from ..runtime.expert_parallel import ExpertParallel
from ..runtime.dp_sharding import Replicate
from ..runtime.groups import PipelineGroups
from ..runtime.migration import MigrationStats
from ..runtime.optimizer_layout import OptimizerLayout
from ..runtime.profiler import PipelineProfiler
from ..runtime.tied import TiedParameters


@dataclass(frozen=True)
class Relayout:
    """Where the layers live after a migration: the new layout, the new process groups (re-packing
    only) and this rank's transfer statistics (``None``: it took no part)."""

    layout: PipelineLayout
    groups: PipelineGroups | None = None
    migration: MigrationStats | None = None

    @staticmethod
    def chain(first: "Relayout | None", then: "Relayout | None") -> "Relayout | None":
        """Two migrations of one step as one change: the later layout, the latest groups and stats."""
        if first is None or then is None:
            return then or first
        return Relayout(then.layout, then.groups if then.groups is not None else first.groups,
                        then.migration if then.migration is not None else first.migration)


@dataclass(frozen=True)
class RankPipeline:
    """This rank's pipeline for one call: the module and its layer list, the optimizers and
    their layout, the runtime objects (driven through their methods), the layout and groups."""

    module: Any  # the LightningModule
    layers: nn.ModuleList
    layers_attr: str
    optimizers: list
    optimizer_layout: OptimizerLayout | None
    tied: TiedParameters
    profiler: PipelineProfiler | None
    engines: EngineCache | None
    expert_parallel: ExpertParallel | None
    full_state_shapes: dict[str, tuple[int, ...]]
    layout: PipelineLayout
    groups: PipelineGroups
    device: torch.device
    global_rank: int
    last_batch_size: int | None = None
    last_microbatches: int | None = None
    runs_per_step: int = 1  # pipeline runs per optimizer step (accumulate_grad_batches)
    dp_sharding: Replicate = field(default_factory=Replicate)  # how stages are held over their replicas

    def adopted(self, change: Relayout | None) -> "RankPipeline":
        """This pipeline after ``change`` (for the rest of a call that migrated)."""
        if change is None:
            return self
        return replace(self, layout=change.layout, groups=change.groups if change.groups is not None else self.groups)

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    def local_layer_indices(self) -> list[int]:
        return self.layout.local_layer_indices()

    def last_step_events(self) -> list[dict]:
        return self.profiler.event_dicts(self.global_rank)

    def output_dir(self) -> str | None:
        """Where logs go (``Trainer.log_dir`` is a broadcast: call on every rank)."""
        return output_dir(self.module.trainer)


def output_dir(trainer) -> str | None:
    return trainer.log_dir or trainer.default_root_dir
