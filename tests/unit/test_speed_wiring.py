"""The strategy's rank-speed wiring, each rank's part played by its own ``Rebalancer`` on the reports
a real gather would carry: profiled times become work at the speed of the rank that timed them,
the profile's own estimate (not one profile's noise) sets the speeds decisions balance for, the cost
model gets them, and between profiles busy times against the work each rank holds feed the watch."""
import math
import random

import pytest

from lightning_dynmo.plan.controller import REFERENCE_PROFILE
from lightning_dynmo.plan.layout import PipelineLayout
from lightning_dynmo.plan.partition import Partition
from lightning_dynmo.plan.decision import Decision
from lightning_dynmo.plan.schedules import get_schedule
from lightning_dynmo.plan.speed import describe_slowest
from lightning_dynmo.plan.topology import Topology
from lightning_dynmo.strategy.options import PipelineOptions
from lightning_dynmo.strategy.rebalancer import Rebalancer
from lightning_dynmo.strategy.recorder import dynmo_summary_text
from lightning_dynmo.strategy.requests import agree_on_actions

L = 8
WORK = [(1.0 + 0.125 * i, 2.0 + 0.25 * i) for i in range(L)]  # (forward, backward) at speed 1.0


class Job:
    """``pp`` x ``dp`` ranks, each with its own Rebalancer, as in a real run."""

    def __init__(self, pp=2, dp=1, boundaries=(0, 4, 8), **opts):
        opts.setdefault("rank_speeds", True)
        options = PipelineOptions(pipeline_parallel=pp, rebalance="auto", balancer="partition_time", **opts)
        self.topo = Topology(pp * dp, pp)
        self.ranks = [Rebalancer(options) for _ in range(pp * dp)]
        self.move(Partition(tuple(boundaries)))
        self.step = 0

    def move(self, partition):
        self.layouts = [PipelineLayout(self.topo, get_schedule("1f1b"), 1, g, partition)
                        for g in range(self.topo.world_size)]

    def close_profile(self, speed, untimed=(), event=False, noise=0.0, rnd=None, busy_speed=None):
        """A step at the true speeds (``busy_speed``: at those), then every rank times its
        layers (but ``untimed``) at its true ``speed[global rank]`` and reports them as
        ``gather_layer_costs`` does; returns the merged costs (checked equal on every rank)."""
        self.run_steps(1, busy_speed or speed)
        reports = []
        for g, (rb, lay) in enumerate(zip(self.ranks, self.layouts)):
            local = lay.local_layer_indices()
            rep = {i: (*rb.known_work.get(i, (math.nan, math.nan)), 1, 0.0) for i in local}
            fresh = {}
            for i in local:
                if i not in untimed:
                    k = (1 + rnd.uniform(-noise, noise)) if noise else 1.0
                    fresh[i] = (WORK[i][0] / speed[g] * k, WORK[i][1] / speed[g] * k)
            reports.append((rep, fresh))
        out = [rb.work_of_reports(reports, lay, L, None, event, g)
               for g, (rb, lay) in enumerate(zip(self.ranks, self.layouts))]
        assert all(c == out[0] for c in out)
        for rb in self.ranks:
            rb.controller.profiled(self.step, out[0])
        return out[0]

    def run_steps(self, n, speed, jitter=0.0, rnd=None):
        """``n`` unprofiled steps: each pipeline rank busy for its work over its slowest replica's
        true speed (what the step's all-reduce hands every rank)."""
        for _ in range(n):
            work = self.ranks[0].rank_work(self.layouts[0], [None] * L)
            if work is None:  # before any profile: no work to measure speeds against
                return
            pp = self.topo.pp
            slowest = [min(speed[d * pp + r] for d in range(self.topo.dp)) for r in range(pp)]
            busy = [4 * w / v * (1 + (rnd.uniform(-jitter, jitter) if jitter else 0.0)) for w, v in zip(work, slowest)]
            for rb, lay in zip(self.ranks, self.layouts):
                loads = [None] * L
                rb.controller.after_step(self.step, False, busy, busy, loads, rank_work=rb.rank_work(lay, loads))
            self.step += 1

    @property
    def speeds(self):
        out = {rb.controller.rank_speed for rb in self.ranks}
        assert len(out) == 1, out
        return out.pop()


def alike(speeds):
    return speeds is None or all(v == 1.0 for v in speeds)


def times_of(costs):
    return list(zip(costs.forward, costs.backward))


def test_a_straggler_is_seen_at_its_first_profile_and_its_layers_keep_their_work():
    job = Job()
    assert times_of(job.close_profile([1.0, 1.0])) == WORK  # ranks alike: the times are the work
    assert alike(job.speeds) and job.ranks[0].cost_model(job.layouts[0], 4).speed is None
    # rank 1 at half speed; the profile's own estimate against the last work sees it at once
    costs = job.close_profile([1.0, 0.5])
    assert job.speeds == (1.0, 0.5)
    assert times_of(costs) == pytest.approx(WORK, rel=1e-12)  # its times halved: its layers' own work
    assert job.ranks[1].cost_model(job.layouts[1], 4).speed == (1.0, 0.5)
    # the balancer gives the slow rank less work
    from lightning_dynmo.plan.balancers import BalanceProblem, get_balancer
    model = job.ranks[0].cost_model(job.layouts[0], 4)
    new = get_balancer("partition_time")(BalanceProblem(costs, 2, model, job.layouts[0].partition)).partition
    assert new.sizes[1] < 4
    # layers 4 and 5 migrate to rank 0 and are timed there: their work, not the slow rank's seconds
    job.move(Partition((0, 6, 8)))
    costs = job.close_profile([1.0, 0.5])
    assert job.speeds == (1.0, 0.5) and times_of(costs) == pytest.approx(WORK, rel=1e-12)
    # rank 1 recovers; layer 7 is not timed this time (a layer that did not run): it keeps the work
    # it was timed at (x 0.5 then), not the seconds the slow rank measured
    costs = job.close_profile([1.0, 1.0], untimed={7})
    assert job.speeds == (1.0, 1.0) and job.ranks[0].cost_model(job.layouts[0], 4).speed is None
    assert times_of(costs) == pytest.approx(WORK, rel=1e-12)


def test_without_rank_speeds_every_rank_counts_as_alike_and_times_are_taken_as_measured():
    job = Job(rank_speeds=False)
    job.close_profile([1.0, 1.0])
    costs = job.close_profile([1.0, 0.5])
    assert alike(job.speeds) and job.ranks[0].cost_model(job.layouts[0], 4).speed is None
    slow = job.layouts[1].local_layer_indices()
    assert all(costs.forward[i] == pytest.approx(2 * WORK[i][0]) for i in slow)  # the slow rank's time, as work


def test_ranks_alike_within_the_tolerance_keep_the_cost_model_and_the_times_exactly():
    rnd = random.Random(0)
    job = Job()
    first = job.close_profile([1.0, 1.0], noise=0.1, rnd=rnd)
    for _ in range(20):
        costs = job.close_profile([1.0, 1.0], noise=0.1, rnd=rnd)
        assert alike(job.speeds) and job.ranks[0].cost_model(job.layouts[0], 4).speed is None
    assert costs != first  # fresh noisy times each profile, taken as they are (x 1.0)
    # a rank 15 % slower is within the watch's tolerance (1.3): balanced as alike, nothing converted
    costs = job.close_profile([1.0, 0.87])
    assert alike(job.speeds)
    assert costs.forward[4:] == tuple(WORK[i][0] / 0.87 for i in range(4, 8))


def test_a_profile_whose_slowdown_the_busy_times_do_not_show_is_noise():
    """One profile's times say rank 1 is at half speed, the step before it says the ranks are
    alike (a rank holding one small layer measures one noisy ratio): nothing is taken."""
    job = Job()
    job.close_profile([1.0, 1.0])
    job.run_steps(5, [1.0, 1.0])
    costs = job.close_profile([1.0, 0.5], busy_speed=[1.0, 1.0])
    assert alike(job.speeds) and costs.forward[4] == WORK[4][0] / 0.5
    job.close_profile([1.0, 0.5], busy_speed=[0.5, 1.0])  # the busy times say rank 0: not confirmed
    assert alike(job.speeds)
    # those times became work as they were, but speeds are still measured against the work before
    job.close_profile([1.0, 0.5], busy_speed=[1.0, 0.6])  # the busy times agree now
    assert job.speeds == (1.0, 0.5)


def test_after_a_dynamism_event_the_speeds_from_before_it_stand():
    job = Job()
    job.close_profile([1.0, 1.0])
    job.run_steps(5, [1.0, 1.0])
    costs = job.close_profile([1.0, 0.5], event=True)  # the layers changed: their times say nothing of the ranks
    assert alike(job.speeds) and costs.forward[4] == WORK[4][0] / 0.5
    job2 = Job()
    job2.close_profile([1.0, 1.0])
    job2.close_profile([1.0, 0.5])
    costs = job2.close_profile([1.0, 0.25], event=True)
    assert job2.speeds == (1.0, 0.5) and costs.forward[4] == pytest.approx(WORK[4][0] * 2)


def test_a_pipeline_rank_runs_at_its_slowest_replica():
    job = Job(pp=2, dp=2)  # global rank = replica * 2 + pipeline rank
    job.close_profile([1.0] * 4)
    costs = job.close_profile([1.0, 1.0, 1.0, 0.5])  # replica 1's pipeline rank 1 is slow
    assert job.speeds == (1.0, 0.5)
    # merged: each layer's slowest replica, x that replica's speed: the work
    assert times_of(costs) == pytest.approx(WORK, rel=1e-12)


def test_busy_times_feed_the_watch_against_the_work_each_rank_holds():
    rnd = random.Random(1)
    job = Job()
    job.close_profile([1.0, 1.0])
    job.run_steps(200, [1.0, 1.0], jitter=0.1, rnd=rnd)  # equal ranks, +-10 %: the watch never fires
    watch = job.ranks[0].controller.policy.speed_watch
    assert watch.reason() is None and job.speeds == (1.0, 1.0)
    for k in range(1, 10):  # rank 1 drops to 0.4x: confirmed within a few steps
        job.run_steps(1, [1.0, 0.4])
        if watch.reason() is not None:
            break
    assert k <= 4 and "pipeline rank 1 runs at 0.40x" in watch.reason()
    assert job.speeds == pytest.approx((1.0, 0.4))  # what a decision now balances for
    # the work each rank holds is cached per partition and follows a migration
    job.move(Partition((0, 6, 8)))
    assert job.ranks[0].rank_work(job.layouts[0], [None] * L) == pytest.approx(
        [sum(f + b for f, b in WORK[:6]), sum(f + b for f, b in WORK[6:])])


def test_a_repack_keeps_the_speeds_of_the_ranks_that_stay():
    job = Job(pp=3, boundaries=(0, 3, 6, 8))
    job.close_profile([1.0, 1.0, 1.0])
    job.close_profile([1.0, 0.5, 1.0])
    c = job.ranks[0].controller
    c.repacked(5, 2)
    assert c.rank_speed == (1.0, 0.5)


def test_the_record_and_the_fit_summary_name_the_slow_rank():
    assert describe_slowest((1.0, 0.52)) == "pipeline rank 1 at 0.52x"
    assert describe_slowest((0.5, 1.0, 0.25, 1.0)) == "pipeline rank 2 at 0.25x"
    assert describe_slowest((1.0, 1.0)) is None and describe_slowest(None) is None
    d = Decision(step=7, reason="auto", before="0-3|4-7", applied=True, why="", straggler="pipeline rank 1 at 0.52x")
    assert d.to_record()["straggler"] == "pipeline rank 1 at 0.52x" and Decision.from_record(d.to_record()) == d
    summary = {"overhead_s": 0.01, "train_s": 1.0, "overhead_fraction": 0.01, "migration_s": 0.0, "decisions": 1,
               "skipped": 0, "applied_decisions": [],
               "stragglers": [{"step": 7, "straggler": "pipeline rank 1 at 0.52x", "applied": True}]}
    assert dynmo_summary_text(summary).splitlines()[1] == \
        "  step 7: balanced for pipeline rank 1 at 0.52x the fastest's speed"


def test_an_event_since_the_last_profile_is_agreed_and_taken_once():
    job = Job()
    c = job.ranks[0].controller
    assert not c.take_event("auto: busy-time imbalance 0.30 > 0.10")
    c.request("freezing")
    assert c.take_event("peer request") and not c.take_event("peer request")
    assert c.take_event("event: freezing")
    assert agree_on_actions("event: x", None, None, True)[2] and not agree_on_actions("auto", None, None, False)[2]


def test_a_moderate_slowdown_waits_for_the_median_a_large_one_does_not():
    """A drift beyond the tolerance but within its square (here 0.7x) could be one profile's and
    one step's noise together: it is taken once the busy times' median shows it too."""
    job = Job()
    job.close_profile([1.0, 1.0])
    job.run_steps(5, [1.0, 1.0])
    job.close_profile([1.0, 0.7])  # one slow step before it: the median has not turned
    assert alike(job.speeds)
    job.run_steps(2, [1.0, 0.7])  # still measured against the work from before: now it has
    job.close_profile([1.0, 0.7])
    assert job.speeds == pytest.approx((1.0, 0.7))
    job2 = Job()
    job2.close_profile([1.0, 1.0])
    job2.run_steps(5, [1.0, 1.0])
    job2.run_steps(2, [1.0, 0.7])
    job2.close_profile([1.0, 0.7])  # three slow steps: the median shows it
    assert job2.speeds == pytest.approx((1.0, 0.7))


def test_speeds_are_measured_against_work_timed_at_full_speed_so_noise_does_not_build_up():
    """A slow rank's layers keep, in the reference, the work they were timed at on a rank of
    speed 1.0: every estimate is the rank's time against it. Against work derived from the last
    estimate instead, each taken estimate carried the noise of the one before it on, and here the
    recovered rank stayed 0.83x (a profile and the steps after it measured 0.3x and 0.18x in turn
    for a rank at 0.25x)."""
    job = Job()
    job.close_profile([1.0, 1.0])
    job.run_steps(5, [1.0, 1.0])
    for m, busy in [(0.25, 0.25), (0.3, 0.18), (0.18, 0.25), (0.3, 0.18), (0.18, 0.25), (0.3, 0.25)]:
        job.close_profile([1.0, m], busy_speed=[1.0, busy])  # the profile's times as if at m
        assert job.speeds[1] in (pytest.approx(0.25), pytest.approx(m)), (m, job.speeds)  # ... a real reading
        job.run_steps(4, [1.0, busy])
    job.run_steps(4, [1.0, 1.0])  # it recovers
    job.close_profile([1.0, 1.0])
    assert alike(job.speeds), job.speeds
    assert times_of(job.ranks[0].controller.profiled_costs) == pytest.approx(WORK, rel=1e-12)


@pytest.mark.parametrize("value", ["yes", 1, None, "Always"])
def test_rank_speeds_takes_a_bool_or_always_only(value):
    with pytest.raises(ValueError, match="rank_speeds must be True, False or 'always'"):
        PipelineOptions(rank_speeds=value)


def test_rank_speeds_always_is_on():
    assert PipelineOptions(rank_speeds="always").rank_speeds == "always"


@pytest.mark.parametrize("rank_speeds", [True, False])
def test_rank_speeds_profile_once_for_a_reference_even_when_nothing_else_asks(rank_speeds):
    """A balanced start never trips ``auto``'s imbalance trigger: without a profile of its own, the
    first one would come after a slowdown and take the slow rank's times for its layers' work."""
    job = Job(rank_speeds=rank_speeds)
    rb, lay = job.ranks[0], job.layouts[0]
    asked = [rb.controller.plan(step, False, reference=rb._needs_reference(step)).profile for step in range(3)]
    if not rank_speeds:
        assert asked == [None, None, None]
        return
    assert asked[0] is None and asked[1] == REFERENCE_PROFILE  # (not step 0: its times carry allocations)
    job.close_profile([1.0, 1.0])
    assert not any(r._needs_reference(5) for r in job.ranks)
    assert rb.controller.plan(5, False, reference=rb._needs_reference(5)).profile is None
    assert rb.rank_work(lay, [None] * L) is not None  # busy times now have work to be measured against


@pytest.mark.parametrize("device, ranks, threads, cores, off", [
    ("cpu", 4, 1, 2, True),  # CI's 4-rank jobs on 2 cores: phantom stragglers
    ("cpu", 2, 2, 2, True),
    ("cpu", 2, 1, 2, False),  # each rank its own core (the straggler benchmark)
    ("cpu", 8, 2, 16, False),
    ("cuda", 8, 4, 2, False),  # a device per rank: the host's cores do not set its speed
])
def test_rank_speeds_are_turned_off_where_ranks_share_cores(device, ranks, threads, cores, off):
    import torch

    from lightning_dynmo.strategy.setup_checks import shared_cores_message

    message = shared_cores_message(torch.device(device), ranks, threads=threads, cores=cores)
    assert (message is not None) == off
    if off:
        assert f"{ranks} ranks x {threads} thread(s) share {cores} CPU core(s)" in message
        assert "rank_speeds='always'" in message
