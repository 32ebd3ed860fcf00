"""``DynMoStrategy``'s options, validated once, before any process starts."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

from ..plan.balancers import get_balancer
from ..plan.partition import Partition
from ..plan.repack import check_repack_target
from ..plan.schedules import ScheduleSpec, get_schedule
from ..plan.validation import positive_int
from ..protocol import PipelineProtocolError, pipeline_layers_of

DEFAULT_TIMEOUT = timedelta(minutes=10)
START_METHODS = ("popen", "spawn", "fork", "forkserver")


@dataclass(frozen=True)
class PipelineOptions:
    pipeline_parallel: int | Literal["auto"]
    schedule: ScheduleSpec
    virtual_stages: int
    microbatches: int | None
    balancer: str
    partition: Partition | None
    memory_capacity: float | None
    repack: int | str
    repack_tolerance: float
    plot: bool
    timeout: timedelta
    start_method: str
    process_group_backend: str | None

    @classmethod
    def validate(cls, *, pipeline_parallel, schedule, microbatches, virtual_stages, balancer, partition,
                 memory_capacity, repack, repack_tolerance, plot, timeout, start_method,
                 process_group_backend) -> "PipelineOptions":
        pp = positive_int("pipeline_parallel", pipeline_parallel, allow=("auto",))
        spec = get_schedule(schedule)
        virtual = spec.virtual_stages(virtual_stages)
        mb = positive_int("microbatches", microbatches, allow=(None,))
        if mb is not None and pp != "auto":
            spec.check_microbatches(mb, pp)
        get_balancer(balancer)  # unknown names fail here, listing the valid ones
        if memory_capacity is not None and not memory_capacity > 0:
            raise ValueError(f"memory_capacity must be a positive number of bytes or None, got {memory_capacity!r}")
        if repack != "off":
            try:
                check_repack_target(repack)
            except ValueError:
                raise ValueError(f"repack must be 'off', 'auto' or a positive number of pipeline ranks, got {repack!r}") from None
        if not 0 <= repack_tolerance < 1:
            raise ValueError(f"repack_tolerance must be in [0, 1), got {repack_tolerance!r}")
        if start_method not in START_METHODS:
            raise ValueError(f"start_method must be one of {', '.join(START_METHODS)}, got {start_method!r}")
        if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
            timeout = timedelta(seconds=timeout)
        if timeout is not None and (not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0):
            raise ValueError(f"timeout must be a positive number of seconds or a timedelta, got {timeout!r}")
        return cls(
            pipeline_parallel=pp, schedule=spec, virtual_stages=virtual, microbatches=mb, balancer=balancer,
            partition=Partition(tuple(partition)) if partition is not None else None,
            memory_capacity=memory_capacity, repack=repack, repack_tolerance=float(repack_tolerance),
            plot=bool(plot), timeout=timeout or DEFAULT_TIMEOUT, start_method=start_method,
            process_group_backend=process_group_backend,
        )


def check_module(module, accumulate_grad_batches: int, num_stages: int, pipeline_parallel: int, virtual: int) -> None:
    """What the pipeline needs of the LightningModule and the Trainer, checked at setup."""
    if not module.automatic_optimization:
        raise PipelineProtocolError(
            "DynMoStrategy runs backward inside the pipeline schedule and needs automatic optimisation; "
            "set `self.automatic_optimization = True` in your LightningModule"
        )
    if accumulate_grad_batches != 1:
        raise ValueError(
            "DynMoStrategy does not support accumulate_grad_batches > 1: raise `microbatches` instead "
            "(the pipeline already accumulates gradients over micro-batches)"
        )
    layers = pipeline_layers_of(module)
    in_layers = {id(p) for p in layers.parameters()}
    outside = [n for n, p in module.named_parameters() if id(p) not in in_layers]
    if outside:
        raise PipelineProtocolError(
            f"{type(module).__name__} has parameters outside pipeline_layers(): {outside[:5]}; "
            "every parameter must belong to exactly one pipeline layer (no weight tying across layers)"
        )
    if num_stages > len(layers):
        raise ValueError(
            f"cannot split {len(layers)} layers into {num_stages} pipeline stages "
            f"(pipeline_parallel={pipeline_parallel} x virtual_stages={virtual}); "
            f"use at most {len(layers) // virtual} pipeline ranks or a deeper model"
        )
