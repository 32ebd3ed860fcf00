"""The pure decisions of plan/: values, policy, decide, measurements, layout, schedule table."""
from __future__ import annotations

import ast
import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_dynmo.plan import (
    CostModel,
    Decision,
    LayerCosts,
    MigrationPlan,
    Partition,
    Topology,
    available_schedules,
    decide,
    get_schedule,
    merge_layer_costs,
)
from lightning_dynmo.plan.layout import PipelineLayout
from lightning_dynmo.plan.measurements import loads_near_profile, scale_by_load, smooth_load
from lightning_dynmo.plan.policy import refusal_unless_gain_clear
from lightning_dynmo.plan.schedules import choose_microbatches
from lightning_dynmo.plan.validation import positive_int
from tests.support.options import make_policy

PLAN = Path(__file__).resolve().parents[2] / "lightning_dynmo" / "plan"


def test_plan_imports_neither_torch_distributed_nor_lightning():
    for path in PLAN.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert not name.startswith(("torch", "lightning")), f"{path.name} imports {name}"


def test_importing_the_package_leaves_warning_filters_alone():
    # torch, Lightning and their dependencies install filters of their own when imported
    code = ("import torch, torch.distributed.pipelining, lightning.pytorch, torchmetrics, warnings; "
            "before = list(warnings.filters); import lightning_dynmo; "
            "assert warnings.filters == before, [f for f in warnings.filters if f not in before]")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---------------------------------------------------------------- Decision
def test_decision_is_the_jsonl_record():
    d = Decision(step=3, reason="event: x", before="[0, 2, 4)", applied=True, why="mode on_event",
                 after="[0, 1, 4)", released=(2, 3), migration_bytes=10)
    rec = d.to_record()
    assert "rounds" not in rec and rec["released"] == [2, 3]
    assert Decision.from_record(json.loads(json.dumps(rec))) == d


# ---------------------------------------------------------------- decide
def lopsided() -> LayerCosts:
    return LayerCosts((1.0, 1.0, 1.0, 5.0), (2.0, 2.0, 2.0, 10.0), (1, 1, 1, 1), (1.0,) * 4, (1.0,) * 4)


def test_decide_moves_to_the_balanced_partition_and_says_why():
    model = CostModel(microbatches=4)
    decision, new = decide(step=1, reason="r", costs=lopsided(), model=model, balancer="partition_time",
                           current=Partition((0, 2, 4)), policy=make_policy(rebalance="on_event"), migration_cost=1.0)
    assert new == Partition((0, 3, 4)) and decision.applied and decision.moved_layers == 1
    assert decision.predicted_step_after < decision.predicted_step_before
    assert decision.after == str(new) and decision.why == "mode on_event"


def test_decide_already_balanced_and_auto_refusal():
    model = CostModel(microbatches=4)
    common = dict(step=1, reason="r", costs=lopsided(), model=model, balancer="partition_time")
    d, new = decide(current=Partition((0, 3, 4)), policy=make_policy(rebalance="on_event"), migration_cost=0.0,
                    **common)
    assert new is None and not d.applied and d.why == "already balanced"
    # auto: gain (27 - 21 s per step) x horizon 2 = 12 s <= a migration of 100 s
    d, new = decide(current=Partition((0, 2, 4)), policy=make_policy(rebalance="auto", rebalance_horizon=2),
                    migration_cost=100.0,
                    **common)
    assert new is None and not d.applied and "<= cost" in d.why


def test_auto_weighs_the_gain_of_every_pipeline_run_of_an_optimizer_step():
    """With ``accumulate_grad_batches=k`` an optimizer step runs the pipeline k times: the
    horizon's gain is k times one run's (gain 6 s/run x horizon 2 = 12 s: refused at k=1 for a
    20 s migration, accepted at k=2)."""
    common = dict(step=1, reason="r", costs=lopsided(), model=CostModel(microbatches=4), balancer="partition_time",
                  current=Partition((0, 2, 4)), migration_cost=20.0)
    d, new = decide(policy=make_policy(rebalance="auto", rebalance_horizon=2), **common)
    assert new is None and "<= cost" in d.why
    d, new = decide(policy=make_policy(rebalance="auto", rebalance_horizon=2), runs_per_step=2, **common)
    assert new == Partition((0, 3, 4)) and d.applied and "> cost" in d.why
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="runs_per_step"):
            decide(policy=make_policy(rebalance="auto", rebalance_horizon=2), runs_per_step=bad, **common)


def test_decide_refuses_an_infeasible_capacity():
    model = CostModel(microbatches=4, capacity=0.5)
    d, new = decide(step=1, reason="r", costs=lopsided(), model=model, balancer="partition_time",
                    current=Partition((0, 2, 4)), policy=make_policy(rebalance="on_event"), migration_cost=0.0)
    assert new is None and d.why.startswith("refused:") and "capacity" in d.why


# ---------------------------------------------------------------- policy
def test_policy_modes():
    assert make_policy(rebalance="never").profile_reason(0) is None
    p = make_policy(rebalance="every_n", rebalance_interval=3)
    assert [p.profile_reason(s) is not None for s in range(6)] == [False, False, True, False, False, True]
    p = make_policy(rebalance="on_event")
    p.request("a"), p.request("a"), p.request("b")
    assert p.profile_reason(0) == "event: a; b" and p.profile_reason(1) is None


def test_auto_policy_threshold_and_cooldown():
    p = make_policy(rebalance="auto", imbalance_threshold=0.1, rebalance_cooldown=5)
    p.observe_busy([1.0, 1.0])
    assert p.profile_reason(10) is None  # balanced
    p.observe_busy([1.0, 3.0]), p.observe_busy([1.0, 3.0])
    assert p.profile_reason(10).startswith("auto:")
    p.applied(10)
    p.observe_busy([1.0, 3.0])
    assert p.profile_reason(12) is None  # in cooldown
    assert p.profile_reason(15) is not None


@pytest.mark.parametrize("kw", [{"rebalance": "sometimes"}, {"rebalance_interval": 0}, {"rebalance_horizon": True},
                                {"rebalance_cooldown": -1}, {"imbalance_threshold": -0.1}])
def test_policy_rejects_nonsense(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        make_policy(**kw)
    with pytest.raises(ValueError, match=next(iter(kw))):  # the policy checks itself, also built alone
        dataclasses.replace(make_policy(), **kw)
    with pytest.raises(ValueError, match="ema_decay"):
        dataclasses.replace(make_policy(), ema_decay=1.0)


# ---------------------------------------------------------------- measurements
def test_merge_takes_the_slowest_replica_and_estimates_untimed_layers():
    nan = math.nan
    replica0 = {0: (1.0, 2.0, 10, 100.0), 1: (nan, nan, 20, 50.0)}
    replica1 = {0: (1.5, 1.0, 10, 90.0), 1: (nan, nan, 20, 60.0)}
    costs = merge_layer_costs([replica0, replica1], 2, activation=[4.0, 8.0])
    assert costs.forward[0] == 1.5 and costs.backward[0] == 2.0 and costs.memory == (100.0, 60.0)
    per_param = (1.5 + 2.0) / 10  # measured seconds per parameter
    assert costs.forward[1] == pytest.approx(20 * per_param / 3)
    assert costs.backward[1] == pytest.approx(40 * per_param / 3)
    assert costs.activation == (4.0, 8.0)


def test_merge_names_layers_nobody_reported():
    with pytest.raises(ValueError, match=r"no rank reported layers \[1\]"):
        merge_layer_costs([{0: (1.0, 1.0, 1, 1.0)}], 2)


def test_scale_by_load_is_c_equals_r_t():
    costs = LayerCosts((1.0, 2.0), (2.0, 4.0), (1, 1), (0.0, 0.0), (0.0, 0.0))
    scaled = scale_by_load(costs, [0.5, None], [1.0, 0.5])
    assert scaled.forward == (0.5, 2.0) and scaled.backward == (1.0, 4.0)


# ---------------------------------------------------------------- migration plan, topology, layout
@settings(derandomize=True, max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=2, max_size=5), st.lists(st.integers(1, 4), min_size=2, max_size=5))
def test_migration_plan_moves_exactly_the_layers_whose_owner_changes(a, b):
    n = max(sum(a), sum(b))
    a[-1] += n - sum(a)
    b[-1] += n - sum(b)
    old, new = Partition.from_sizes(a), Partition.from_sizes(b)
    plan = MigrationPlan.build(old, new, lambda s: s % 3, lambda s: s % 2)
    moved = {m.layer for m in plan.moves}
    for i in range(n):
        assert (i in moved) == (old.stage_of(i) % 3 != new.stage_of(i) % 2)
    for m in plan.moves:
        assert (m.src, m.dst) == (old.stage_of(m.layer) % 3, new.stage_of(m.layer) % 2)
        assert m.adjacent == (abs(m.dst_stage - m.src_stage) <= 1)


def test_topology_layout_and_released_ranks():
    topo = Topology(world_size=8, pp=4)
    assert topo.dp == 2 and topo.pipeline_ranks(1) == [4, 5, 6, 7] and topo.replica_ranks(1) == [1, 5]
    assert topo.pipeline_ranks(1, active=2) == [4, 5] and topo.released_ranks(2) == [2, 3, 6, 7]
    with pytest.raises(ValueError, match="multiple of pipeline_parallel"):
        Topology(6, 4)
    layout = PipelineLayout(topo, get_schedule("interleaved_1f1b"), 2, global_rank=5,
                            partition=Partition.from_sizes([1] * 8))
    assert (layout.pp_rank, layout.dp_rank, layout.num_stages) == (1, 1, 8)
    assert layout.local_layer_indices() == [1, 5]
    assert layout.released_ranks == []
    packed = layout.packed(1, Partition.from_sizes([4, 4]))  # a new value: layouts are never changed in place
    assert packed.released and packed.num_stages == 2 and packed.released_ranks == [1, 2, 3, 5, 6, 7]
    assert layout.packed_pp is None and layout.with_partition(packed.partition).partition == packed.partition
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.packed_pp = 1


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_schedules_lay_stages_out_as_a_v(schedule):
    layout = PipelineLayout(Topology(2, 2), get_schedule(schedule), 2, global_rank=0,
                            partition=Partition.from_sizes([1, 1, 1, 1]))
    assert [layout.rank_of_stage(s) for s in range(4)] == [0, 1, 1, 0]
    assert layout.local_layer_indices() == [0, 3]


# ---------------------------------------------------------------- schedule table
@pytest.mark.parametrize("name", available_schedules())
def test_every_schedule_names_a_torch_class_and_a_cost_rule(name):
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

    spec = get_schedule(name)
    cls = get_schedule_class(spec.torch_class)
    assert issubclass(cls, PipelineScheduleMulti) == spec.multi
    CostModel(microbatches=4, schedule=spec.cost_schedule)  # a rule the cost model knows


def test_interleaved_cost_rule_counts_virtual_stages():
    # p=2 ranks x v=2 chunks = 4 virtual stages; chunk warm-up on rank r: (v-1)p + 2(p-1-r) + 1
    model = CostModel(microbatches=16, schedule="interleaved_1f1b", virtual_stages=2)
    assert [model.inflight(s, 4) for s in range(4)] == [3, 2, 3, 2]  # ceil(5/2), ceil(3/2) per chunk


def test_choose_microbatches():
    spec = get_schedule("1f1b")
    assert choose_microbatches(spec, 12, pp=2, virtual=1, pinned=None) == 6  # largest divisor <= 4 x 2
    assert choose_microbatches(spec, 12, pp=2, virtual=1, pinned=4) == 4
    with pytest.raises(ValueError, match="not divisible by microbatches=5"):
        choose_microbatches(spec, 12, pp=2, virtual=1, pinned=5)
    with pytest.raises(ValueError, match="multiple of 3"):
        choose_microbatches(get_schedule("interleaved_1f1b"), 2, pp=3, virtual=2, pinned=None)


def test_positive_int():
    assert positive_int("x", 3) == 3 and positive_int("x", "auto", allow=("auto",)) == "auto"
    for bad in (0, -1, True, 1.5, "3", None):
        with pytest.raises(ValueError, match="x must be a positive integer"):
            positive_int("x", bad)


def test_smooth_load_averages_per_layer_and_keeps_missing_readings_missing():
    assert smooth_load(None, [0.5, None], 0.7) == [0.5, None]
    assert smooth_load([1.0, None, 0.2], [0.0, 0.4, None], 0.75) == [0.75, 0.4, None]
    # a load alternating at random around its mean settles near the mean instead of following each draw
    s = None
    for k in range(40):
        s = smooth_load(s, [1.0 if k % 2 else 0.0], 0.7)
    assert abs(s[0] - 0.5) < 0.1
    assert smooth_load([1.0], [0.0, 0.0], 0.7) == [0.0, 0.0]  # a new layer count starts afresh


def test_loads_near_profile_is_the_band_where_scaling_is_credible():
    assert loads_near_profile([0.6, None, 1.0], [1.0, 0.5, None])  # within 2x; missing readings ignored
    assert not loads_near_profile([0.4, 1.0], [1.0, 1.0])  # one layer fell below half its profiled load
    assert not loads_near_profile([1.0], [0.4])
    assert not loads_near_profile([0.2], [0.0])  # profiled taking nothing: no scale to apply
    assert loads_near_profile([0.03], [0.0]) and loads_near_profile([0.0], [0.04])  # within the slack
    assert loads_near_profile([0.3], [1.0], factor=4.0)


def test_auto_refuses_to_return_to_a_partition_left_within_the_horizon():
    """A per-step load signal that flips (a MoD predictor taking all tokens one step and none the
    next) must not move layers back and forth: returning to a partition an applied decision left,
    before the horizon its replacement's saving was predicted over has passed, is refused and says
    why (also round a cycle through a third partition)."""
    model = CostModel(microbatches=4)
    policy = make_policy(rebalance="auto", rebalance_horizon=10)
    heavy_last = lopsided()  # balanced at (0, 3, 4)
    heavy_first = LayerCosts(tuple(reversed(heavy_last.forward)), tuple(reversed(heavy_last.backward)),
                             (1,) * 4, (1.0,) * 4, (1.0,) * 4)  # balanced at (0, 1, 4)
    a, b = Partition((0, 1, 4)), Partition((0, 3, 4))
    common = dict(reason="r", model=model, balancer="partition_time", migration_cost=0.0)
    d, new = decide(step=1, costs=heavy_last, current=a, policy=policy, **common)
    assert new == b
    policy.decided(1, applied=True, left=a)
    d, new = decide(step=5, costs=heavy_first, current=b, policy=policy, **common)
    assert new is None and not d.applied and d.after == str(a)
    assert d.why.startswith("refused: would return to the partition left at step 1, 4 of the 10 steps"), d.why
    # once the horizon has passed the same move is judged on its gain again
    d, new = decide(step=11, costs=heavy_first, current=b, policy=policy, **common)
    assert new == a and d.applied
    # a move to any other partition is no undo
    policy.decided(11, applied=True, left=b)
    d, new = decide(step=12, costs=heavy_last, current=a, policy=policy, **common)
    assert new is None and "would return" in d.why  # back to b: refused
    d, new = decide(step=12, costs=LayerCosts.uniform(4), current=b, policy=policy, **common)
    assert new == Partition((0, 2, 4)) and d.applied
    # ... but no partition left within the horizon comes back: not b (left at 11), whichever way round
    policy.decided(12, applied=True, left=b)
    d, new = decide(step=13, costs=heavy_last, current=Partition((0, 2, 4)), policy=policy, **common)
    assert new is None and "left at step 12" in d.why
    # only auto weighs moves: on_event applies what its events ask for
    on_event = make_policy(rebalance="on_event", rebalance_horizon=10)
    on_event.decided(11, applied=True, left=b)
    d, new = decide(step=12, costs=heavy_last, current=a, policy=on_event, **common)
    assert new == b


def test_a_move_from_load_counters_must_gain_clearly_over_the_recent_steps():
    """Decisions from load counters see each recent step's loads: a move that gains under some
    steps' loads and loses under others' (a flipping per-step signal) is refused however large its
    gain under the mean, and one that gains under every step's loads is taken."""
    model = CostModel(microbatches=4)
    heavy_last = lopsided()  # (0, 3, 4) is better
    heavy_first = LayerCosts(tuple(reversed(heavy_last.forward)), tuple(reversed(heavy_last.backward)),
                             (1,) * 4, (1.0,) * 4, (1.0,) * 4)  # (0, 1, 4) is better
    a, b = Partition((0, 2, 4)), Partition((0, 3, 4))
    assert refusal_unless_gain_clear(model, [heavy_last] * 3, a, b) is None  # no variation, positive gain
    assert refusal_unless_gain_clear(model, [heavy_last], a, b) is None  # too few samples to judge: not refused
    flipping = [heavy_last, heavy_first] * 4
    why = refusal_unless_gain_clear(model, flipping, a, b)
    assert why is not None and why.startswith("refused: gain") and "8 steps" in why
    common = dict(step=3, reason="r", costs=heavy_last, model=model, balancer="partition_time", current=a,
                  migration_cost=0.0)
    d, new = decide(policy=make_policy(rebalance="auto"), samples=flipping, **common)
    assert new is None and d.why == why
    d, new = decide(policy=make_policy(rebalance="auto"), samples=[heavy_last] * 8, **common)
    assert new == b
    d, new = decide(policy=make_policy(rebalance="on_event"), samples=flipping, **common)  # events are not weighed
    assert new == b
