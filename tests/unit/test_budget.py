"""Do no harm: the overhead budget, the back-off and the payback of applied decisions,
and the rebalance state machine that applies them (plan/budget.py, plan/controller.py)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_dynmo.plan import LayerCosts
from lightning_dynmo.plan.budget import OverheadBudget
from lightning_dynmo.plan.controller import RebalanceController
from tests.support.options import make_budget, make_controller, make_policy

STEP = 0.1  # seconds of an unprofiled step


def growing(step: int) -> list[float]:
    """Busy times whose imbalance keeps growing: ``auto`` keeps firing (hysteresis 0)."""
    return [1.0, 1.5 + 0.01 * step]


def drive(ctrl: RebalanceController, steps: int, *, profiled_extra=0.05, decision_s=0.01, busy=growing,
          loads=None, applied=lambda step: False, events=(), start=0, wall=lambda step, profiled: None) -> dict:
    """Run the state machine like the rebalancer does, with a simulated clock: a profiled step
    costs ``profiled_extra`` more, every decision ``decision_s``. Returns what happened per step."""
    out = {"profiled": [], "decisions": [], "counters": [], "skipped": []}
    for step in range(start, start + steps):
        if step in events:
            ctrl.request("freeze")
        reason = ctrl.profile_closed()
        if reason is not None:
            ctrl.profiled(step, LayerCosts.uniform(4))
            ctrl.charge(step, decision_s, "decision")
            ctrl.decided(step, applied(step))
            out["decisions"].append(step)
        elif ctrl.in_profile_window:
            out["profiled"].append(step)
            ctrl.after_step(step, True, busy(step), [STEP + profiled_extra] * 2, loads or [None] * 4)
            continue
        actions = ctrl.plan(step, decided=reason is not None)
        out["skipped"] += [(step, why) for _, why in actions.skipped]
        if actions.counters:
            ctrl.charge(step, decision_s, "counters")
            ctrl.decided(step, applied(step))
            out["counters"].append(step)
        profiled = actions.profile is not None
        if profiled:
            out["profiled"].append(step)
        w = wall(step, profiled)
        w = (STEP + (profiled_extra if profiled else 0.0)) if w is None else w
        ctrl.after_step(step, profiled, busy(step), [w] * 2, loads or [None] * 4)
    return out


def auto(**kw) -> RebalanceController:
    policy = make_policy(rebalance="auto", imbalance_threshold=0.1, rebalance_cooldown=kw.pop("cooldown", 1),
                         rebalance_hysteresis=0.0, rebalance_horizon=100)
    return make_controller(policy, make_budget(**kw))


def test_a_sequence_that_never_moves_stops_paying_profiling():
    """An imbalance the balancer cannot fix (it stays above the threshold, every decision is
    'already balanced'): the decisions back off exponentially and the overhead stays in budget."""
    ctrl = auto(overhead_budget=0.01, window=100, max_backoff=128)
    out = drive(ctrl, 600)
    decisions = out["decisions"]
    gaps = [b - a for a, b in zip(decisions, decisions[1:])]
    assert len(decisions) <= 14, decisions  # ~log2 of the run, then one per budget or back-off period
    assert all(b >= a for a, b in zip(gaps[:6], gaps[1:7])), gaps  # waits grow
    late = [s for s in out["profiled"] if s >= 300]
    assert len(late) <= 300 / 100 + 1, late  # bounded: at most about one profile per window
    assert ctrl.budget.overhead_fraction() <= 0.01 + 1e-9
    assert out["skipped"] and all(why.startswith("skipped:") for _, why in out["skipped"])


def test_back_off_doubles_and_is_capped():
    b = make_budget(max_backoff=16, overhead_budget=float("inf"))
    waits = []
    for _ in range(8):
        b.decided(100, applied=False)
        waits.append(b.next_allowed - 100)
    assert waits == [0, 2, 4, 8, 16, 16, 16, 16]
    assert b.refusal(105, "profile").startswith("skipped: back-off, 8 decisions in a row changed nothing")
    assert b.refusal(116, "profile") is None


def test_a_structural_event_rearms_the_back_off():
    ctrl = auto(overhead_budget=1.0, max_backoff=64)
    out = drive(ctrl, 200)
    assert ctrl.budget.noops >= 5 and ctrl.budget.next_allowed - out["decisions"][-1] >= 16  # backed off
    out = drive(ctrl, 6, start=200, events={200})  # a freeze: profiled and decided at once
    assert out["profiled"][0] == 200 and out["decisions"][0] == 201, out
    assert out["decisions"][1:2] == [203], out  # auto fires again after its plain cooldown: re-armed
    assert ctrl.budget.noops == 2  # counting from the event


def test_events_are_served_even_out_of_budget():
    ctrl = auto(overhead_budget=0.0)
    out = drive(ctrl, 40, events={10, 30})
    assert 10 in out["profiled"] and 30 in out["profiled"]
    assert [d for d in out["decisions"] if d > 5] == [11, 31]


def test_a_decision_that_paid_lifts_the_budget():
    """Same costs, same budget: when the applied decision made steps faster, the policy may spend
    its saving; when it did not pay, it may not."""
    def run(after: float) -> tuple[OverheadBudget, int]:
        b = make_budget(overhead_budget=0.01, window=100, payback_steps=5)
        for step in range(20):
            b.observe_step(step, 0.2, profiled=False)
        b.decided(20, applied=True, cost=0.05)
        assert b.allowance() == float("inf")  # benefit of the doubt until measured
        for step in range(20, 30):
            b.observe_step(step, after, profiled=False)
        b.charge(30, 0.3, "decision")
        return b, b.refusal(31, "profile")

    paid, why = run(after=0.1)
    assert paid.paybacks[-1].gain == pytest.approx(0.1) and paid.paybacks[-1].paid(100)
    assert why is None and paid.allowance() > 0.3
    unpaid, why = run(after=0.2)
    assert not unpaid.paybacks[-1].paid(100) and why is not None and "overhead budget" in why
    rec = paid.summary()["applied_decisions"][0]
    assert rec["step_ms_before"] == pytest.approx(200) and rec["step_ms_after"] == pytest.approx(100)
    assert rec["gain"] == pytest.approx(0.5) and rec["paid"] is True


def test_profiled_steps_are_charged_their_excess():
    b = make_budget()
    for step in range(5):
        b.observe_step(step, 0.1, profiled=False)
    b.observe_step(5, 0.13, profiled=True)
    assert b.totals["profiling"] == pytest.approx(0.03)
    assert b.overhead_fraction() == pytest.approx(0.03 / 0.63)
    assert b.summary()["overhead_s_by_source"]["profiling"] == pytest.approx(0.03)


@settings(max_examples=40, deadline=None)
@given(fraction=st.sampled_from([0.005, 0.01, 0.05]), extra=st.floats(0.0, 0.5), decision=st.floats(0.0, 0.05),
       cooldown=st.integers(0, 5))
def test_optional_overhead_stays_within_budget_plus_one_action(fraction, extra, decision, cooldown):
    """Whatever profiling and decisions cost, what auto starts by itself never pushes the window's
    overhead beyond the budget by more than one action (the first one, before anything is known)."""
    ctrl = auto(overhead_budget=fraction, window=50, cooldown=cooldown)
    drive(ctrl, 300, profiled_extra=extra, decision_s=decision)
    b = ctrl.budget
    one_action = extra * ctrl.policy.profile_steps + decision
    assert b.spent() <= fraction * b.window_seconds() + one_action + 1e-9


def test_counter_decisions_that_change_nothing_back_off():
    """Per-iteration decisions from load counters: a request every step, nothing moves: they back
    off too, and while backed off a request costs one comparison (no decision)."""
    ctrl = auto(overhead_budget=1.0)
    drive(ctrl, 3)  # one profile (auto) and its decision
    ctrl.profiled(2, LayerCosts.uniform(4))
    loads = [1.0, 0.5, 1.0, 0.5]
    counters = []
    for step in range(3, 200):
        ctrl.request("mod: load moved", reprofile=False)
        out = drive(ctrl, 1, start=step, loads=loads)
        counters += out["counters"]
    assert 5 <= len(counters) <= 12, counters  # ~log2 of the run
    assert not [s for s in range(3, 200) if s in counters and s > 150][1:]


def test_other_modes_and_an_infinite_budget_are_not_gated():
    for mode in ("every_n", "on_event"):
        policy = make_policy(rebalance=mode, rebalance_interval=2, rebalance_hysteresis=0.0)
        ctrl = make_controller(policy, make_budget(overhead_budget=0.0))
        out = drive(ctrl, 40, events=set(range(0, 40, 2)) if mode == "on_event" else ())
        assert len(out["decisions"]) >= 15 and not out["skipped"], (mode, out)
    out = drive(auto(overhead_budget=float("inf")), 100)
    assert len(out["decisions"]) >= 40 and not out["skipped"]  # every trigger served, as before the budget


def test_budget_rejects_nonsense():
    with pytest.raises(ValueError, match="overhead_budget"):
        make_budget(overhead_budget=-1)
    with pytest.raises(ValueError, match="window"):
        make_budget(window=0)
    with pytest.raises(ValueError, match="source"):
        make_budget().charge(0, 1.0, "coffee")


def test_a_counter_decision_on_unchanged_loads_costs_one_comparison():
    ctrl = auto(overhead_budget=1.0)
    drive(ctrl, 3)
    ctrl.profiled(2, LayerCosts.uniform(4))
    loads = [1.0, 0.5, 1.0, 0.5]
    for step in range(3, 6):
        ctrl.after_step(step, False, [1.0, 1.0], [STEP] * 2, loads)
    ctrl.request("moe: load moved", reprofile=False)
    assert ctrl.plan(6, decided=False).counters  # the first one decides
    ctrl.decided(6, applied=False, counters=True)
    ctrl.after_step(6, False, [1.0, 1.0], [STEP] * 2, [1.0, 0.505, 1.0, 0.5])
    ctrl.request("moe: load moved", reprofile=False)
    actions = ctrl.plan(7, decided=False)
    assert actions.counters is None and "within 0.01 of the last decision" in actions.skipped[0][1]
    ctrl.after_step(7, False, [1.0, 1.0], [STEP] * 2, [1.0, 0.8, 1.0, 0.5])  # now it moved
    ctrl.request("moe: load moved", reprofile=False)
    assert ctrl.plan(8, decided=False).counters


def test_the_controller_owns_requests_under_never_the_repack_target_and_the_migration_cost():
    """The parts of the state machine the rebalancer used to hold: a request under ``never`` is
    refused (the rebalancer only warns), the configured re-pack target stands in for a missing
    request, and ``auto`` weighs a move against one step's wall time until a migration was
    measured, then against that rebalance's migration (a re-pack's leaves it)."""
    never = make_controller(make_policy(rebalance="never"), repack="auto")
    assert never.request("freeze") is False and never.request("moe", reprofile=False) is False
    assert not never.rebalancing and never.policy.pending_reasons == [] and never.counter_requests == []
    assert never.repack_target(None) == "auto" and never.repack_target(2) == 2
    ctrl = auto()
    assert ctrl.request("freeze") is True and ctrl.rebalancing and ctrl.repack_target(None) == "off"
    assert ctrl.expected_migration_cost() == 0.0
    ctrl.after_step(0, False, [1.0, 1.0], [0.3, 0.2], [None] * 4)
    assert ctrl.expected_migration_cost() == 0.3
    ctrl.migrated(0.5, cost=0.52)
    ctrl.migrated(0.25)  # a re-pack: counted, not weighed
    assert ctrl.expected_migration_cost() == 0.52 and ctrl.migration_seconds == 0.75
