"""Exact min-max contiguous partition under a per-stage memory capacity.

Pass 1 (DP over stages x end layer) finds OPT, the smallest achievable heaviest-stage load.
Pass 2 (backward DP restricted to stages with load <= OPT that fit memory) minimises the layers
moved from a reference partition, and the forward reconstruction takes the smallest next boundary
that keeps the optimum, i.e. the lexicographically smallest boundaries among the ties.

Exact with floats because every compared value is an actual stage load computed by the same
expression as the cost model (``Objective``), never a sum of rounded pieces or an epsilon.
Pruning relies only on monotonicity: the compute part of a load, and stage memory, grow when a
stage is extended at either end. Cost is O(S L^2) in the worst case, far less in practice.
"""
from __future__ import annotations

import math
from bisect import bisect_right

from ..partition import Partition
from .base import BalanceProblem, BalanceResult, InfeasiblePartitionError, Objective, make_result, objective
from .registry import register_balancer

INF = math.inf


def memory_limits(problem: BalanceProblem) -> list[list[int]] | None:
    """``lo[s][j]``: smallest start ``i < j`` such that layers ``i..j-1`` fit as stage ``s``
    (``j`` if none). None when capacity is unlimited. Memory only depends on ``s`` through the
    schedule's in-flight count, so stages sharing it share a table."""
    model, costs, S, L = problem.model, problem.costs, problem.num_stages, problem.num_layers
    cap = model.capacity
    if cap is None:
        return None
    by_k: dict[int, list[int]] = {}
    out = []
    for s in range(S):
        k = model.inflight(s, S)
        if k not in by_k:
            lo = [0] * (L + 1)
            i = 0
            for j in range(1, L + 1):
                while i < j and model.segment_memory(costs, i, j, s, S) > cap:
                    i += 1
                lo[j] = i
            by_k[k] = lo
        out.append(by_k[k])
    return out


def min_peak_memory(problem: BalanceProblem) -> float:
    """Smallest achievable max-stage memory over all partitions (for error messages)."""
    model, costs, S, L = problem.model, problem.costs, problem.num_stages, problem.num_layers
    prev = [INF] * (L + 1)
    for j in range(1, L - S + 2):
        prev[j] = model.segment_memory(costs, 0, j, 0, S)
    for s in range(1, S):
        cur = [INF] * (L + 1)
        for j in range(s + 1, L - (S - 1 - s) + 1):
            best = INF
            for i in range(j - 1, s - 1, -1):
                mem = model.segment_memory(costs, i, j, s, S)
                if mem >= best:
                    break
                v = max(prev[i], mem)
                if v < best:
                    best = v
            cur[j] = best
        prev = cur
    return prev[L]


def _bottleneck(problem: BalanceProblem, obj: Objective, lo: list[list[int]] | None) -> float:
    L, S = problem.num_layers, problem.num_stages
    p, den, recv = obj.p, obj.den, obj.recv
    prev = [INF] * (L + 1)
    for j in range(1, L - S + 2):
        if lo is None or lo[0][j] == 0:
            prev[j] = (p[j] - p[0]) / den + recv[0]
    for s in range(1, S):
        cur = [INF] * (L + 1)
        los = None if lo is None else lo[s]
        # floor[i] = min(prev[s..i]): once it reaches ``best``, no earlier start can help.
        floor, acc = [INF] * (L + 1), INF
        for i in range(s, L + 1):
            acc = min(acc, prev[i])
            floor[i] = acc
        for j in range(L if s == S - 1 else s + 1, L - (S - 1 - s) + 1):
            best = INF
            pj = p[j]
            imin = s if los is None else max(s, los[j])
            for i in range(j - 1, imin - 1, -1):
                seg = (pj - p[i]) / den
                if seg >= best or floor[i] >= best:  # earlier starts cannot do better
                    break
                v = prev[i]
                if v >= best:
                    continue
                t = seg + recv[i]
                if t > v:
                    v = t
                if v < best:
                    best = v
            cur[j] = best
        prev = cur
    return prev[L]


def _moved(ref: tuple[int, ...] | None, s: int, i: int, j: int) -> int:
    if ref is None:
        return 0
    return (j - i) - max(0, min(j, ref[s + 1]) - max(i, ref[s]))


def solve(problem: BalanceProblem, obj: Objective, reference: Partition | None) -> Partition:
    """Optimal partition for ``obj``; ties -> fewest layers moved from ``reference``, then
    lexicographically smallest boundaries. Raises InfeasiblePartitionError."""
    L, S = problem.num_layers, problem.num_stages
    lo = memory_limits(problem)
    opt = _bottleneck(problem, obj, lo)
    if opt == INF:
        raise InfeasiblePartitionError(problem.model.capacity, min_peak_memory(problem), L, S)
    p, den, recv = obj.p, obj.den, obj.recv
    ref = None if reference is None else reference.boundaries

    def last_end(s: int, i: int) -> int:
        """Largest end j of stage s starting at i with load <= opt that fits memory (< i+1 if
        none); both conditions are monotone in j, so bisect."""
        hi = L - (S - 1 - s)
        if lo is not None:
            hi = min(hi, bisect_right(lo[s], i) - 1)
        pi, r = p[i], recv[i]
        return i + bisect_right(range(i + 1, hi + 1), opt, key=lambda j: (p[j] - pi) / den + r)

    # G[s][i]: fewest moved layers for stages s..S-1 covering i..L-1 within the optimum.
    # moved(s, i, j) is piecewise (slope 1, 0, 1 in j) around the reference stage [r0, r1),
    # so each piece is a C-level min() over a slice of G[s+1] or G[s+1][j] + j.
    G: list[list[float]] = [[INF] * (L + 1) for _ in range(S + 1)]
    G[S][L] = 0
    for s in range(S - 1, -1, -1):
        g, gn = G[s], G[s + 1]
        h = [v + j for j, v in enumerate(gn)]
        for i in (range(0, 1) if s == 0 else range(s, L - (S - s) + 1)):
            jhi = last_end(s, i)
            if jhi <= i:
                continue
            if ref is None:
                g[i] = min(gn[i + 1 : jhi + 1])
                continue
            m0, r1 = max(i, ref[s]), ref[s + 1]
            best = INF
            a_hi = min(jhi, m0)  # j <= m0: no overlap, moved = j - i
            if a_hi >= i + 1:
                best = min(best, min(h[i + 1 : a_hi + 1]) - i)
            b_lo, b_hi = max(i + 1, m0 + 1), min(jhi, r1)  # overlap j - m0: moved = m0 - i
            if b_hi >= b_lo:
                best = min(best, min(gn[b_lo : b_hi + 1]) + (m0 - i))
            c_lo = max(i + 1, r1 + 1)  # overlap r1 - m0: moved = j - i - overlap
            if jhi >= c_lo:
                best = min(best, min(h[c_lo : jhi + 1]) - i - max(0, r1 - m0))
            g[i] = best
    assert G[0][0] != INF, "tie-break pass lost the optimum"
    bounds, i = [0], 0
    for s in range(S):
        for j in range(i + 1, last_end(s, i) + 1):
            if G[s + 1][j] + _moved(ref, s, i, j) == G[s][i]:
                break
        else:  # pragma: no cover - G is consistent by construction
            raise AssertionError("tie-break reconstruction failed")
        bounds.append(j)
        i = j
    return Partition(tuple(bounds))


def balance_exact(problem: BalanceProblem, kind: str, name: str, reference: Partition | None) -> BalanceResult:
    obj = objective(kind, problem)
    return make_result(problem, obj, solve(problem, obj, reference), name)


@register_balancer("partition_time")
def partition_time(problem: BalanceProblem) -> BalanceResult:
    """Minimise the slowest stage (compute + input receive); fewest moves from ``current``."""
    return balance_exact(problem, "time", "partition_time", problem.current)


@register_balancer("partition_param")
def partition_param(problem: BalanceProblem) -> BalanceResult:
    """Minimise the largest stage parameter count; fewest moves from ``current``."""
    return balance_exact(problem, "params", "partition_param", problem.current)
