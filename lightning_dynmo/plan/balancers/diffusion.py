"""First-order diffusion on the pipeline chain: neighbours trade boundary layers.

Each round has two phases, boundaries 1,3,5,... then 2,4,6,... (odd-even exchange), so the pairs
acting in one phase are disjoint and could run concurrently on their ranks with no global
gather. On boundary k the heavier of stages k-1 / k hands its boundary layer to the lighter one
iff that strictly lowers the pair's maximum, the receiver still fits memory, and the giver keeps
a layer. Only stages k-1 and k change (a stage's load depends on its own two boundaries), so the
global max never increases, the sorted load vector strictly decreases each active round and the
process reaches a fixed point. ``rounds`` counts rounds including the final quiet one.
"""
from __future__ import annotations

from ..partition import Partition
from .base import BalanceProblem, BalanceResult, fits_memory, make_result, objective
from .exact import balance_exact
from .registry import register_balancer
from .static import uniform


def diffuse(problem: BalanceProblem, kind: str, name: str, max_rounds: int | None = None) -> BalanceResult:
    """Diffuse from ``current`` (or the ``uniform`` result). A start that overflows memory is
    replaced by the exact partition for the same objective (fewest moves from it) -- the one
    case where diffusion needs a global view; raises InfeasiblePartitionError if nothing fits."""
    costs, model, S = problem.costs, problem.model, problem.num_stages
    start = problem.current if problem.current is not None else uniform(problem).partition
    if not fits_memory(problem, start):
        start = balance_exact(problem, kind, name, start).partition
    obj = objective(kind, problem)
    cap = model.capacity
    if max_rounds is None:
        max_rounds = 4 * problem.num_layers * S + 8

    def fits(s: int, i: int, j: int) -> bool:
        return cap is None or model.segment_memory(costs, i, j, s, S) <= cap

    b = list(start.boundaries)
    loads = [obj.load(b[s], b[s + 1]) for s in range(S)]
    peak = max(loads)
    rounds = 0
    while rounds < max_rounds:
        rounds += 1
        active = False
        for first in (1, 2):
            for k in range(first, S, 2):  # boundary k between stages k-1 and k
                left, right = loads[k - 1], loads[k]
                if left > right and b[k] - b[k - 1] > 1:
                    nb, receiver, lo, hi = b[k] - 1, k, b[k] - 1, b[k + 1]
                elif right > left and b[k + 1] - b[k] > 1:
                    nb, receiver, lo, hi = b[k] + 1, k - 1, b[k - 1], b[k] + 1
                else:
                    continue
                new_left, new_right = obj.load(b[k - 1], nb), obj.load(nb, b[k + 1])
                if max(new_left, new_right) < max(left, right) and fits(receiver, lo, hi):
                    b[k] = nb
                    loads[k - 1], loads[k] = new_left, new_right
                    active = True
        new_peak = max(loads)
        assert new_peak <= peak, "diffusion increased the heaviest stage"
        peak = new_peak
        if not active:
            break
    return make_result(problem, obj, Partition(tuple(b)), name, rounds=rounds)


@register_balancer("diffusion_time")
def diffusion_time(problem: BalanceProblem) -> BalanceResult:
    return diffuse(problem, "time", "diffusion_time")


@register_balancer("diffusion_param")
def diffusion_param(problem: BalanceProblem) -> BalanceResult:
    return diffuse(problem, "params", "diffusion_param")
