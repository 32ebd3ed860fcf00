"""Cost model: schedule memory, stage time incl. transfers, fill-drain step time, exact sums."""
import math

import pytest
from hypothesis import given, strategies as st

from lightning_dynmo.plan.cost_model import SCHEDULES, CostModel, LayerCosts, imbalance
from lightning_dynmo.plan.partition import Partition


def test_layer_costs_validation():
    with pytest.raises(ValueError, match="equal lengths"):
        LayerCosts([1.0], [1.0, 2.0], [1], [0.0], [0.0])
    with pytest.raises(ValueError, match="forward\\[0\\].*>= 0"):
        LayerCosts([-1.0], [1.0], [1], [0.0], [0.0])
    with pytest.raises(ValueError, match="memory\\[0\\]"):
        LayerCosts([1.0], [1.0], [1], [math.nan], [0.0])
    with pytest.raises(ValueError, match="params\\[0\\]"):
        LayerCosts([1.0], [1.0], [1.5], [0.0], [0.0])
    with pytest.raises(ValueError, match="at least one layer"):
        LayerCosts([], [], [], [], [])


def test_layer_costs_helpers():
    u = LayerCosts.uniform(3, forward=1.0, backward=2.0, params=5, memory=7.0, activation=3.0)
    assert u.num_layers == 3 and u.time == (3.0, 3.0, 3.0) and u.params == (5, 5, 5)
    p = LayerCosts.from_params([10, 20], seconds_per_param=0.5, activation=4.0, memory=[160, 320])
    assert p.forward == (5.0, 10.0) and p.backward == (10.0, 20.0)
    assert p.memory == (160.0, 320.0) and p.activation == (4.0, 4.0)
    assert LayerCosts.from_params([10, 20]).memory == (0.0, 0.0)  # not known: no cap binds
    assert p.stage_params(Partition((0, 1, 2))) == [10, 20]


@given(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=30), st.data())
def test_exact_segment_sums(values, data):
    c = LayerCosts(values, values[::-1], [0] * len(values), values, values)
    i = data.draw(st.integers(0, len(values)))
    j = data.draw(st.integers(i, len(values)))
    assert c.time_sum(i, j) == math.fsum(values[i:j] + values[::-1][i:j])
    assert c.memory_sum(i, j) == math.fsum(values[i:j])


def test_schedule_validation():
    with pytest.raises(ValueError) as e:
        CostModel(4, "pipedream")
    for name in SCHEDULES:
        assert name in str(e.value)
    assert CostModel(4, "1F1B").schedule == "1f1b"
    with pytest.raises(ValueError):
        CostModel(0)
    with pytest.raises(ValueError):
        CostModel(4, bandwidth=0.0)
    with pytest.raises(ValueError):
        CostModel(4, capacity=-1.0)


@pytest.mark.parametrize("m", [1, 3, 8, 32])
def test_inflight(m):
    p = 4
    for s in range(p):
        assert CostModel(m, "gpipe").inflight(s, p) == m
        assert CostModel(m, "1f1b").inflight(s, p) == min(m, p - s)
        assert CostModel(m, "zero_bubble").inflight(s, p) == min(m, p - s)
        chunks = p + 2 * (p - 1 - s) + 1  # v = 2 chunks per rank
        assert CostModel(m, "interleaved_1f1b").inflight(s, p) == min(m, math.ceil(chunks / 2))
    assert [CostModel(16, "interleaved_1f1b").inflight(s, 4) for s in range(4)] == [6, 5, 4, 3]
    with pytest.raises(ValueError):
        CostModel(m).inflight(4, 4)


def test_stage_memory_and_times():
    c = LayerCosts(
        forward=[1.0, 2.0, 3.0, 4.0],
        backward=[2.0, 4.0, 6.0, 8.0],
        params=[1, 1, 1, 1],
        memory=[10.0, 20.0, 30.0, 40.0],
        activation=[1.0, 2.0, 3.0, 4.0],
    )
    part = Partition((0, 1, 4))
    m = CostModel(8, "1f1b", bandwidth=2.0)
    # stage 0 keeps min(8, 2) = 2 micro-batches, stage 1 keeps 1
    assert m.stage_memory(c, part) == [10.0 + 2 * 1.0, 90.0 + 1 * 9.0]
    assert CostModel(8, "gpipe").stage_memory(c, part) == [10.0 + 8 * 1.0, 90.0 + 8 * 9.0]
    # stage 1 receives layer 0's activation: 2 * 1 B / 2 B/s = 1 s
    assert m.stage_times(c, part) == [3.0, 27.0 + 1.0]
    assert CostModel(8).stage_times(c, part) == [3.0, 27.0]
    with pytest.raises(ValueError):
        m.stage_times(c, Partition((0, 2, 5)))


@pytest.mark.parametrize("m,p", [(1, 1), (4, 2), (8, 4), (16, 3)])
def test_equal_stages_step_and_bubble(m, p):
    c = LayerCosts.uniform(p * 2, forward=1.0, backward=2.0)
    part = Partition.from_sizes([2] * p)
    model = CostModel(m, "1f1b")
    t = 6.0
    assert model.predicted_step_time(c, part) == pytest.approx((m + p - 1) * t)
    assert model.bubble_fraction(c, part) == pytest.approx((p - 1) / (m + p - 1))
    assert model.ideal_step_time(c, p) == pytest.approx((m + p - 1) * t)


def test_ideal_step_time_is_a_lower_bound():
    c = LayerCosts([1.0, 5.0, 1.0], [0.0] * 3, [1] * 3, [0.0] * 3, [0.0] * 3)
    model = CostModel(4)
    ideal = model.ideal_step_time(c, 2)
    assert ideal == pytest.approx(5 * 3.5)
    assert model.predicted_step_time(c, Partition((0, 2, 3))) >= ideal


def test_imbalance():
    assert imbalance([1.0, 1.0]) == 0.0
    assert imbalance([1.0, 3.0]) == pytest.approx(1.0)
    assert imbalance([]) == 0.0 and imbalance([0.0, 0.0]) == 0.0
    assert CostModel.imbalance([2.0, 4.0, 6.0]) == pytest.approx(1.0)


@given(st.data())
def test_memory_fn_is_segment_memory_bit_for_bit(data):
    n = data.draw(st.integers(1, 12))
    vals = st.floats(0, 1e9, allow_nan=False, allow_infinity=False)
    costs = LayerCosts([1.0] * n, [2.0] * n, [1] * n, data.draw(st.lists(vals, min_size=n, max_size=n)),
                       data.draw(st.lists(vals, min_size=n, max_size=n)))
    S = data.draw(st.integers(1, n))
    recompute = data.draw(st.sets(st.integers(0, n - 1), max_size=2))
    model = CostModel(data.draw(st.integers(1, 16)), data.draw(st.sampled_from(SCHEDULES)), recompute=recompute)
    s = data.draw(st.integers(0, S - 1))
    f = model.memory_fn(costs, s, S)
    for i in range(n):
        for j in range(i + 1, n + 1):
            assert f(i, j) == model.segment_memory(costs, i, j, s, S)


# ---- per-boundary bandwidth (one link per stage boundary) --------------------------------------
@pytest.mark.parametrize("bad,match", [
    ("fast", "bandwidth must be > 0"), (True, "bandwidth must be > 0"), (-1.0, "bandwidth must be > 0"),
    (math.nan, "bandwidth must be > 0"), ((), "at least one value"), ((1.0, 0.0), "bandwidth\\[1\\] must be > 0"),
    ([2.0, math.nan], "bandwidth\\[1\\]"), (("1e9",), "bandwidth\\[0\\]"), ([[1.0]], "bandwidth\\[0\\]"),
])
def test_bandwidth_validation(bad, match):
    with pytest.raises(ValueError, match=match):
        CostModel(4, bandwidth=bad)


def test_bandwidth_forms_stay_frozen_and_hashable():
    assert CostModel(4, bandwidth=3).bandwidth == 3.0 and not CostModel(4, bandwidth=3).per_boundary
    m = CostModel(4, bandwidth=[1, 2.5, math.inf])
    assert m.bandwidth == (1.0, 2.5, math.inf) and m.per_boundary
    assert hash(m) == hash(CostModel(4, bandwidth=(1.0, 2.5, math.inf)))
    assert m == CostModel(4, bandwidth=(1, 2.5, math.inf))
    c = LayerCosts.uniform(4, activation=1.0)
    with pytest.raises(ValueError, match="3 per-boundary values but a pipeline of 2 stages has 1"):
        m.stage_times(c, Partition((0, 2, 4)))
    with pytest.raises(ValueError, match="pass the receiving stage"):
        m.segment_time(c, 1, 2)
    with pytest.raises(ValueError, match="receives on none"):
        m.recv_time(c, 1, 4)
    assert m.recv_time(c, 1, 0) == 0.0  # the first stage receives on no link


def test_per_boundary_receive_cost_is_charged_to_the_receiving_stage():
    c = LayerCosts([1.0] * 4, [2.0] * 4, [1] * 4, [0.0] * 4, [1.0, 2.0, 4.0, 8.0])
    part = Partition((0, 1, 2, 4))
    m = CostModel(4, bandwidth=(2.0, 8.0))
    # stage 1 receives layer 0's 1 B over the 2 B/s link, stage 2 layer 1's 2 B over the 8 B/s one
    assert m.stage_times(c, part) == [3.0, 3.0 + 2 * 1.0 / 2.0, 6.0 + 2 * 2.0 / 8.0]
    assert CostModel(4, bandwidth=(math.inf, 8.0)).stage_times(c, part)[1] == 3.0  # inf: a free boundary
    assert m.segment_time(c, 1, 2, 1) == 4.0 and m.recv_time(c, 2, 2) == 0.5 and m.recv_time(c, 0, 0) == 0.0


@given(st.data())
def test_uniform_per_boundary_sequence_is_exactly_the_float(data):
    n = data.draw(st.integers(1, 12))
    vals = st.floats(0, 1e6, allow_nan=False, allow_infinity=False)
    costs = LayerCosts(*(data.draw(st.lists(vals, min_size=n, max_size=n)) for _ in range(2)), [1] * n,
                       [0.0] * n, data.draw(st.lists(vals, min_size=n, max_size=n)))
    S = data.draw(st.integers(1, n))
    cuts = sorted(data.draw(st.sets(st.integers(1, n - 1), min_size=S - 1, max_size=S - 1))) if n > 1 else []
    part = Partition((0, *cuts, n))
    bw = data.draw(st.floats(1e-3, 1e12))
    one = CostModel(data.draw(st.integers(1, 16)), bandwidth=bw)
    per = CostModel(one.microbatches, bandwidth=(bw,) * (S - 1) if S > 1 else None)
    assert per.stage_times(costs, part) == one.stage_times(costs, part)
    assert per.predicted_step_time(costs, part) == one.predicted_step_time(costs, part)


@given(st.data())
def test_each_stage_pays_its_own_boundary(data):
    n = data.draw(st.integers(2, 10))
    S = data.draw(st.integers(2, n))
    act = data.draw(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=n, max_size=n))
    costs = LayerCosts([1.0] * n, [2.0] * n, [1] * n, [0.0] * n, act)
    cuts = sorted(data.draw(st.sets(st.integers(1, n - 1), min_size=S - 1, max_size=S - 1)))
    part = Partition((0, *cuts, n))
    bw = tuple(data.draw(st.lists(st.floats(1e-3, 1e9), min_size=S - 1, max_size=S - 1)))
    times = CostModel(4, bandwidth=bw).stage_times(costs, part)
    b = part.boundaries
    assert times[0] == costs.time_sum(0, b[1])
    for s in range(1, S):
        assert times[s] == costs.time_sum(b[s], b[s + 1]) + 2.0 * act[b[s] - 1] / bw[s - 1]
