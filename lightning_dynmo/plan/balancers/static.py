"""Static baselines: Megatron's equal layer counts and DeepSpeed's parameter balance.

They ignore ``current`` (they are what a static system would do), but still honour the memory
capacity: a layout that does not fit is useless as a baseline, so the fallback is documented.
"""
from __future__ import annotations

from ..partition import Partition
from .base import BalanceProblem, BalanceResult, fits_memory, make_result, objective
from .exact import balance_exact, solve
from .registry import register_balancer


def megatron_layout(num_layers: int, num_stages: int) -> Partition:
    """Equal layer counts, the remainder spread one each over the FIRST stages."""
    q, r = divmod(num_layers, num_stages)
    return Partition.from_sizes([q + 1] * r + [q] * (num_stages - r))


@register_balancer("uniform")
def uniform(problem: BalanceProblem) -> BalanceResult:
    """Megatron layout. If it overflows memory: the most even layer counts that fit (exact
    min-max over layer counts), closest to the Megatron layout. ``loads`` are stage times."""
    part = megatron_layout(problem.num_layers, problem.num_stages)
    if not fits_memory(problem, part):
        part = solve(problem, objective("layers", problem), part)
    return make_result(problem, objective("time", problem), part, "uniform")


@register_balancer("param")
def param(problem: BalanceProblem) -> BalanceResult:
    """DeepSpeed ``partition_method="parameters"`` done exactly: min-max parameter count subject
    to memory; ignores ``current`` (static), ties -> lexicographically smallest boundaries."""
    return balance_exact(problem, "params", "param", None)
