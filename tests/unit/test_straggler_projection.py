"""The straggler projection (lightning_dynmo/sim/scenarios/straggler.py) on a small GPT: with no
slow rank there is nothing to gain, the oracle bounds dynmo, a slower straggler never lowers the
oracle's gain, and the reaction and migrations are charged."""
from __future__ import annotations

import pytest

from lightning_dynmo.sim.scenarios import dense, load_profile
from lightning_dynmo.sim.scenarios.straggler import (EVEN, Phase, mixed_trace, project, slow_rank_trace,
                                                     speed_split)
from lightning_dynmo.sim.simulate import Link, matching_cost_model, simulate

STAGES = 6
LINK = Link(latency=1e-5, bandwidth=4.5e10)


@pytest.fixture(scope="module")
def snap():
    return dense(12, load_profile(), granularity="sublayer", head_chunks=4)[0]


def test_with_no_slow_rank_dynmo_is_the_even_split(snap):
    r = project(snap, [Phase(1000, (1.0,) * STAGES)], link=LINK)
    assert r.migrations == 0 and r.migration_seconds == 0.0
    assert r.seconds["dynmo"] == r.seconds[EVEN] == r.seconds["oracle"]
    assert r.speedup_vs_even == 1.0 and r.fraction_of_oracle == 1.0
    assert r.speedup_vs_best_static <= 1.0 + 1e-12  # the even split is among the static candidates


@pytest.mark.parametrize("trace", [slow_rank_trace(STAGES, 2, 0.5), slow_rank_trace(STAGES, 0, 0.3, 0.2, 0.9),
                                   mixed_trace(STAGES, 0.6, gpus_per_node=2)], ids=["mid", "first", "mixed"])
def test_the_oracle_bounds_dynmo_and_dynmo_beats_the_even_split(snap, trace):
    r = project(snap, trace, link=LINK)
    assert r.seconds["oracle"] <= r.seconds["dynmo"]
    assert r.seconds["oracle"] <= min(r.seconds[n] for n in r.static) + 1e-9
    assert 0.99 < r.fraction_of_oracle <= 1.0
    assert r.speedup_vs_even > 1.05
    changes = sum(1 for a, b in zip(trace, trace[1:]) if a.speeds != b.speeds) + (trace[0].speeds != (1.0,) * STAGES)
    assert r.migrations == changes  # one re-split per change of speeds (long phases: always worth it)
    assert 0.0 < r.bubble["dynmo"] < r.bubble[EVEN] < 1.0


def test_a_slower_straggler_never_lowers_the_oracles_gain(snap):
    gains = [project(snap, slow_rank_trace(STAGES, 3, v), link=LINK).speedup(EVEN, "oracle")
             for v in (0.9, 0.7, 0.5, 0.3, 0.2)]
    assert all(b >= a - 1e-12 for a, b in zip(gains, gains[1:])), gains
    assert gains[-1] > 1.3


def test_the_reaction_and_the_migration_are_charged(snap):
    trace = slow_rank_trace(STAGES, 2, 0.5, iterations=1000)
    quick, late = (project(snap, trace, link=LINK, react_steps=k) for k in (0, 50))
    m = 4 * STAGES
    model = matching_cost_model("1f1b", m, LINK)
    slow = trace[1].speeds
    even, split = (speed_split(snap.costs, model, v, "1f1b") for v in ((1.0,) * STAGES, slow))

    def step(part, speeds):
        return simulate(snap.costs, part, "1f1b", m, link=LINK, rank_slowdown=[1 / v for v in speeds]).step_time

    # 50 steps on the old split at the slowdown, and 50 more on the slow split once the rank recovered
    extra = step(even, slow) - step(split, slow) + step(split, (1.0,) * STAGES) - step(even, (1.0,) * STAGES)
    assert extra > 0
    assert late.seconds["dynmo"] == pytest.approx(quick.seconds["dynmo"] + 50 * extra, rel=1e-9)
    assert quick.migration_seconds > 0
    assert quick.seconds["dynmo"] == pytest.approx(quick.seconds["oracle"] + quick.migration_seconds, rel=1e-9)


def test_a_migration_worth_less_than_it_costs_is_refused(snap):
    slow = Link(latency=1e-5, bandwidth=1e3)  # moving any layer takes ages
    r = project(snap, slow_rank_trace(STAGES, 2, 0.9, iterations=20), link=LINK, migration_link=slow, horizon=1)
    assert r.migrations == 0 and r.seconds["dynmo"] == r.seconds[EVEN]


def test_bad_traces_say_what_is_wrong(snap):
    with pytest.raises(ValueError, match="one speed per pipeline rank"):
        project(snap, [Phase(10, (1.0,) * STAGES), Phase(10, (1.0,) * (STAGES - 1))])
    with pytest.raises(ValueError, match="finite factors > 0"):
        Phase(10, (1.0, 0.0))
    with pytest.raises(ValueError, match="outside"):
        slow_rank_trace(STAGES, STAGES)
