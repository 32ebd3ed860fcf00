"""Re-packing decision: onto how few pipeline ranks can the current work go? (pure function)

Reuses the balancers and the cost model: for each candidate rank count it re-tunes the
micro-batch count (as the runtime will), rescales the per-micro-batch costs accordingly, balances
contiguous stages under the memory capacity, and predicts the step time. ``"auto"`` takes the
fewest ranks whose prediction stays within ``tolerance`` of the current step; a number is taken
as given when it is feasible. Every "no" is a :class:`RepackRefused` saying why.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from .balancers import BalanceProblem, InfeasiblePartitionError, get_balancer
from .cost_model import CostModel, LayerCosts
from .partition import Partition


class RepackRefused(ValueError):
    """The pipeline should not (or cannot) be packed; the message says why."""


@dataclass(frozen=True)
class RepackPlan:
    ranks: int
    partition: Partition
    microbatches: int
    predicted_step: float


def check_repack_target(target: int | str) -> int | str:
    """``"auto"`` or a positive number of pipeline ranks (the one check for every entry point)."""
    if target == "auto" or (isinstance(target, int) and not isinstance(target, bool) and target >= 1):
        return target
    raise ValueError(f"repack target must be 'auto' or a positive number of pipeline ranks, got {target!r}")


def rescale(costs: LayerCosts, factor: float) -> LayerCosts:
    """Per-micro-batch costs when each micro-batch becomes ``factor`` times larger."""
    return LayerCosts(
        tuple(f * factor for f in costs.forward), tuple(b * factor for b in costs.backward), costs.params,
        costs.memory, tuple(a * factor for a in costs.activation),
    )


def plan_repack(
    costs: LayerCosts,
    current: Partition,
    model_now: CostModel,
    ranks_now: int,
    target: int | str,
    balancer: str,
    choose_microbatches: Callable[[int], int],
    virtual_stages: int = 1,
    tolerance: float = 0.05,
    bandwidth: Callable[[int], float | tuple[float, ...] | None] | None = None,
    speed: Callable[[int], tuple[float, ...] | None] | None = None,
) -> RepackPlan:
    """A :class:`RepackPlan`, or :class:`RepackRefused` saying why the pipeline stays as it is.

    ``costs`` are per micro-batch of ``model_now.microbatches``; ``choose_microbatches(r)`` gives
    the micro-batch count the runtime would use on ``r`` ranks (raising ValueError when the
    schedule cannot run there). ``bandwidth(r)``: the cost model's bandwidth on ``r`` ranks (needed
    when ``model_now`` has one per stage boundary; default: ``model_now``'s). ``speed(r)``: the
    cost model's per-stage ``speed`` on the ``r`` ranks that stay (needed when ``model_now`` has
    speeds: :meth:`~lightning_dynmo.plan.layout.PipelineLayout.stage_speed` with ``pp=r``)."""
    check_repack_target(target)
    pred_now = model_now.predicted_step_time(costs, current)
    if target != "auto":
        assert isinstance(target, int)  # check_repack_target: "auto" or an int
        if target >= ranks_now:
            raise RepackRefused(f"target {target} is not below the current {ranks_now} pipeline ranks")
        candidates = [int(target)]
    else:
        candidates = list(range(1, ranks_now))
    reasons = []
    for r in candidates:
        try:
            m = choose_microbatches(r)
        except ValueError as err:
            reasons.append(f"{r} ranks: the schedule cannot run: {err}")
            continue
        scaled = rescale(costs, model_now.microbatches / m)
        if bandwidth is None and model_now.per_boundary:
            raise ValueError("plan_repack needs bandwidth(r) when the cost model has a bandwidth per stage boundary")
        bw = model_now.bandwidth if bandwidth is None else bandwidth(r)
        if speed is None and model_now.speed is not None:
            raise ValueError("plan_repack needs speed(r) when the cost model has a speed per stage")
        sp = None if speed is None else speed(r)
        model = dataclasses.replace(model_now, microbatches=m, bandwidth=bw, speed=sp)
        try:
            result = get_balancer(balancer)(
                BalanceProblem(costs=scaled, num_stages=r * virtual_stages, model=model, current=None)
            )
        except InfeasiblePartitionError as err:
            reasons.append(f"{r} ranks: {err}")
            continue
        pred = model.predicted_step_time(scaled, result.partition)
        if target != "auto" or pred <= (1 + tolerance) * pred_now:
            return RepackPlan(r, result.partition, m, pred)
        reasons.append(f"{r} ranks: predicted step {pred * 1e3:.1f} ms > {1 + tolerance:.2f} x {pred_now * 1e3:.1f} ms")
    raise RepackRefused("; ".join(reasons) or "no candidate")
