"""Diffusion on the pipeline chain: neighbours re-split their layers; runs widen when stuck.

Each round first lets neighbour pairs act, stages 0|1, 2|3, ... then 1|2, 3|4, ... (odd-even
exchange: the pairs of one phase are disjoint and could act concurrently on their ranks). A pair
moves its shared boundary to where the heavier of the two is lightest (fewest layers moved among
the ties), iff that strictly lowers the pair's maximum and both stages fit memory.

Pair moves alone stall on *staircases*, runs of stages that differ by about one layer, where
every hand-off only moves the maximum to the receiver (2-2.6x the optimum on frozen-prefix and
early-exit costs, ``benchmarks/balancers.py``). So a round in which no pair moves re-splits a
*run* of stages around the heaviest one exactly, passing layers along the chain by shifting
several boundaries at once, and doubles the run's radius until the re-split relieves that stage
(at most the whole chain).

Every move re-splits a run of consecutive stages with its outer boundaries fixed and strictly
lowers the run's maximum: no stage outside it changes, the heaviest stage never gets heavier,
and the sorted load vector decreases, so the process ends. It ends only when re-splitting the
whole chain cannot beat the heaviest stage, so the fixed point is optimal -- the price is that
the last, confirming round sees the whole chain. ``widen=False`` keeps pairs only (the classic
local fixed point, for comparison). ``rounds`` counts rounds including the final quiet one.
"""
from __future__ import annotations

from ..partition import Partition
from .base import BalanceProblem, BalanceResult, fits_memory, make_result, objective
from .exact import Run, balance_exact, bottleneck, memory_limits, solve_run
from .registry import register_balancer
from .static import uniform


def diffuse(
    problem: BalanceProblem, kind: str, name: str, max_rounds: int | None = None, widen: bool = True
) -> BalanceResult:
    """Diffuse from ``current`` (or the ``uniform`` result); ``max_rounds`` stops early (for
    traces). A start that overflows memory is replaced by the exact partition for the same
    objective (fewest moves from it); raises InfeasiblePartitionError if nothing fits."""
    S = problem.num_stages
    start = problem.current if problem.current is not None else uniform(problem).partition
    if not fits_memory(problem, start):
        start = balance_exact(problem, kind, name, start).partition
    obj = objective(kind, problem)
    lo = memory_limits(problem)

    b = list(start.boundaries)
    loads = [obj.load(s, b[s], b[s + 1]) for s in range(S)]

    def resplit(a: int, c: int) -> bool:
        """Re-split stages a..c-1 exactly (fewest moves among the run's optima); apply iff
        that strictly lowers the run's maximum."""
        run = Run(a, c, b[a], b[c])
        opt = bottleneck(obj, lo, run)  # the current split fits, so opt is finite
        if not opt < max(loads[a:c]):
            return False
        b[a : c + 1] = solve_run(obj, lo, run, opt, tuple(b))
        loads[a:c] = [obj.load(s, b[s], b[s + 1]) for s in range(a, c)]
        return True

    def relieve_heaviest() -> bool:
        """Re-split runs of doubling radius around the heaviest stage until one lowers it."""
        h = loads.index(max(loads))
        radius = 1
        while True:
            a, c = max(0, h - radius), min(S, h + radius + 1)
            if resplit(a, c):
                return True
            if c - a == S:
                return False
            radius *= 2

    peak = max(loads)
    rounds = 0
    while max_rounds is None or rounds < max_rounds:  # ends by itself (see module docstring)
        rounds += 1
        active = False
        for first in (0, 1):
            for k in range(first, S - 1, 2):  # the pair of stages k, k+1
                active |= resplit(k, k + 2)
        if not active and widen:
            active = relieve_heaviest()
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
