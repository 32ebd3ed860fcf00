"""How each stage is held over its data-parallel replicas (the ``dp_sharding`` option), chosen once
at setup: :class:`Replicate` (every replica holds its stages whole; one all-reduce per optimizer
step averages the gradients) or :class:`Fsdp` (each layer an FSDP2 unit over the stage's
replicas; its reduce-scatter averages each gradient shard inside the schedule). The strategy and
the migration executor call the same methods on either and never ask which one they hold.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from .expert_parallel import ExpertShards
from .fsdp import ShardedLayers
from .gradients import average_expert_shards, average_over_replicas
from .tied import TiedParameters


class Replicate:
    """``dp_sharding="replicate"``: whole stages on every replica."""

    sharded_layers: ShardedLayers | None = None

    def shard(self, indices: Iterable[int]) -> None:
        """Nothing to shard: a layer is whole on every replica."""

    def wrap_stage(self, submod: nn.Module) -> nn.Module:
        return submod

    def materialize_in_shards(self, module: nn.Module, index: int, device: torch.device) -> bool:
        """A meta layer is allocated whole on every replica."""
        return False

    def before_moves(self, leaving: Iterable[int], device: torch.device, arriving: Iterable[int]) -> None:
        """Layers migrate whole as they are."""

    def after_batch(self, group) -> None:
        """A parameter no replica used has ``grad=None`` already (autograd never wrote one)."""

    def tied_replicated(self, replicas: int) -> bool:
        """Whether tied gradients still need the data-parallel average at the exchange."""
        return replicas > 1

    def exchange(self, params: Iterable[nn.Parameter], tied: TiedParameters, group, replicas: int,
                 experts: ExpertShards | None) -> None:
        """Once per optimizer step: each gradient's mean over the replicas (a tied parameter once;
        expert shards summed over the replicas holding the same shard)."""
        average_over_replicas(tied.averaged_once(params), group, replicas, experts)


class Fsdp(Replicate):
    """``dp_sharding="fsdp"``: every local layer an FSDP2 unit over this stage's replicas
    (:class:`~lightning_dynmo.runtime.fsdp.ShardedLayers`); a migration gathers a leaving layer
    whole and shards an arrived one again."""

    def __init__(self, layers: ShardedLayers) -> None:
        self.sharded_layers = layers

    def shard(self, indices: Iterable[int]) -> None:
        self.sharded_layers.shard(list(indices))

    def wrap_stage(self, submod: nn.Module) -> nn.Module:
        return self.sharded_layers.wrap_stage(submod)

    def materialize_in_shards(self, module: nn.Module, index: int, device: torch.device) -> bool:
        return self.sharded_layers.materialize_in_shards(module, index, device)

    def before_moves(self, leaving: Iterable[int], device: torch.device, arriving: Iterable[int]) -> None:
        self.sharded_layers.gather(list(leaving), device, arriving=list(arriving))  # (arriving: their tied partners)

    def after_batch(self, group) -> None:
        """FSDP reduce-scatters zeros for a parameter no replica used (the collectives must pair):
        set back to ``None``, as in one process, before the batch joins the accumulation window."""
        self.sharded_layers.drop_never_graded(group)

    def tied_replicated(self, replicas: int) -> bool:
        return False  # each shard is averaged by its unit's reduce-scatter, once per batch

    def exchange(self, params: Iterable[nn.Parameter], tied: TiedParameters, group, replicas: int,
                 experts: ExpertShards | None) -> None:
        """The units' reduce-scatters averaged everything but the expert shards, which are not
        theirs (``ignored_params``)."""
        average_expert_shards(params, replicas, experts)
