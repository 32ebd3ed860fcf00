"""Exact min-max contiguous partition under a per-stage memory capacity.

Solves any *run* of consecutive stages ``a..c-1`` over a fixed layer range ``x..y-1`` (the whole
pipeline is the run ``0..S-1`` over ``0..L-1``; diffusion re-splits shorter runs). Stage indices
stay global, so each stage keeps its own memory rule (in-flight micro-batches) and input link.

Pass 1 (DP over stages x end layer) finds OPT, the smallest achievable heaviest-stage load.
Pass 2 (backward DP restricted to stages with load <= OPT that fit memory, starting where a
forward sweep of such stages can reach) minimises the layers moved from a reference partition,
and the forward reconstruction takes the smallest next boundary that keeps the optimum, i.e. the
lexicographically smallest boundaries among the ties.

Exact with floats because every compared value is an actual stage load computed by the same
expression as the cost model (``Objective``), never a sum of rounded pieces or an epsilon. With
rank speeds a stage's load is its work over its speed (plus its receive time); the search only
needs each stage's load to be monotone in its boundaries, which division by a constant keeps.
Pruning relies only on monotonicity: the compute part of a load, and stage memory, grow when a
stage is extended at either end. Cost is O(S L^2) in the worst case, far less in practice.
"""
from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from fractions import Fraction
from typing import NamedTuple

from ..partition import Partition
from .base import BalanceProblem, BalanceResult, InfeasiblePartitionError, Objective, make_result, objective
from .registry import register_balancer

INF = math.inf


class Run(NamedTuple):
    """Stages ``first..stop-1`` covering layers ``start..end-1``."""

    first: int
    stop: int
    start: int
    end: int


def memory_limits(problem: BalanceProblem) -> list[list[int]] | None:
    """``lo[s][j]``: smallest start ``i < j`` such that layers ``i..j-1`` fit as stage ``s``
    (``j`` if none); non-decreasing in ``j``. None when capacity is unlimited. Memory only
    depends on ``s`` through the schedule's in-flight count, so stages sharing it share a table."""
    model, costs, S, L = problem.model, problem.costs, problem.num_stages, problem.num_layers
    cap = model.capacity
    if cap is None:
        return None
    by_k: dict[int, list[int]] = {}
    out = []
    for s in range(S):
        k = model.inflight(s, S)
        if k not in by_k:
            mem = model.memory_fn(costs, s, S)
            lo = [0] * (L + 1)
            i = 0
            for j in range(1, L + 1):
                while i < j and mem(i, j) > cap:
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


Window = tuple[list[int], list[int]]  # smallest and largest end of each stage of a run


def _units(obj: Objective, ub: float, speed: float = 1.0) -> int:
    """An integer ``D`` with ``load(i, j) <= ub  =>  p[j] - p[i] <= D`` on a stage of ``speed``
    (the load's compute part is a correctly rounded quotient, divided by the speed once more, and
    ``recv >= 0``; the margin covers both roundings)."""
    return int(Fraction(ub) * Fraction(speed) * obj.den * Fraction(1 + 2**-50)) + 1


def _allowances(obj: Objective, run: Run, ub: float) -> list[int]:
    """:func:`_units` for each stage of ``run`` (one value for all without speeds)."""
    n = run.stop - run.first
    if obj.speed is None:
        return [_units(obj, ub)] * n
    return [_units(obj, ub, obj.speed[s]) for s in range(run.first, run.stop)]


def windows(obj: Objective, run: Run, ub: float) -> Window | None:
    """For each stage of ``run``, the smallest and largest end over every split whose stages'
    compute parts are all <= ``ub`` (a relaxation of ``load <= ub``: receive times and memory
    dropped), by greedy reach from both ends (exact for additive monotone loads). Every split
    with heaviest load <= ``ub`` ends its stages inside these windows. None: no such split.
    With speeds each stage reaches as far as its own allowance (greedy stays exact)."""
    a, c, x, y = run
    p, n, D = obj.p, run.stop - run.first, _allowances(obj, run, ub)
    hi, lo = [0] * n, [0] * n
    e = x
    for t in range(n):
        far = bisect_right(p, p[e] + D[t], e, y + 1) - 1
        e = min(far, y - (n - 1 - t))
        if e < x + t + 1:
            return None
        hi[t] = e
    if hi[-1] != y:
        return None
    lo[-1] = f = y
    for t in range(n - 1, 0, -1):
        i = max(bisect_left(p, p[f] - D[t], x, f), x + t)
        if i >= f or i > hi[t - 1]:
            return None
        lo[t - 1] = f = i
    return lo, hi


def _upper_bound(obj: Objective, run: Run) -> float:
    """A heaviest-stage load some split of ``run`` achieves: the compute-only optimum (greedy
    stage counts, bisected to 1e-6) plus the largest receive time of any of its stages. With
    speeds, ``D`` counts time: stage ``s`` may hold ``D x speed[s]`` units of work. (Only a guess
    to narrow the search: :func:`bottleneck` is exact whatever it returns.)"""
    a, c, x, y = run
    p, n = obj.p, c - a
    ratios = None if obj.speed is None else [v.as_integer_ratio() for v in obj.speed[a:c]]

    def stages(D: int) -> int:
        e, k = x, 0
        while e < y and k <= n:
            allow = D if ratios is None or k == n else D * ratios[k][0] // ratios[k][1]
            e = bisect_right(p, p[e] + allow, e, y + 1) - 1
            k += 1
        return k

    if ratios is None:
        lo = max(max(p[i + 1] - p[i] for i in range(x, y)), (p[y] - p[x]) // n) - 1  # infeasible
        hi = p[y] - p[x]  # feasible: one stage
    else:
        lo = -1  # infeasible (no D below 0 is tried)
        num, den = ratios[0]
        hi = -(-(p[y] - p[x]) * den // num)  # feasible: the first stage holds everything
    while hi - lo > max(1, hi >> 20):
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if stages(mid) <= n else (mid, hi)
    return hi / obj.den + max(max(r[x:y]) for r in {id(r): r for r in obj.recv[a:c]}.values())


def _dp(obj: Objective, lo: list[list[int]] | None, run: Run, win: Window | None) -> float:
    """Smallest heaviest-stage load of ``run`` over splits ending each stage inside ``win``."""
    a, c, x, y = run
    p, den = obj.p, obj.den
    n = c - a
    wlo, whi = win if win is not None else ([x + t + 1 for t in range(n - 1)] + [y],
                                            [y - (n - 1 - t) for t in range(n)])
    speeds = obj.speed
    prev = [INF] * (y + 1)
    for j in range(wlo[0], whi[0] + 1):
        if lo is None or lo[a][j] <= x:
            prev[j] = obj.load(a, x, j)
    for t in range(1, n):
        s = a + t
        recv = obj.recv[s]  # stage s's input link
        sp = None if speeds is None else speeds[s]
        ilo, ihi = wlo[t - 1], whi[t - 1]  # where stage s can start
        cur = [INF] * (y + 1)
        los = None if lo is None else lo[s]
        # floor[i] = min(prev[ilo..i]): once it reaches ``best``, no earlier start can help.
        floor, acc = [INF] * (y + 1), INF
        for i in range(ilo, ihi + 1):
            acc = min(acc, prev[i])
            floor[i] = acc
        for j in range(wlo[t], whi[t] + 1):
            best = INF
            pj = p[j]
            imin = ilo if los is None else max(ilo, los[j])
            for i in range(min(j - 1, ihi), imin - 1, -1):
                seg = (pj - p[i]) / den
                if sp is not None:
                    seg = seg / sp
                if seg >= best or floor[i] >= best:  # earlier starts cannot do better
                    break
                v = prev[i]
                if v >= best:
                    continue
                t_ = seg + recv[i]
                if t_ > v:
                    v = t_
                if v < best:
                    best = v
            cur[j] = best
        prev = cur
    return prev[y]


def bottleneck(obj: Objective, lo: list[list[int]] | None, run: Run) -> float:
    """OPT of ``run``: its smallest achievable heaviest-stage load (INF if nothing fits).

    The DP only visits stage ends inside the :func:`windows` of an upper bound ``ub``; a result
    ``<= ub`` is then OPT (every split within ``ub`` lies inside them). Otherwise the result is
    itself achievable, so a second pass inside its own windows is exact; INF falls back to the
    full DP."""
    if run.stop - run.first <= 2:
        return _dp(obj, lo, run, None)
    ub = _upper_bound(obj, run)
    win = windows(obj, run, ub)
    v = INF if win is None else _dp(obj, lo, run, win)
    if v <= ub:
        return v
    if v < INF:
        return _dp(obj, lo, run, windows(obj, run, v))
    return _dp(obj, lo, run, None)


def _moved(ref: tuple[int, ...] | None, s: int, i: int, j: int) -> int:
    if ref is None:
        return 0
    return (j - i) - max(0, min(j, ref[s + 1]) - max(i, ref[s]))


def solve_run(
    obj: Objective, lo: list[list[int]] | None, run: Run, opt: float, ref: tuple[int, ...] | None
) -> list[int]:
    """Boundaries ``b[a..c]`` of ``run`` whose heaviest stage is ``opt`` (from :func:`bottleneck`):
    fewest layers moved from the reference boundaries ``ref`` (global indices), then
    lexicographically smallest."""
    a, c, x, y = run
    p, den = obj.p, obj.den
    # every split within opt ends its stages inside these windows (see bottleneck)
    wlo, whi = windows(obj, run, opt) or ([x] * (c - a), [y] * (c - a))

    def last_end(s: int, i: int) -> int:
        """Largest end j of stage s starting at i with load <= opt that fits memory (< i+1 if
        none); both conditions are monotone in j, so bisect."""
        hi = min(y - (c - 1 - s), whi[s - a])
        if lo is not None:
            hi = min(hi, bisect_right(lo[s], i) - 1)
        pi, r = p[i], obj.recv[s][i]
        if obj.speed is None:
            return i + bisect_right(range(i + 1, hi + 1), opt, key=lambda j: (p[j] - pi) / den + r)
        sp = obj.speed[s]
        return i + bisect_right(range(i + 1, hi + 1), opt, key=lambda j: (p[j] - pi) / den / sp + r)

    # Forward pass: the starts of each stage reachable from x through stages within the
    # optimum (an optimal split only uses those), with each start's last admissible end.
    ends: list[dict[int, int]] = []
    starts = [x]
    for s in range(a, c):
        ends.append({i: last_end(s, i) for i in starts})
        if s == c - 1:
            break
        mark = [0] * (y + 2)
        for i, jhi in ends[-1].items():
            if jhi > i:
                mark[i + 1] += 1
                mark[jhi + 1] -= 1
        starts, acc = [], 0
        for j in range(x + 1, y + 1):
            acc += mark[j]
            if acc and wlo[s - a] <= j:
                starts.append(j)

    # G[s - a][i]: fewest moved layers for stages s..c-1 covering i..y-1 within the optimum.
    # moved(s, i, j) is piecewise (slope 1, 0, 1 in j) around the reference stage [r0, r1),
    # so each piece is a C-level min() over a slice of G[s+1] or G[s+1][j] + j.
    G: list[list[float]] = [[INF] * (y + 1) for _ in range(c - a + 1)]
    G[c - a][y] = 0
    for s in range(c - 1, a - 1, -1):
        g, gn = G[s - a], G[s - a + 1]
        h = [v + j for j, v in enumerate(gn)]
        for i, jhi in ends[s - a].items():
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
    assert G[0][x] != INF, "tie-break pass lost the optimum"
    bounds, i = [x], x
    for s in range(a, c):
        for j in range(i + 1, ends[s - a][i] + 1):
            if G[s - a + 1][j] + _moved(ref, s, i, j) == G[s - a][i]:
                break
        else:  # pragma: no cover - G is consistent by construction
            raise AssertionError("tie-break reconstruction failed")
        bounds.append(j)
        i = j
    return bounds


def solve(problem: BalanceProblem, obj: Objective, reference: Partition | None) -> Partition:
    """Optimal partition for ``obj``; ties -> fewest layers moved from ``reference``, then
    lexicographically smallest boundaries. Raises InfeasiblePartitionError."""
    L, S = problem.num_layers, problem.num_stages
    lo = memory_limits(problem)
    run = Run(0, S, 0, L)
    opt = bottleneck(obj, lo, run)
    if opt == INF:
        raise InfeasiblePartitionError(problem.model.capacity, min_peak_memory(problem), L, S)
    ref = None if reference is None else reference.boundaries
    return Partition(tuple(solve_run(obj, lo, run, opt, ref)))


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
