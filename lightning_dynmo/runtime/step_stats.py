"""The one collective of every training step, and what all ranks learn from it.

One float64 all-reduce over the world carries the step's mean loss, whether any rank profiled
layers, every rank's busy and wall seconds, and every layer's load factor (from layers that
implement :class:`~lightning_dynmo.protocol.ReportsLoad`). Afterwards all ranks hold identical
numbers, so every later decision is the same everywhere.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..plan.topology import Topology


@dataclass(frozen=True)
class StepStats:
    loss: torch.Tensor  # float32 scalar, the batch loss (mean over micro-batches and replicas)
    profiled: bool  # some rank profiled layers in this step
    rank_busy: list[float]  # per active pipeline rank: compute seconds of its slowest replica
    rank_wall: list[float]  # per active pipeline rank: schedule wall seconds of its slowest replica
    layer_load: list[float | None]  # per layer: mean load factor over replicas (None: not reported)
    problem: bool = False  # some rank's stage met a pipeline protocol problem (engine.raise_step_problem)


def exchange_step_stats(
    *,
    losses: list[torch.Tensor] | None,
    profiled: bool,
    busy: float,
    wall: float,
    loads: dict[int, float],
    topology: Topology,
    active_pp: int,
    num_layers: int,
    global_rank: int,
    device: torch.device,
    problem: bool = False,
) -> StepStats:
    """Collective over the world: every rank calls it once per training step."""
    W, L = topology.world_size, num_layers
    vec = torch.zeros(3 + 2 * W + 2 * L, dtype=torch.float64, device=device)
    vec[-1] = 1.0 if problem else 0.0
    if losses:
        vec[0] = torch.stack([l.detach().double() for l in losses]).mean().to(device) / topology.dp
    vec[1] = 1.0 if profiled else 0.0
    vec[2 + global_rank] = busy
    vec[2 + W + global_rank] = wall
    base = 2 + 2 * W
    for i, load in loads.items():
        vec[base + i] = float(load)
        vec[base + L + i] = 1.0
    dist.all_reduce(vec)
    host = vec.cpu().tolist()
    pp = topology.pp
    busy_per_rank = [max(host[2 + d * pp + r] for d in range(topology.dp)) for r in range(active_pp)]
    wall_per_rank = [max(host[2 + W + d * pp + r] for d in range(topology.dp)) for r in range(active_pp)]
    layer_load = [host[base + i] / host[base + L + i] if host[base + L + i] > 0 else None for i in range(L)]
    return StepStats(vec[0].float(), host[1] > 0, busy_per_rank, wall_per_rank, layer_load, host[-1] > 0)


def share_eval_loss(losses: list[torch.Tensor] | None, replicas: int, device: torch.device,
                    problem: bool = False, signals: tuple[float, float] = (0.0, 0.0)
                    ) -> tuple[torch.Tensor, bool, tuple[bool, bool]]:
    """The evaluation batch loss on every rank (only last-stage ranks computed one), whether any
    rank met a pipeline protocol problem, and whether any rank got each of the cluster signals
    ``signals`` flags (``strategy/signals.py``: terminate, requeue)."""
    value = torch.zeros(4, dtype=torch.float32, device=device)
    if losses:
        value[0] = torch.stack([l.detach().float() for l in losses]).mean().to(device) / replicas
    value[1] = 1.0 if problem else 0.0
    value[2], value[3] = float(signals[0]), float(signals[1])
    dist.all_reduce(value)
    flags = value[1:].tolist()
    return value[0], flags[0] > 0, (flags[1] > 0, flags[2] > 0)
