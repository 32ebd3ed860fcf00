"""Balancers against brute force (all compositions) on small instances, against an independent
dynamic program on larger ones, plus the registry. (How fast they are is a benchmark's claim:
``benchmarks/balancers.py``.)"""
import math
import random
from dataclasses import replace
from itertools import combinations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from lightning_dynmo.plan.balancers import (
    BalanceProblem,
    BalanceResult,
    InfeasiblePartitionError,
    available_balancers,
    get_balancer,
    megatron_layout,
    register_balancer,
    unregister_balancer,
)
from lightning_dynmo.plan.balancers.diffusion import diffuse
from lightning_dynmo.plan.cost_model import SCHEDULES, CostModel, LayerCosts
from lightning_dynmo.plan.partition import Partition
from tests.support.balancing import fits

BUILTIN = ["diffusion_param", "diffusion_time", "param", "partition_param", "partition_time", "uniform"]
FAST = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def all_partitions(L, S):
    for cuts in combinations(range(1, L), S - 1):
        yield Partition((0, *cuts, L))


def loads(problem, part, kind):
    if kind == "time":
        return problem.model.stage_times(problem.costs, part)
    return problem.costs.stage_params(part)


def brute(problem, kind):
    """(optimal max load, feasible optimal partitions) by enumeration; (None, []) if infeasible."""
    feas = [p for p in all_partitions(problem.num_layers, problem.num_stages) if fits(problem, p)]
    if not feas:
        return None, []
    opt = min(max(loads(problem, p, kind)) for p in feas)
    return opt, [p for p in feas if max(loads(problem, p, kind)) == opt]


# Small value sets create many exact ties; arbitrary floats exercise rounding.
value = st.one_of(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0]), st.floats(0, 10, allow_subnormal=False))


speed = st.one_of(st.sampled_from([0.25, 0.5, 1.0, 2.0]), st.floats(0.1, 4.0, allow_subnormal=False))


@st.composite
def problems(draw, max_layers=9, max_stages=4, with_current=True, speeds=False):
    L = draw(st.integers(1, max_layers))
    S = draw(st.integers(1, min(L, max_stages)))
    col = lambda: draw(st.lists(value, min_size=L, max_size=L))  # noqa: E731
    costs = LayerCosts(col(), col(), draw(st.lists(st.integers(0, 6), min_size=L, max_size=L)), col(), col())
    link = st.sampled_from([0.5, 1.0, 4.0])
    per_boundary = st.lists(st.sampled_from([0.5, 1.0, 4.0, math.inf]), min_size=S - 1, max_size=S - 1).map(tuple)
    model = CostModel(
        draw(st.integers(1, 8)),
        draw(st.sampled_from(SCHEDULES)),
        bandwidth=draw(st.one_of(st.none(), link, per_boundary) if S > 1 else st.one_of(st.none(), link)),
        capacity=draw(st.one_of(st.none(), st.floats(1.0, 150.0))),
        speed=draw(st.lists(speed, min_size=S, max_size=S).map(tuple)) if speeds else None,
    )
    current = None
    if with_current and draw(st.booleans()):
        cuts = draw(st.sets(st.integers(1, L - 1), min_size=S - 1, max_size=S - 1)) if L > 1 else set()
        current = Partition((0, *sorted(cuts), L))
    return BalanceProblem(costs, S, model, current)


def assert_ordered_cover(part: Partition, L: int, S: int) -> None:
    """Layers stay in order: stage s holds a contiguous run, stage s+1 the run right after it,
    and walking the stages in order visits every layer exactly once, 0..L-1."""
    assert isinstance(part, Partition) and part.num_stages == S
    assert [i for stage in part for i in stage] == list(range(L))
    owners = part.owner_map()
    assert owners == sorted(owners) and set(owners) == set(range(S))


@FAST
@given(problems())
def test_every_balancer_valid_fits_or_provably_infeasible(problem):
    L, S = problem.num_layers, problem.num_stages
    feasible = any(fits(problem, p) for p in all_partitions(L, S))
    for name in BUILTIN:
        try:
            r = get_balancer(name)(problem)
        except InfeasiblePartitionError as e:
            assert not feasible, f"{name} raised although a partition fits"
            assert e.capacity == problem.model.capacity and e.min_peak_memory > e.capacity
            peak = min(max(problem.model.stage_memory(problem.costs, p)) for p in all_partitions(L, S))
            assert e.min_peak_memory == peak
            continue
        assert isinstance(r, BalanceResult) and r.name == name and r.rounds >= 1
        part = r.partition
        assert part.boundaries[0] == 0 and part.num_layers == L and part.num_stages == S
        assert all(n >= 1 for n in part.sizes)
        assert_ordered_cover(part, L, S)
        assert fits(problem, part), f"{name} overflowed memory"
        assert r.max_load == max(r.loads)
        assert r.predicted_step_time == problem.model.predicted_step_time(problem.costs, part)
        assert get_balancer(name)(problem) == r  # deterministic and pure


@FAST
@given(problems())
def test_partition_is_exact_and_moves_fewest_layers(problem):
    for name, kind in (("partition_time", "time"), ("partition_param", "params")):
        opt, optimal = brute(problem, kind)
        if opt is None:
            with pytest.raises(InfeasiblePartitionError):
                get_balancer(name)(problem)
            continue
        r = get_balancer(name)(problem)
        assert r.max_load == opt
        assert max(loads(problem, r.partition, kind)) == opt
        if problem.current is not None:
            fewest = min(p.moved_layers(problem.current) for p in optimal)
            assert r.partition.moved_layers(problem.current) == fewest
            optimal = [p for p in optimal if p.moved_layers(problem.current) == fewest]
        assert r.partition == min(optimal, key=lambda p: p.boundaries)


@FAST
@given(problems(with_current=False))
def test_param_is_exact_deepspeed_objective(problem):
    opt, optimal = brute(problem, "params")
    if opt is None:
        with pytest.raises(InfeasiblePartitionError):
            get_balancer("param")(problem)
        return
    r = get_balancer("param")(problem)
    assert r.max_load == opt and r.partition == min(optimal, key=lambda p: p.boundaries)


@FAST
@given(problems())
def test_uniform_layout(problem):
    L, S = problem.num_layers, problem.num_stages
    mega = megatron_layout(L, S)
    q, rem = divmod(L, S)
    assert mega.sizes == (q + 1,) * rem + (q,) * (S - rem)
    feasible = [p for p in all_partitions(L, S) if fits(problem, p)]
    if not feasible:
        with pytest.raises(InfeasiblePartitionError):
            get_balancer("uniform")(problem)
        return
    r = get_balancer("uniform")(problem)
    if fits(problem, mega):
        assert r.partition == mega
    else:  # fallback: most even layer counts that fit
        best = min(max(p.sizes) for p in feasible)
        assert max(r.partition.sizes) == best and fits(problem, r.partition)


def _no_helpful_move(problem, part, kind):
    """Fixed point: no single boundary-layer hand-off strictly lowers a neighbour pair's max."""
    b = part.boundaries
    for k in range(1, problem.num_stages):
        for nb in (b[k] - 1, b[k] + 1):
            if not b[k - 1] < nb < b[k + 1]:
                continue
            moved = Partition(b[:k] + (nb,) + b[k + 1 :])
            old, new = loads(problem, part, kind), loads(problem, moved, kind)
            heavier_gives = (nb < b[k]) == (old[k - 1] > old[k]) and old[k - 1] != old[k]
            if heavier_gives and max(new[k - 1 : k + 1]) < max(old[k - 1 : k + 1]) and fits(problem, moved):
                return False
    return True


@settings(max_examples=150, deadline=None)
@given(problems(max_layers=30, max_stages=8))
def test_diffusion_never_worsens_and_converges(problem):
    for name, kind in (("diffusion_time", "time"), ("diffusion_param", "params")):
        exact_name = "partition_" + ("time" if kind == "time" else "param")
        try:
            r = get_balancer(name)(problem)
        except InfeasiblePartitionError:
            # only when nothing fits: the exact balancer (checked against brute force above) agrees
            with pytest.raises(InfeasiblePartitionError):
                get_balancer(exact_name)(problem)
            continue
        assert_ordered_cover(r.partition, problem.num_layers, problem.num_stages)
        start = problem.current or get_balancer("uniform")(problem).partition
        if fits(problem, start):
            assert r.max_load <= max(loads(problem, start, kind))
        else:  # restarted from the exact partition, so it is optimal
            exact = get_balancer(exact_name)(problem)
            assert r.max_load == exact.max_load
        assert _no_helpful_move(problem, r.partition, kind)


def test_diffusion_rounds_and_monotone_trace():
    rnd = random.Random(1)
    L, S = 40, 8
    costs = LayerCosts([rnd.uniform(0, 5) for _ in range(L)], [0.0] * L, [1] * L, [0.0] * L, [1.0] * L)
    problem = BalanceProblem(costs, S, CostModel(8, bandwidth=4.0), Partition.from_sizes([33] + [1] * 7))
    peaks = [max(diffuse(problem, "time", "t", max_rounds=n).loads) for n in range(1, 60)]
    assert all(a >= b for a, b in zip(peaks, peaks[1:]))  # heaviest stage never grows
    final = get_balancer("diffusion_time")(problem)
    assert 1 < final.rounds < 60 and final.max_load == peaks[-1]
    again = BalanceProblem(costs, S, problem.model, final.partition)
    assert get_balancer("diffusion_time")(again).rounds == 1  # already a fixed point


def test_problem_validation():
    c = LayerCosts.uniform(3)
    with pytest.raises(ValueError, match="cannot split 3 layers into 4 non-empty stages"):
        BalanceProblem(c, 4, CostModel(2))
    with pytest.raises(ValueError):
        BalanceProblem(c, 0, CostModel(2))
    with pytest.raises(ValueError, match="current"):
        BalanceProblem(c, 2, CostModel(2), Partition((0, 1, 2, 3)))
    with pytest.raises(ValueError, match="current"):
        BalanceProblem(c, 2, CostModel(2), Partition((0, 1, 4)))


def test_infeasible_message_names_capacity_and_peak():
    c = LayerCosts.uniform(4, memory=10.0)
    problem = BalanceProblem(c, 2, CostModel(2, capacity=15.0))
    for name in BUILTIN:
        with pytest.raises(InfeasiblePartitionError, match=r"capacity of 15 bytes.*peak stage memory is 20 bytes"):
            get_balancer(name)(problem)


def test_registry_unknown_name_lists_valid_sorted():
    with pytest.raises(ValueError) as e:
        get_balancer("nope")
    assert ", ".join(sorted(available_balancers())) in str(e.value)
    assert set(BUILTIN) <= set(available_balancers())


def test_user_registration():
    @register_balancer("test_all_in_first")
    def mine(problem):
        part = Partition.from_sizes([problem.num_layers - problem.num_stages + 1] + [1] * (problem.num_stages - 1))
        return BalanceResult(part, 1, 0.0, 0.0, "test_all_in_first")

    try:
        assert "test_all_in_first" in available_balancers()
        r = get_balancer("test_all_in_first")(BalanceProblem(LayerCosts.uniform(5), 2, CostModel(1)))
        assert r.partition.sizes == (4, 1)
        with pytest.raises(ValueError, match="already registered"):
            register_balancer("test_all_in_first")(mine)
        register_balancer("test_all_in_first", override=True)(mine)
        with pytest.raises(ValueError, match="already registered"):
            register_balancer("uniform")(mine)
    finally:
        unregister_balancer("test_all_in_first")
    assert "test_all_in_first" not in available_balancers()


def test_never_reorders_and_known_answer():
    # one heavy layer: the exact balancer isolates it, diffusion walks towards it
    c = LayerCosts([1.0, 1.0, 8.0, 1.0, 1.0, 1.0], [0.0] * 6, [1] * 6, [0.0] * 6, [0.0] * 6)
    problem = BalanceProblem(c, 3, CostModel(4))
    r = get_balancer("partition_time")(problem)
    assert r.max_load == 8.0 and r.partition.boundaries == (0, 2, 3, 6)
    assert get_balancer("uniform")(problem).partition.boundaries == (0, 2, 4, 6)
    assert get_balancer("diffusion_time")(problem).max_load <= 9.0
    for name in BUILTIN:  # the heavy layer stays third; nothing is moved out of order to balance it
        assert_ordered_cover(get_balancer(name)(problem).partition, 6, 3)


def dp_optimum(problem: BalanceProblem, kind: str) -> float:
    """Optimal max stage load by an O(S L^2) dynamic program over (stage, first layer of the
    next stage), with the memory capacity per stage; independent of the balancers' search."""
    L, S, model, costs = problem.num_layers, problem.num_stages, problem.model, problem.costs
    load = (lambda s, i, j: model.segment_time(costs, i, j, s)) if kind == "time" else (
        lambda s, i, j: costs.params_sum(i, j))
    best = [[math.inf] * (L + 1) for _ in range(S + 1)]
    best[0][0] = -math.inf
    for s in range(1, S + 1):
        for j in range(s, L - (S - s) + 1):
            for i in range(s - 1, j):
                if best[s - 1][i] == math.inf or not model.fits(model.segment_memory(costs, i, j, s - 1, S)):
                    continue
                best[s][j] = min(best[s][j], max(best[s - 1][i], load(s - 1, i, j)))
    return best[S][L]


@pytest.mark.parametrize("links", ["one", "per_boundary"])
@pytest.mark.parametrize("capacity", ["none", "binding"])
def test_exact_balancers_are_optimal_for_64_layers_12_stages(capacity, links):
    rnd = random.Random(0)
    L, S = 64, 12
    costs = LayerCosts(
        [rnd.uniform(0.5, 2) for _ in range(L)],
        [rnd.uniform(1, 4) for _ in range(L)],
        [rnd.randint(1, 10**6) for _ in range(L)],
        [rnd.uniform(1e6, 1e7) for _ in range(L)],
        [rnd.uniform(1e5, 1e6) for _ in range(L)],
    )
    bw = 1e9 if links == "one" else tuple(1e9 if s % 4 == 3 else 8e9 for s in range(S - 1))  # nodes of 4 ranks
    free = BalanceProblem(costs, S, CostModel(32, bandwidth=bw), megatron_layout(L, S))
    problem = free
    if capacity == "binding":  # 5 % below the peak memory of the unconstrained optimum
        peak = max(free.model.stage_memory(costs, get_balancer("partition_time")(free).partition))
        problem = BalanceProblem(costs, S, CostModel(32, bandwidth=bw, capacity=0.95 * peak), megatron_layout(L, S))
    for name, kind in (("partition_time", "time"), ("partition_param", "params")):
        r = get_balancer(name)(problem)
        assert r.max_load == dp_optimum(problem, kind)
        assert fits(problem, r.partition)
        assert_ordered_cover(r.partition, L, S)
    if capacity == "binding":  # the capacity changed the answer
        assert get_balancer("partition_time")(problem).max_load > get_balancer("partition_time")(free).max_load


# ---- per-boundary link bandwidth ------------------------------------------------------------------
@FAST
@given(problems())
def test_uniform_per_boundary_bandwidth_is_exactly_one_bandwidth(problem):
    """Every balancer returns the same result for one bandwidth and for it repeated per boundary."""
    bw = problem.model.bandwidth
    if problem.num_stages < 2 or bw is None or isinstance(bw, tuple):
        return
    per = BalanceProblem(problem.costs, problem.num_stages,
                         replace(problem.model, bandwidth=(bw,) * (problem.num_stages - 1)),
                         problem.current)
    for name in BUILTIN:
        try:
            r = get_balancer(name)(problem)
        except InfeasiblePartitionError:
            with pytest.raises(InfeasiblePartitionError):
                get_balancer(name)(per)
            continue
        assert get_balancer(name)(per) == r


def test_slow_link_moves_the_cut_to_a_narrow_activation():
    # 4 equal layers, 2 stages on a link of 1 B/s; layer 1's output is wide (4 B), layer 2's narrow
    # (0.5 B): on a fast link the even cut after layer 1 is best, on the slow one the cut after layer 2
    c = LayerCosts([1.0] * 4, [2.0] * 4, [1] * 4, [0.0] * 4, [1.0, 4.0, 0.5, 1.0])
    fast, slow = CostModel(8, bandwidth=(1e9,)), CostModel(8, bandwidth=(1.0,))
    for name in ("partition_time", "diffusion_time"):
        assert get_balancer(name)(BalanceProblem(c, 2, fast)).partition.boundaries == (0, 2, 4)
        r = get_balancer(name)(BalanceProblem(c, 2, slow))
        assert r.partition.boundaries == (0, 3, 4) and r.loads == (9.0, 3.0 + 2 * 0.5)
    # three stages: only the second boundary is slow, so only the cut into stage 2 avoids the wide output
    c = LayerCosts([1.0] * 6, [2.0] * 6, [1] * 6, [0.0] * 6, [1.0, 1.0, 1.0, 8.0, 0.25, 1.0])
    fast = math.inf
    for bw, cuts in (((fast, fast), (0, 2, 4, 6)), ((fast, 1.0), (0, 2, 5, 6)), ((1.0, fast), (0, 2, 4, 6))):
        r = get_balancer("partition_time")(BalanceProblem(c, 3, CostModel(8, bandwidth=bw)))
        assert r.partition.boundaries == cuts, bw


# ---- rank speeds: a stage's time is its work over its speed --------------------------------------
def speed_loads(problem, part):
    """Independent of the balancers' Objective: work / speed + receive, from the cost model's parts."""
    costs, model, b = problem.costs, problem.model, part.boundaries
    return [costs.time_sum(b[s], b[s + 1]) / model.speed[s] + model.recv_time(costs, b[s], s)
            for s in range(part.num_stages)]


@FAST
@given(problems(speeds=True))
def test_partition_time_with_speeds_is_exact_and_moves_fewest_layers(problem):
    L, S = problem.num_layers, problem.num_stages
    feas = [p for p in all_partitions(L, S) if fits(problem, p)]
    if not feas:
        with pytest.raises(InfeasiblePartitionError):
            get_balancer("partition_time")(problem)
        return
    opt = min(max(speed_loads(problem, p)) for p in feas)
    optimal = [p for p in feas if max(speed_loads(problem, p)) == opt]
    r = get_balancer("partition_time")(problem)
    assert r.max_load == opt and list(r.loads) == speed_loads(problem, r.partition)
    assert problem.model.stage_times(problem.costs, r.partition) == list(r.loads)
    if problem.current is not None:
        fewest = min(p.moved_layers(problem.current) for p in optimal)
        optimal = [p for p in optimal if p.moved_layers(problem.current) == fewest]
    assert r.partition == min(optimal, key=lambda p: p.boundaries)
    # the static proxies do not depend on speed
    plain = BalanceProblem(problem.costs, S, replace(problem.model, speed=None), problem.current)
    for name in ("partition_param", "param"):
        assert get_balancer(name)(problem).partition == get_balancer(name)(plain).partition


@settings(max_examples=150, deadline=None)
@given(problems(max_layers=30, max_stages=8, speeds=True))
def test_diffusion_with_speeds_reaches_the_exact_optimum(problem):
    try:
        exact = get_balancer("partition_time")(problem)
    except InfeasiblePartitionError:
        with pytest.raises(InfeasiblePartitionError):
            get_balancer("diffusion_time")(problem)
        return
    r = get_balancer("diffusion_time")(problem)
    assert fits(problem, r.partition) and r.max_load == exact.max_load
    assert list(r.loads) == speed_loads(problem, r.partition)
    start = problem.current or get_balancer("uniform")(problem).partition
    if fits(problem, start):
        assert r.max_load <= max(speed_loads(problem, start))
    assert _no_helpful_move(problem, r.partition, "time")


@FAST
@given(problems(max_layers=12, max_stages=5))
def test_all_speeds_one_is_bit_identical_to_no_speeds(problem):
    ones = BalanceProblem(problem.costs, problem.num_stages,
                          replace(problem.model, speed=(1.0,) * problem.num_stages), problem.current)
    for name in BUILTIN:
        try:
            r = get_balancer(name)(problem)
        except InfeasiblePartitionError:
            with pytest.raises(InfeasiblePartitionError):
                get_balancer(name)(ones)
            continue
        assert get_balancer(name)(ones) == r


@pytest.mark.parametrize("capacity", ["none", "binding"])
def test_exact_with_speeds_is_optimal_for_64_layers_12_stages(capacity):
    rnd = random.Random(3)
    L, S = 64, 12
    costs = LayerCosts([rnd.uniform(0.5, 2) for _ in range(L)], [rnd.uniform(1, 4) for _ in range(L)], [1] * L,
                       [rnd.uniform(1e6, 1e7) for _ in range(L)], [rnd.uniform(1e5, 1e6) for _ in range(L)])
    sp = tuple(0.5 if s == 5 else rnd.uniform(0.8, 1.0) for s in range(S))
    model = CostModel(32, bandwidth=1e9, speed=sp)
    if capacity == "binding":
        free = get_balancer("partition_time")(BalanceProblem(costs, S, model)).partition
        model = replace(model, capacity=0.95 * max(model.stage_memory(costs, free)))
    problem = BalanceProblem(costs, S, model, megatron_layout(L, S))
    r = get_balancer("partition_time")(problem)
    assert r.max_load == dp_optimum(problem, "time") and fits(problem, r.partition)
    assert get_balancer("diffusion_time")(problem).max_load == r.max_load
    even = get_balancer("partition_time")(BalanceProblem(costs, S, replace(model, speed=None), megatron_layout(L, S)))
    assert r.partition.sizes[5] < even.partition.sizes[5]  # the half-speed stage gets less work


def test_slow_stage_gets_half_the_work():
    c = LayerCosts.uniform(12, forward=1.0, backward=2.0)
    r = get_balancer("partition_time")(BalanceProblem(c, 3, CostModel(8, speed=(1.0, 0.5, 1.0))))
    assert r.partition.sizes == (5, 2, 5) and r.loads == (15.0, 12.0, 15.0)
    for name in ("diffusion_time", "partition_time"):  # and from the even split: 4 | 4 | 4
        moved = get_balancer(name)(BalanceProblem(c, 3, CostModel(8, speed=(1.0, 0.5, 1.0)), megatron_layout(12, 3)))
        assert moved.max_load == 15.0 and moved.partition.sizes[1] == 2
