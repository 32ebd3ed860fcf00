"""The re-packing decision as a pure function (no processes)."""
from __future__ import annotations

import pytest

from lightning_dynmo import CostModel, LayerCosts, Partition
from lightning_dynmo.plan.repack import RepackPlan, RepackRefused, plan_repack, rescale


def head_bound_costs() -> LayerCosts:
    # embedding, two real blocks, five blocks whose tokens all exited, final norm, a heavy LM head
    fwd = [0.01, 1.0, 1.0, 0.01, 0.01, 0.01, 0.01, 0.01, 0.01, 3.0]
    return LayerCosts(tuple(fwd), tuple(2 * f for f in fwd), (1,) * 10, (100.0,) * 10, (10.0,) * 10)


def plan(costs, target, ranks_now=4, m_now=8, tolerance=0.05, capacity=None, choose=None, current=None):
    model = CostModel(microbatches=m_now, schedule="1f1b", capacity=capacity)
    current = current or Partition((0, 1, 2, 9, 10))  # the balanced partition of the head-bound case
    return plan_repack(costs, current, model, ranks_now, target, "partition_time",
                       choose or (lambda r: m_now), 1, tolerance)


def test_auto_packs_when_one_layer_bounds_the_step():
    p = plan(head_bound_costs(), "auto")
    assert isinstance(p, RepackPlan)
    assert p.ranks == 2 and p.partition == Partition((0, 9, 10))  # everything but the head | head


def test_auto_refuses_when_packing_would_slow_down():
    even = LayerCosts.uniform(10)
    with pytest.raises(RepackRefused, match="predicted step"):
        plan(even, "auto", current=Partition.from_sizes([3, 3, 2, 2]))


def test_target_not_below_current_is_refused():
    with pytest.raises(RepackRefused, match="not below the current 4"):
        plan(head_bound_costs(), 4)


def test_memory_capacity_refusal_names_the_capacity():
    with pytest.raises(RepackRefused, match="capacity"):
        plan(head_bound_costs(), 1, capacity=500.0)


def test_schedule_that_cannot_run_is_refused():
    def choose(r):
        raise ValueError("needs microbatches to be a multiple of pipeline_parallel")

    with pytest.raises(RepackRefused, match="cannot run"):
        plan(head_bound_costs(), 2, choose=choose)


def test_micro_batch_retune_rescales_costs():
    c = head_bound_costs()
    assert rescale(c, 2.0).forward == tuple(2 * f for f in c.forward)
    p = plan(c, 2, m_now=16, choose=lambda r: 8)
    assert p.microbatches == 8
    same_m = plan(c, 2, m_now=8, choose=lambda r: 8)
    assert p.predicted_step == pytest.approx(2 * same_m.predicted_step, rel=1e-9)


def test_per_boundary_bandwidth_is_re_derived_for_each_rank_count():
    costs, current = head_bound_costs(), Partition((0, 1, 2, 9, 10))
    model = CostModel(microbatches=8, schedule="1f1b", bandwidth=(1e3, 1e3, 10.0))
    with pytest.raises(ValueError, match="needs bandwidth"):
        plan_repack(costs, current, model, 4, 2, "partition_time", lambda r: 8, 1, 0.05)
    seen = []

    def bandwidth(r):
        seen.append(r)
        return (1e3,) * (r - 1) or None

    p = plan_repack(costs, current, model, 4, 2, "partition_time", lambda r: 8, 1, 0.05, bandwidth)
    assert seen == [2] and p.ranks == 2 and p.partition.num_stages == 2
