"""Merge what each rank measured into one :class:`LayerCosts` every rank agrees on (pure).

Each rank reports, for the layers it holds, ``(forward s, backward s, params, memory bytes)``
per micro-batch (NaN times for a layer it did not time). Data-parallel replicas hold the same
layers and may measure different times (different data): a layer takes its slowest replica's
time, because the slowest replica sets the step time. A layer nobody timed is estimated from its
parameter count at the measured seconds per parameter (DeepSpeed's proxy), split 1:2 between
forward and backward.
"""
from __future__ import annotations

import math
from typing import Iterable, Mapping, Sequence

from .cost_model import LayerCosts

#: Seconds per parameter assumed when no layer has been timed at all.
DEFAULT_SECONDS_PER_PARAM = 3e-9

LayerReport = tuple[float, float, int, float]  # forward s, backward s, params, memory bytes


class KnownWork(dict[int, tuple[float, float]]):
    """This rank's one cache of per-layer cost: ``{layer: (forward, backward)}`` seconds per
    micro-batch at speed 1.0, as its last closed profile measured them. The rebalancer writes it
    (what it reports in the cost gather) and activation checkpointing reads it (which local layers
    are cheapest to recompute); the strategy hands the same object to both."""

    def forward(self) -> dict[int, float]:
        return {i: f for i, (f, _) in self.items()}


def _max_measured(a: float, b: float) -> float:
    if math.isnan(a):
        return b
    if math.isnan(b):
        return a
    return max(a, b)


def merge_layer_costs(
    reports: Iterable[Mapping[int, LayerReport]], num_layers: int, activation: Sequence[float] | None = None
) -> LayerCosts:
    """One LayerCosts from per-rank ``{layer: (forward, backward, params, memory)}`` reports."""
    merged: dict[int, list[float]] = {}  # [forward, backward, params (an int), memory]
    for part in reports:
        for i, (f, b, n, mem) in part.items():
            cur = merged.get(i)
            if cur is None:
                merged[i] = [float(f), float(b), int(n), float(mem)]
            else:
                cur[0], cur[1] = _max_measured(cur[0], float(f)), _max_measured(cur[1], float(b))
                cur[3] = max(cur[3], float(mem))
    missing = [i for i in range(num_layers) if i not in merged]
    if missing:
        raise ValueError(f"no rank reported layers {missing[:10]}; every layer needs an owner")
    fwd = [merged[i][0] for i in range(num_layers)]
    bwd = [merged[i][1] for i in range(num_layers)]
    params = [int(merged[i][2]) for i in range(num_layers)]  # int already: int() only tells the type
    memory = [merged[i][3] for i in range(num_layers)]
    timed = [i for i in range(num_layers) if not (math.isnan(fwd[i]) or math.isnan(bwd[i])) and params[i] > 0]
    per_param = (
        sum(fwd[i] + bwd[i] for i in timed) / max(1, sum(params[i] for i in timed)) if timed
        else DEFAULT_SECONDS_PER_PARAM
    )
    for i in range(num_layers):
        if math.isnan(fwd[i]) or math.isnan(bwd[i]):
            fwd[i], bwd[i] = params[i] * per_param / 3, 2 * params[i] * per_param / 3
    act = tuple(float(a) for a in activation) if activation is not None else (0.0,) * num_layers
    return LayerCosts(tuple(fwd), tuple(bwd), tuple(params), tuple(memory), act)


def smooth_load(previous: Sequence[float | None] | None, now: Sequence[float | None],
                decay: float) -> list[float | None]:
    """Exponential moving average of per-layer load factors (``decay`` x previous + the rest x now).
    Decisions from counters follow the trend, not one step's draw: a load that changes at random
    every step (a hash redrawn per step, a router's noise) would otherwise move layers back and forth,
    each move paid for by a gain that lasts one step. A layer with no reading keeps none."""
    if previous is None or len(previous) != len(now):
        return list(now)
    return [n if p is None or n is None else decay * p + (1 - decay) * n for p, n in zip(previous, now)]


def loads_near_profile(load_now: Sequence[float | None], load_at_profile: Sequence[float | None],
                       factor: float = 2.0, slack: float = 0.05) -> bool:
    """Whether scaling the profile by load (c_i = r_i t_i) is still credible: every layer's load is
    within ``factor`` of (or ``slack`` from) the load it was profiled at. A layer's time is not
    proportional to its load far from the profiled point (its router, packing and launch costs
    do not shrink with the tokens it takes: an MoD block taking no tokens still costs time), so
    past the band the strategy profiles afresh instead of extrapolating."""
    for now, then in zip(load_now, load_at_profile):
        if now is None or then is None or abs(now - then) <= slack:
            continue
        if then <= 0 or not 1 / factor <= now / then <= factor:
            return False
    return True


def scale_by_load(costs: LayerCosts, load_now: Sequence[float | None],
                  load_at_profile: Sequence[float | None]) -> LayerCosts:
    """The paper's c_i = r_i t_i: a layer profiled at load factor r_p that now runs at r costs
    ``t * r / r_p`` (layers without a load signal keep their profiled time)."""
    def factor(i: int) -> float:
        now, then = load_now[i], load_at_profile[i]
        if now is None or then is None or then <= 0:
            return 1.0
        return now / then

    f = [factor(i) for i in range(costs.num_layers)]
    return LayerCosts(
        tuple(t * k for t, k in zip(costs.forward, f)), tuple(t * k for t, k in zip(costs.backward, f)),
        costs.params, costs.memory, costs.activation,
    )
