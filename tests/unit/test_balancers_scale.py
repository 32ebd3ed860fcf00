"""Balancers at scale: diffusion escapes staircases, the exact partition matches a textbook DP on
instances far beyond brute force, and stays fast at 96 layers x 32 stages."""
import math
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_dynmo.plan.balancers import BalanceProblem, get_balancer, megatron_layout
from lightning_dynmo.plan.balancers.diffusion import diffuse
from lightning_dynmo.plan.balancers.exact import min_peak_memory
from lightning_dynmo.plan.cost_model import CostModel, LayerCosts
from lightning_dynmo.plan.partition import Partition
from tests.support.balancing import fits

SCALE = settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def frozen_prefix(L: int, k: int) -> LayerCosts:
    """The first ``k`` layers skip backward: per-layer time 1 there, 3 after -- a staircase."""
    return LayerCosts([1.0] * L, [0.0] * k + [2.0] * (L - k), [1] * L, [0.0] * L, [0.0] * L)


@st.composite
def staircases(draw, max_layers=64, max_stages=16):
    """Frozen-prefix costs (optionally jittered), optional links and memory capacity, starting
    from the Megatron layout or a random split."""
    L = draw(st.integers(4, max_layers))
    S = draw(st.integers(2, min(max_stages, L)))
    k = draw(st.integers(0, L - 1))
    jitter = draw(st.lists(st.sampled_from([1.0, 1.0, 1.0, 1.25, 0.75]), min_size=L, max_size=L))
    bwd = [0.0 if i < k else 2.0 * j for i, j in enumerate(jitter)]
    mem = draw(st.lists(st.sampled_from([1.0, 2.0, 3.0]), min_size=L, max_size=L))
    act = draw(st.lists(st.sampled_from([0.25, 0.5, 1.0]), min_size=L, max_size=L))
    costs = LayerCosts(jitter, bwd, [int(4 * m) for m in mem], mem, act)
    bandwidth = draw(st.sampled_from([None, None, 4.0, "per_boundary"]))
    if bandwidth == "per_boundary":  # nodes of 1-4 ranks: a slow link between nodes, fast inside
        per_node = draw(st.integers(1, 4))
        bandwidth = tuple(1.0 if (s + 1) % per_node == 0 else 8.0 for s in range(S - 1))
    model = CostModel(4 * S, "1f1b", bandwidth=bandwidth)
    if draw(st.booleans()):
        slack = draw(st.sampled_from([1.0, 1.1, 1.5]))
        model = CostModel(4 * S, "1f1b", bandwidth=bandwidth,
                          capacity=min_peak_memory(BalanceProblem(costs, S, model)) * slack)
    if draw(st.booleans()):
        current = megatron_layout(L, S)
    else:
        current = Partition((0, *sorted(draw(st.sets(st.integers(1, L - 1), min_size=S - 1, max_size=S - 1))), L))
    return BalanceProblem(costs, S, model, current)


def textbook_optimum(problem, load):
    """min over partitions of the max stage ``load(s, i, j)`` that fit memory: every (i, j) tried."""
    L, S, model, costs = problem.num_layers, problem.num_stages, problem.model, problem.costs
    best = [0.0] + [math.inf] * L
    for s in range(S):
        cur = [math.inf] * (L + 1)
        for j in range(s + 1, L - (S - 1 - s) + 1):
            for i in range(s, j):
                if model.fits(model.segment_memory(costs, i, j, s, S)):
                    cur[j] = min(cur[j], max(best[i], load(s, i, j)))
        best = cur
    return best[L]


@SCALE
@given(staircases())
def test_diffusion_reaches_the_optimum_from_any_start(problem):
    start = problem.current
    for name, kind, exact in (("diffusion_time", "time", "partition_time"),
                              ("diffusion_param", "params", "partition_param")):
        r = get_balancer(name)(problem)
        opt = get_balancer(exact)(problem).max_load
        assert r.max_load == opt  # the fixed point is optimal (the issue asks for <= 1.2 x)
        if fits(problem, start):
            loads = (problem.model.stage_times(problem.costs, start) if kind == "time"
                     else problem.costs.stage_params(start))
            assert r.max_load <= max(loads)
        owner = r.partition.owner_map()
        assert owner == sorted(owner) and set(owner) == set(range(problem.num_stages))  # contiguous, ordered
        assert fits(problem, r.partition)
        assert r.rounds >= 1 and get_balancer(name)(problem) == r


@SCALE
@given(staircases(max_layers=40, max_stages=10))
def test_exact_matches_textbook_dp(problem):
    model, costs = problem.model, problem.costs
    t = get_balancer("partition_time")(problem)
    assert t.max_load == textbook_optimum(problem, lambda s, i, j: model.segment_time(costs, i, j, s))
    p = get_balancer("partition_param")(problem)
    assert p.max_load == textbook_optimum(problem, lambda s, i, j: costs.params_sum(i, j))


def test_staircase_from_issue_14():
    """42 layers, 37 frozen, 14 stages: from the Megatron layout every neighbour re-split keeps
    the last stage at 9 (2.25x); widening runs reaches the optimum 4."""
    problem = BalanceProblem(frozen_prefix(42, 37), 14, CostModel(56))
    assert diffuse(problem, "time", "pairs", widen=False).max_load == 9.0
    r = get_balancer("diffusion_time")(problem)
    assert r.max_load == get_balancer("partition_time")(problem).max_load == 4.0
    assert r.rounds > 1
    again = BalanceProblem(problem.costs, 14, problem.model, r.partition)
    assert get_balancer("diffusion_time")(again).rounds == 1  # a fixed point


def test_pair_moves_never_raise_the_peak_while_widening():
    rnd = random.Random(3)
    L, S = 64, 16
    costs = LayerCosts([rnd.choice([0.5, 1.0, 4.0]) for _ in range(L)], [0.0] * 20 + [2.0] * (L - 20),
                       [1] * L, [0.0] * L, [0.0] * L)
    problem = BalanceProblem(costs, S, CostModel(4 * S))
    peaks = [diffuse(problem, "time", "t", max_rounds=n).max_load for n in range(1, 30)]
    assert all(a >= b for a, b in zip(peaks, peaks[1:]))
    assert peaks[-1] == get_balancer("partition_time")(problem).max_load


def test_exact_solves_96_layers_32_stages_with_memory_and_links():
    """Its speed is benchmarks/balancers.py's to measure (200 x 32 under 50 ms); a timed assertion
    here failed under load. Here: a large problem with a binding memory capacity is solved, fits,
    and is at least as good as Megatron's layout it started from."""
    rnd = random.Random(0)
    L, S = 96, 32
    costs = LayerCosts([rnd.lognormvariate(0, 0.6) for _ in range(L)], [rnd.uniform(0, 4) for _ in range(L)],
                       [rnd.randint(1, 10**6) for _ in range(L)], [rnd.uniform(1e6, 1e7) for _ in range(L)],
                       [rnd.uniform(1e5, 1e6) for _ in range(L)])
    loose = BalanceProblem(costs, S, CostModel(4 * S, bandwidth=1e9))
    problem = BalanceProblem(costs, S, CostModel(4 * S, bandwidth=1e9, capacity=1.2 * min_peak_memory(loose)),
                             megatron_layout(L, S))
    result = get_balancer("partition_time")(problem)
    assert result.partition.num_stages == S and result.partition.num_layers == L
    assert result.max_load <= get_balancer("uniform")(problem).max_load + 1e-12
