"""Rank speed: the estimates from profiled layers and from busy time, the replica reduction, the
mapping onto stages, and the cost model's work / speed."""
import math
import random

import pytest
from hypothesis import given, settings, strategies as st

from lightning_dynmo.plan.balancers import BalanceProblem, get_balancer
from lightning_dynmo.plan.cost_model import CostModel, LayerCosts
from lightning_dynmo.plan.layout import PipelineLayout
from lightning_dynmo.plan.partition import Partition
from lightning_dynmo.plan.repack import plan_repack
from lightning_dynmo.plan.schedules import get_schedule
from lightning_dynmo.plan.speed import (
    estimate_speeds,
    normalise_speeds,
    rank_work,
    slowest_replicas,
    speeds_from_busy,
    weighted_median,
    work_costs,
)
from lightning_dynmo.plan.topology import Topology


def measure(work, partition, true_speed, noise=0.0, rnd=None):
    """Per rank {layer: seconds}: each layer's work on its stage's rank at that rank's speed."""
    out = [{} for _ in range(partition.num_stages)]
    for s in range(partition.num_stages):
        for i in partition.layers_of(s):
            jitter = 1.0 + (rnd.uniform(-noise, noise) if noise else 0.0)
            out[s][i] = work[i] / true_speed[s] * jitter
    return out


# ---- the cost model ------------------------------------------------------------------------------
def test_cost_model_divides_compute_not_transfer_by_speed():
    c = LayerCosts([1.0, 2.0, 3.0, 4.0], [2.0, 4.0, 6.0, 8.0], [1] * 4, [0.0] * 4, [1.0] * 4)
    part = Partition((0, 2, 4))
    plain, slow = CostModel(4, bandwidth=2.0), CostModel(4, bandwidth=2.0, speed=(1.0, 0.5))
    assert plain.stage_times(c, part) == [9.0, 21.0 + 1.0]
    assert slow.stage_times(c, part) == [9.0, 42.0 + 1.0]  # the link's 1 s does not scale
    assert slow.predicted_step_time(c, part) == 9.0 + 43.0 + 3 * 43.0
    assert slow.ideal_step_time(c, 2) == 5 * 30.0 / 1.5 and plain.ideal_step_time(c, 2) == 5 * 30.0 / 2
    assert slow.segment_work(c, 2, 4) == 21.0 and slow.stage_speed(1) == 0.5 and plain.stage_speed(None) == 1.0
    with pytest.raises(ValueError, match="speed has 2 factors but the pipeline has 3 stages"):
        slow.stage_times(c, Partition((0, 1, 2, 4)))
    for bad in ((1.0, 0.0), (1.0, math.inf), (1.0, math.nan), (), "fast", (True, 1.0)):
        with pytest.raises(ValueError, match="speed"):
            CostModel(4, speed=bad)


# ---- estimates -----------------------------------------------------------------------------------
def test_weighted_median():
    assert weighted_median([3.0, 1.0, 2.0], [1, 1, 1]) == 2.0
    assert weighted_median([1.0, 10.0], [1.0, 3.0]) == 10.0  # the heavy value carries it
    assert weighted_median([1.0, 10.0, 99.0], [5.0, 4.0, 0.0]) == 1.0  # zero weight: ignored
    with pytest.raises(ValueError, match="positive weight"):
        weighted_median([1.0], [0.0])


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 6), st.integers(0, 10**6), st.lists(st.floats(0.2, 1.0), min_size=6, max_size=6))
def test_estimate_recovers_true_speeds_despite_noise_and_outliers(S, seed, speeds):
    """Measured = work / speed x (1 +- 5 %), plus one layer per rank whose work tripled: the
    reference-weighted median recovers every rank's speed relative to the fastest within 12 %."""
    rnd = random.Random(seed)
    L = 5 * S
    work = [rnd.uniform(0.5, 2.0) for _ in range(L)]
    part = Partition.from_sizes([5] * S)
    true = speeds[:S]
    meas = measure(work, part, true, noise=0.05, rnd=rnd)
    for s in range(S):  # an outlier: this layer's work changed (a dynamism no event announced)
        meas[s][part.layers_of(s).start] *= 3.0
    est = estimate_speeds(meas, work)
    want = normalise_speeds(true)
    assert max(est) == 1.0
    assert all(abs(e / w - 1) <= 0.12 for e, w in zip(est, want)), (est, want)


def test_estimate_is_exact_without_noise_and_normalises():
    work = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    part = Partition((0, 2, 4, 6))
    meas = measure(work, part, (0.8, 0.4, 0.8))
    assert estimate_speeds(meas, work) == pytest.approx((1.0, 0.5, 1.0), rel=1e-12)
    assert estimate_speeds(meas, work, to="mean") == pytest.approx((1.2, 0.6, 1.2), rel=1e-12)
    # the reference's scale does not matter; only its ratios between layers do
    assert estimate_speeds(meas, [3 * w for w in work]) == pytest.approx((1.0, 0.5, 1.0), rel=1e-12)


def test_estimate_skips_untimed_layers_and_keeps_previous_for_ranks_without_evidence():
    work = [1.0, 1.0, 1.0, 0.0]
    meas = [{0: 2.0, 1: math.nan}, {2: 1.0}, {3: 5.0}]  # rank 2 timed only a layer with no reference
    assert estimate_speeds(meas, work) == (0.5, 1.0, 1.0)
    assert estimate_speeds(meas, work, previous=(1.0, 1.0, 0.7)) == (0.5, 1.0, 0.7)
    assert estimate_speeds([{}, {}], [1.0]) == (1.0, 1.0)
    with pytest.raises(ValueError, match="names layer 7"):
        estimate_speeds([{7: 1.0}], work)
    with pytest.raises(ValueError, match="previous has 1 speeds for 3 ranks"):
        estimate_speeds(meas, work, previous=(1.0,))


def test_param_reference_and_replicas():
    """From parameter counts (alike layers), and a layer timed by two replicas of one stage."""
    params = [100, 100, 100, 100]
    ref = LayerCosts.from_params(params).time
    meas = [{0: 1.0, 1: 1.0}, {2: 1.0, 3: 1.0}, {0: 2.5, 1: 2.5}, {2: 1.0, 3: 1.0}]  # global ranks, pp = 2
    per_global = estimate_speeds(meas, ref)
    assert per_global == pytest.approx((1.0, 1.0, 0.4, 1.0))
    assert slowest_replicas(per_global, Topology(4, 2)) == pytest.approx((0.4, 1.0))


def test_speeds_from_busy_and_rank_work_agree_with_the_profile():
    """At a profile, work = time x speed: the busy-time estimate then gives the same speeds."""
    rnd = random.Random(2)
    L = 12
    times = LayerCosts([rnd.uniform(0.5, 1) for _ in range(L)], [rnd.uniform(1, 2) for _ in range(L)], [1] * L,
                       [0.0] * L, [0.0] * L)
    part = Partition((0, 3, 7, 12))
    speeds = (1.0, 0.5, 0.8)
    work = work_costs(times, part, speeds)
    model = CostModel(4)
    busy = [4 * times.time_sum(r.start, r.stop) for r in part]  # what each rank was busy for (m = 4)
    got = speeds_from_busy(busy, rank_work(work, model, part, [0, 1, 2], 3))
    assert got == pytest.approx(speeds, rel=1e-12)
    # the balancer on work with the speeds predicts exactly the measured stage times
    assert CostModel(4, speed=speeds).stage_times(work, part) == pytest.approx([b / 4 for b in busy], rel=1e-12)
    assert work_costs(times, part, None) is times and work_costs(times, part, (1.0,) * 3) is times
    # a rank with no busy time or no work says nothing
    assert speeds_from_busy([0.0, 2.0, 1.0], [1.0, 1.0, 1.0]) == (1.0, 0.5, 1.0)
    assert speeds_from_busy([1.0, 2.0], [0.0, 0.0]) == (1.0, 1.0)


def test_rank_work_sums_the_virtual_stages_of_a_rank():
    c = LayerCosts.uniform(8, forward=1.0, backward=1.0)
    part = Partition((0, 1, 3, 6, 8))
    assert rank_work(c, CostModel(4), part, [0, 1, 0, 1], 2) == [8.0, 8.0]
    assert rank_work(c, CostModel(4).with_recompute({0}), part, [0, 1, 0, 1], 2) == [9.0, 8.0]
    with pytest.raises(ValueError, match="rank_of_stage names 2 stages"):
        rank_work(c, CostModel(4), part, [0, 1], 2)


def test_slowest_replica_per_pipeline_rank():
    topo = Topology(6, 3)  # 2 replicas of 3 pipeline ranks; global g = replica * 3 + pp_rank
    speeds = (1.0, 0.9, 0.5, 0.6, 1.0, 1.0)
    assert slowest_replicas(speeds, topo) == (0.6, 0.9, 0.5)
    assert slowest_replicas(speeds, topo, active=2) == (0.6, 0.9)
    with pytest.raises(ValueError, match="world of 6"):
        slowest_replicas(speeds[:4], topo)


def test_layout_maps_rank_speeds_to_virtual_stages():
    layout = PipelineLayout(Topology(2, 2), get_schedule("interleaved_1f1b"), 2, 0)
    assert layout.stage_speed((1.0, 0.5)) == (1.0, 0.5, 1.0, 0.5)
    assert layout.stage_speed((1.0, 1.0)) is None and layout.stage_speed(None) is None
    assert layout.stage_speed((0.5, 1.0), pp=1) == (0.5, 0.5)
    vee = PipelineLayout(Topology(2, 2), get_schedule("zbv"), 2, 0)
    assert vee.stage_speed((1.0, 0.5)) == (1.0, 0.5, 0.5, 1.0)  # V-shape: rank 0 holds stages 0 and 3
    with pytest.raises(ValueError, match="1 speeds for 2"):
        layout.stage_speed((1.0,))


def test_repack_needs_and_uses_the_speeds_of_the_ranks_that_stay():
    c = LayerCosts.uniform(8, forward=1.0, backward=1.0)
    model = CostModel(8, speed=(1.0, 1.0, 0.25, 1.0))
    part = Partition((0, 3, 6, 7, 8))
    with pytest.raises(ValueError, match="needs speed"):
        plan_repack(c, part, model, 4, 3, "partition_time", lambda r: 8)
    plan = plan_repack(c, part, model, 4, 3, "partition_time", lambda r: 8, speed=lambda r: (1.0, 1.0, 0.25)[:r])
    assert plan.partition.sizes[2] == 1  # the slow rank that stays gets one layer


def test_balancing_for_estimated_speeds_ends_the_oscillation():
    """The straggler's story: times measured on a half-speed rank, taken as the layers' own cost,
    make those layers look expensive wherever they would go, and the balancer stops at a cut whose
    true bottleneck is 18 s; with speeds it gives the slow rank less work (15 s), and the next
    profile (measured after the move) asks for no further move."""
    L, S = 12, 3
    work = LayerCosts.uniform(L, forward=1.0, backward=2.0)
    true = (1.0, 0.5, 1.0)
    truth = CostModel(8, speed=true)
    for use_speeds, sizes, bottleneck in ((False, (4, 3, 5), 18.0), (True, (5, 2, 5), 15.0)):
        part = Partition.from_sizes([4, 4, 4])
        for _ in range(3):
            meas = measure(work.time, part, true)
            times = LayerCosts([meas[part.stage_of(i)][i] / 3 for i in range(L)],
                               [2 * meas[part.stage_of(i)][i] / 3 for i in range(L)], [1] * L, [0.0] * L, [0.0] * L)
            speeds = estimate_speeds(meas, work.time) if use_speeds else None
            costs, model = work_costs(times, part, speeds), CostModel(8, speed=speeds)
            new = get_balancer("partition_time")(BalanceProblem(costs, S, model, part)).partition
            part, moved = new, part != new
        assert part.sizes == sizes and not moved
        assert max(truth.stage_times(work, part)) == bottleneck
