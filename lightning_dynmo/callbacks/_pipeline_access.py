"""How the dynamism callbacks (the triggers) reach the pipeline: shared by every callback here.

They hide the difference between plain Lightning (every rank holds the whole model, or there is
only one process) and a pipeline strategy such as ``DynMoStrategy`` (each rank holds a contiguous
slice of ``pipeline_layers()``; the others are :class:`~lightning_dynmo.protocol.RemoteLayer`).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from ..protocol import PipelineControl, RemoteLayer


def pipeline_layers(pl_module: nn.Module) -> nn.ModuleList | None:
    fn = getattr(pl_module, "pipeline_layers", None)
    return fn() if callable(fn) else None


def local_layers(pl_module: nn.Module) -> Iterator[tuple[int, nn.Module]]:
    """``(global index, layer)`` of the layers this rank holds (``RemoteLayer`` entries skipped)."""
    layers = pipeline_layers(pl_module)
    if layers is None:
        raise TypeError(
            f"{type(pl_module).__name__} does not define pipeline_layers(); the dynamism callbacks index "
            "layers through the dynmo pipeline protocol (see lightning_dynmo.protocol)"
        )
    for i, layer in enumerate(layers):
        if not isinstance(layer, RemoteLayer):
            yield i, layer


def _splits_layers(obj) -> bool:
    """True when ``obj`` holds a share of the layers (a pipeline group and local layers)."""
    return hasattr(obj, "pipeline_group") and callable(getattr(obj, "local_layer_indices", None))


def pipeline_of(trainer):
    """What answers :class:`~lightning_dynmo.protocol.PipelineControl` for this trainer:
    ``DynMoStrategy``'s ``strategy.pipeline``, or a strategy that implements the protocol itself;
    None under a strategy whose every rank holds the whole model (plain Lightning)."""
    strategy = trainer.strategy
    pipeline = getattr(strategy, "pipeline", None)
    if _splits_layers(pipeline):
        return pipeline
    return strategy if _splits_layers(strategy) else None


def pipeline_reduce_group(trainer):
    """``(needs_reduce, group)``: whether per-layer quantities must be summed over ranks, and over
    which group (``None`` = default group). Under plain DDP every rank holds the whole model, so
    nothing is reduced (replicas are identical)."""
    pipeline = pipeline_of(trainer)
    if pipeline is None:
        return False, None
    if not (dist.is_available() and dist.is_initialized()):
        return False, None
    return True, pipeline.pipeline_group


def all_reduce_over_pipeline(trainer, vec: torch.Tensor, op=None) -> torch.Tensor:
    """Sum (or ``op``) a fixed-size vector over the pipeline group; identity without a pipeline."""
    needs, group = pipeline_reduce_group(trainer)
    if needs:
        dist.all_reduce(vec, op=op or dist.ReduceOp.SUM, group=group)
    return vec


def shards_over_replicas(trainer) -> bool:
    """True when each data-parallel replica holds a different shard of its layers
    (``dp_sharding="fsdp"`` over more than one replica): per-layer counts then sum over the
    replicas too, not only over the pipeline."""
    pipeline = pipeline_of(trainer)
    return pipeline is not None and getattr(getattr(pipeline, "dp_sharding", None), "sharded_layers", None) is not None


def model_reduce_groups(trainer) -> tuple[bool, list]:
    """``(needs_reduce, groups)``: the groups to sum a per-layer count over, in turn, so that every
    weight of the model counts once (:func:`pipeline_reduce_group`, preceded by the replica group
    when :func:`shards_over_replicas`)."""
    needs, group = pipeline_reduce_group(trainer)
    if not needs:
        return False, []
    return True, ([pipeline_of(trainer).data_parallel_group] if shards_over_replicas(trainer) else []) + [group]


def all_reduce_over_model(trainer, vec: torch.Tensor, op=None) -> torch.Tensor:
    """:func:`all_reduce_over_pipeline`, and over the replicas too when each holds a different shard."""
    needs, groups = model_reduce_groups(trainer)
    for group in groups if needs else []:
        dist.all_reduce(vec, op=op or dist.ReduceOp.SUM, group=group)
    return vec


@contextmanager
def whole_layers(trainer, indices: list[int]) -> Iterator[None]:
    """Inside, this rank's layers ``indices`` are plain modules holding whole tensors (parameters,
    gradients, optimizer state), for a change that swaps parameters, which an FSDP unit cannot
    adopt; sharded again on exit. Collective over the stage's replicas under ``dp_sharding="fsdp"``
    (every replica passes the same indices); nothing to do otherwise."""
    pipeline = pipeline_of(trainer)
    layers = getattr(getattr(pipeline, "dp_sharding", None), "sharded_layers", None)
    if layers is None or not indices:
        yield
        return
    layers.gather(indices, trainer.strategy.root_device)
    try:
        yield
    finally:
        layers.shard(indices)
        invalidate_pipeline(trainer)  # stages are rebuilt on the new units


def request_rebalance(trainer, reason: str, reprofile: bool = True) -> bool:
    """Ask the strategy to rebalance if it can; plain Lightning strategies just ignore it.
    ``reprofile=False``: the layers' work changed, not what they compute (see PipelineControl)."""
    pipeline = pipeline_of(trainer)
    if isinstance(pipeline, PipelineControl):
        pipeline.request_rebalance(reason, reprofile=reprofile)
        return True
    fn = getattr(pipeline or trainer.strategy, "request_rebalance", None)
    if callable(fn):
        fn(reason)
        return True
    return False


def invalidate_pipeline(trainer) -> None:
    fn = getattr(pipeline_of(trainer) or trainer.strategy, "invalidate_pipeline", None)
    if callable(fn):
        fn()


def reduce_device(trainer, pl_module) -> torch.device:
    strategy = trainer.strategy
    return getattr(strategy, "root_device", None) or pl_module.device


def replica_group(trainer) -> tuple[object, bool]:
    """``(group, replicated)``: the data-parallel replicas of this rank's layers (``None``: the
    world) and whether there is more than one. A pipeline strategy names the group
    (``data_parallel_group``); otherwise every rank of an initialised process group holds a
    replica of the whole model (DDP, FSDP)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None, False
    pipeline = pipeline_of(trainer)
    if pipeline is not None:
        group = getattr(pipeline, "data_parallel_group", None)
        return group, group is not None and dist.get_world_size(group) > 1
    return None, dist.get_world_size() > 1
