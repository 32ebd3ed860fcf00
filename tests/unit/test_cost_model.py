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
    p = LayerCosts.from_params([10, 20], seconds_per_param=0.5, activation=4.0)
    assert p.forward == (5.0, 10.0) and p.backward == (10.0, 20.0)
    assert p.memory == (160.0, 320.0) and p.activation == (4.0, 4.0)
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
