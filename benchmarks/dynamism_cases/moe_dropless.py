"""Mixture of Experts without a capacity (dropless), otherwise the ``moe`` case. Every routed
token is computed, so with ``--expert-parallel N`` a stage waits for its busiest expert shard and
routing imbalance shows as a slower layer instead of dropped tokens (with capacity factor 1.0 a
shard never receives more than its balanced share). Without expert parallelism a layer's expert
work is top_k x tokens whatever the routing, as in the ``moe`` case."""
from __future__ import annotations

from .moe import EXPERT_PARALLEL, MODEL, build, dynmo_strategy  # noqa: F401  (the case protocol)
from .moe import plan as _capacity_plan


def plan(quick: bool) -> dict:
    p = _capacity_plan(quick)
    p["moe"] = dict(p["moe"], capacity_factor=None)
    return p
