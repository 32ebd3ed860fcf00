"""The simulator against closed forms: fill-drain step times, interleaving and zero-bubble gains,
the heaviest stage's pace, transfer and all-reduce costs; every table schedule replays.

Dyadic costs (1, 2, 0.5, ...) keep every sum exact, so closed forms are compared with ``==``."""
import math
from types import SimpleNamespace

import pytest

from lightning_dynmo.plan.balancers import BalanceProblem, get_balancer, megatron_layout
from lightning_dynmo.plan.cost_model import CostModel, LayerCosts
from lightning_dynmo.plan.partition import Partition
from lightning_dynmo.plan.schedules import available_schedules, get_schedule
from lightning_dynmo.sim import DataParallel, Link, matching_cost_model, schedule_ops, simulate
from lightning_dynmo.sim.simulate import boundary_links
from lightning_dynmo.sim.calibrate import message_costs
from lightning_dynmo.sim.scenarios import (CASES, Profile, compare, early_exit, freezing, load_profile, moe, pruning,
                                           zhu_gupta)

F, B = 1.0, 2.0


def uniform(layers, **kw):
    return LayerCosts.uniform(layers, forward=F, backward=B, **kw)


def stages_for(schedule, pp):
    spec = get_schedule(schedule)
    return pp * spec.virtual_stages(None)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp,m", [(1, 3), (2, 2), (4, 8), (5, 16)])
def test_uniform_fill_drain(schedule, pp, m):
    costs, part = uniform(2 * pp), megatron_layout(2 * pp, pp)
    r = simulate(costs, part, schedule, m)
    assert r.step_time == (m + pp - 1) * 2 * (F + B)
    assert r.step_time == CostModel(m, schedule).predicted_step_time(costs, part)
    assert r.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1))
    assert r.busy == (m * 2 * (F + B),) * pp


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_heaviest_stage_sets_the_pace(schedule):
    # stage 2 is 3x heavier (same forward/backward ratio)
    costs = LayerCosts([1, 1, 1, 1, 3, 3, 1, 1], [2, 2, 2, 2, 6, 6, 2, 2], [1] * 8, [0] * 8, [0] * 8)
    part = megatron_layout(8, 4)
    heavy = 3 * 2 * (F + B)
    steps = [simulate(costs, part, schedule, m).step_time for m in (8, 9, 10)]
    assert steps[1] - steps[0] == steps[2] - steps[1] == heavy  # one more micro-batch costs the heaviest stage
    bound = CostModel(8, schedule).predicted_step_time(costs, part)  # sum t + (m-1) max t
    assert steps[0] == bound if schedule == "gpipe" else steps[0] <= bound
    busy = simulate(costs, part, schedule, 8).busy
    assert max(busy) == busy[2]


def test_interleaving_and_zero_bubble_shrink_the_bubble():
    pp, m = 4, 8
    flat = simulate(uniform(16), megatron_layout(16, pp), "1f1b", m)
    inter = simulate(uniform(16), megatron_layout(16, 2 * pp), "interleaved_1f1b", m)
    zb = simulate(uniform(16), megatron_layout(16, 2 * pp), "zero_bubble", m)
    work = m * 4 * (F + B)  # per rank
    assert flat.step_time == work + (pp - 1) * 4 * (F + B)  # bubble (p-1) full stages
    assert inter.step_time == work + (pp - 1) * 2 * (F + B)  # bubble (p-1) / v stages
    assert zb.bubble_fraction < inter.bubble_fraction < flat.bubble_fraction
    # DualPipeV: torch runs each overlapped F/B pair one after the other, so at equal costs its step
    # is ZBV's (what the pair would overlap, a transfer with compute, torch's runtime does not)
    zbv = simulate(uniform(16), megatron_layout(16, 2 * pp), "zbv", m)
    dual = simulate(uniform(16), megatron_layout(16, 2 * pp), "dualpipev", m)
    assert dual.step_time == zbv.step_time < inter.step_time and dual.busy == zbv.busy


def test_transfer_time_adds():
    pp, m, d = 4, 8, 0.5
    costs = uniform(8, activation=3.0)
    part = megatron_layout(8, pp)
    base = (m + pp - 1) * 2 * (F + B)
    # GPipe: every crossing is on the critical path once forward and once backward
    assert simulate(costs, part, "gpipe", m, link=Link(latency=d)).step_time == base + 2 * (pp - 1) * d
    assert simulate(costs, part, "gpipe", m, link=Link(bandwidth=6.0)).step_time == base + 2 * (pp - 1) * 0.5
    # 1F1B: the steady state waits for the round trip as well, so more is exposed
    steps = [simulate(costs, part, "1f1b", m, link=Link(latency=x)).step_time for x in (0.0, 0.25, 0.5)]
    assert steps[0] == base and steps[0] < steps[1] < steps[2]
    assert steps[2] >= base + 2 * (pp - 1) * d


def test_same_rank_crossings_are_free():
    # ZBV puts stages p-1 and p on one rank: a link cost only applies between ranks
    pp, m = 2, 4
    costs = uniform(8, activation=1.0)
    part = megatron_layout(8, 2 * pp)
    slow = simulate(costs, part, "zbv", m, link=Link(latency=0.25))
    fast = simulate(costs, part, "zbv", m)
    assert fast.step_time < slow.step_time


def test_data_parallel_allreduce():
    pp, m = 4, 8
    costs = uniform(16, params=1000)
    dp = DataParallel(replicas=4, bandwidth=1000.0, bytes_per_param=2.0, latency=0.25)
    ring = 2 * 3 / 4 * 4000 * 2.0 / 1000.0 + 2 * 3 * 0.25  # 4 layers of 1000 params per rank
    assert dp.allreduce_time(4000) == ring
    part = megatron_layout(16, pp)
    plain = simulate(costs, part, "1f1b", m)
    after = simulate(costs, part, "1f1b", m, dp=dp)
    assert after.step_time == plain.step_time + ring  # rank 0 finishes last, then all-reduces
    assert after.allreduce == (ring,) * pp
    # interleaved: overlapping each stage's all-reduce with the rank's remaining work helps
    part = megatron_layout(16, 2 * pp)
    blocking = simulate(costs, part, "interleaved_1f1b", m, dp=dp)
    overlapped = simulate(costs, part, "interleaved_1f1b", m, dp=DataParallel(4, 1000.0, 2.0, 0.25, overlap=True))
    assert overlapped.step_time < blocking.step_time
    assert simulate(costs, part, "interleaved_1f1b", m, dp=DataParallel(1, 1.0)).step_time == \
        simulate(costs, part, "interleaved_1f1b", m).step_time


def test_zero_bubble_weight_fraction():
    pp, m = 4, 8
    part = megatron_layout(16, 2 * pp)
    fractions = [simulate(uniform(16), part, "zero_bubble", m, w_fraction=w).bubble_fraction for w in (0.0, 0.5)]
    assert fractions[1] < fractions[0]  # deferred weight gradients fill the bubble
    with pytest.raises(ValueError, match="w_fraction"):
        simulate(uniform(16), part, "zero_bubble", m, w_fraction=1.5)


@pytest.mark.parametrize("schedule", available_schedules())
def test_every_schedule_replays_torch_order(schedule):
    pp, m = 4, 8
    S = stages_for(schedule, pp)
    costs = LayerCosts([1.0, 0.5] * S, [2.0, 1.0] * S, [1] * 2 * S, [0.0] * 2 * S, [1.0] * 2 * S)
    part = megatron_layout(2 * S, S)
    r = simulate(costs, part, schedule, m, link=Link(latency=0.125, bandwidth=8.0))
    ops = schedule_ops(schedule, pp, S // pp, m)
    assert sum(len(o) for o in ops) == len(r.events)
    per_stage = {}
    for e in r.events:
        per_stage.setdefault((e["stage"], e["kind"]), []).append(e)
    for s in range(S):
        fwd = {e["mb"]: e for e in per_stage[(s, "F")]}
        bwd = {e["mb"]: e for e in per_stage[(s, "B")]}
        assert sorted(fwd) == sorted(bwd) == list(range(m))
        for i in range(m):
            assert fwd[i]["end"] <= bwd[i]["start"]
            if s > 0:
                assert fwd[i]["start"] >= per_stage_end(per_stage, s - 1, "F", i)
    assert r.busy == (m * 4.5 * (S // pp),) * pp
    assert 0.0 <= r.bubble_fraction < 1.0
    assert r.step_time >= max(r.busy)


def per_stage_end(per_stage, s, kind, mb):
    return next(e["end"] for e in per_stage[(s, kind)] if e["mb"] == mb)


def test_torch_orders_are_complete():
    """Every (stage, micro-batch) runs one forward and one backward: whole (``B``) or split into
    ``I`` then ``W`` (DualPipeV does both, per micro-batch; its overlapped pairs count as their two
    sub-actions)."""
    for schedule in available_schedules():
        pp, m = 4, 8
        S = stages_for(schedule, pp)
        ops = schedule_ops(schedule, pp, S // pp, m)
        kinds: dict = {}
        for rank_ops in ops:
            for o in rank_ops:
                kinds.setdefault((o.stage, o.mb), []).append(o.kind)
        assert set(kinds) == {(s, i) for s in range(S) for i in range(m)}, schedule
        for (s, i), seq in kinds.items():
            assert seq in (["F", "B"], ["F", "I", "W"]), (schedule, s, i, seq)
    mixed = {o.kind for rank_ops in schedule_ops("dualpipev", 4, 2, 8) for o in rank_ops}
    assert mixed == {"F", "B", "I", "W"}


def peak_inflight(ops, stages: int) -> list[int]:
    """Per stage, the most micro-batches whose activations it holds at once, replaying torch's
    order: a forward keeps them, a whole backward (``B``) or the weight pass (``W``) frees them
    (``I`` keeps them for ``W``)."""
    alive, peak = [0] * stages, [0] * stages
    for rank_ops in ops:
        for o in rank_ops:
            alive[o.stage] += {"F": 1, "B": -1, "I": 0, "W": -1}[o.kind]
            peak[o.stage] = max(peak[o.stage], alive[o.stage])
    return peak


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "looped_bfs", "zbv", "dualpipev"])
def test_the_cost_models_inflight_rule_is_torchs(schedule):
    """The cost model's activations in flight per stage are what torch's own action order keeps
    alive, exactly. (Not so for the round-robin interleaved schedules: ``interleaved_1f1b``'s rule
    spreads a rank's warm-up evenly over its chunks, and ``zero_bubble``'s per-stage 1F1B rule
    counts fewer than torch's order keeps on the later ranks.)"""
    spec = get_schedule(schedule)
    v = spec.virtual_stages(None)
    for pp in (1, 2, 3, 4):
        for m in sorted({spec.min_microbatches(pp), 2 * pp, 2 * pp + 1, 4 * pp, 8 * pp}):
            try:
                spec.check_microbatches(m, pp)
            except ValueError:
                continue
            S = pp * v
            model = CostModel(m, spec.cost_schedule, virtual_stages=v)
            assert peak_inflight(schedule_ops(schedule, pp, v, m), S) == [model.inflight(s, S) for s in range(S)], \
                (schedule, pp, m)


def test_dualpipev_micro_batch_rule_is_torchs():
    """At least one micro-batch per stage (2 per rank), any count above: what torch's constructor
    accepts, and every accepted count gives a complete order."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    spec = get_schedule("dualpipev")
    cls = get_schedule_class(spec.torch_class)
    for pp in (1, 2, 3):
        for m in range(1, 4 * pp + 2):
            ours = True
            try:
                spec.check_microbatches(m, pp)
            except ValueError as e:
                ours = False
                assert "2 micro-batches per pipeline rank" in str(e)
            stages = [SimpleNamespace(num_stages=2 * pp, group_size=pp, group_rank=0, submod=None) for _ in range(2)]
            try:
                type("Probe", (cls,), {"_prepare_schedule_with_comms": lambda self, *a, **k: None})(stages, m)
                theirs = True
            except ValueError:
                theirs = False
            assert ours == theirs == (m >= 2 * pp), (pp, m)
            if ours:
                assert len([o for r in schedule_ops("dualpipev", pp, 2, m) for o in r if o.kind == "F"]) == 2 * pp * m


def test_input_validation():
    costs = uniform(8)
    with pytest.raises(ValueError, match="multiple of 2"):
        simulate(costs, megatron_layout(8, 3), "interleaved_1f1b", 6, virtual=2)
    with pytest.raises(ValueError, match="at least as many micro-batches"):
        simulate(costs, megatron_layout(8, 4), "1f1b", 2)
    with pytest.raises(ValueError, match="covers 4 layers"):
        simulate(costs, Partition((0, 2, 4)), "gpipe", 2)


def test_balancer_and_simulator_share_the_cost_model():
    """A rebalance chosen on matching_cost_model speeds up the simulated step."""
    costs = LayerCosts([1.0] * 12, [0.0] * 8 + [2.0] * 4, [1] * 12, [0.0] * 12, [1.0] * 12)  # frozen prefix
    link = Link(latency=0.0, bandwidth=16.0)
    model = matching_cost_model("1f1b", 16, link)
    assert model.bandwidth == 16.0 and model.schedule == "1f1b"
    static = get_balancer("uniform")(BalanceProblem(costs, 4, model)).partition
    dynamic = get_balancer("partition_time")(BalanceProblem(costs, 4, model)).partition
    before = simulate(costs, static, "1f1b", 16, link=link).step_time
    after = simulate(costs, dynamic, "1f1b", 16, link=link).step_time
    assert after < before


def test_events_draw_with_the_real_timeline_code(tmp_path):
    pytest.importorskip("matplotlib")
    from lightning_dynmo.plotting import save_rebalance_figure

    r = simulate(uniform(8), megatron_layout(8, 4), "1f1b", 4)
    path = save_rebalance_figure(str(tmp_path / "sim.png"), r.events, ("uniform", [6.0] * 4))
    assert (tmp_path / "sim.png").stat().st_size > 0 and path.endswith("sim.png")


# ---- per-rank links, all-reduce exclusions, per-action overhead ---------------------------------
def test_per_rank_links_and_overheads():
    pp, m = 4, 8
    costs = uniform(8, activation=1.0, params=10)
    part = megatron_layout(8, pp)
    fast, slow = Link(latency=0.0), Link(latency=0.25)
    same = simulate(costs, part, "gpipe", m, link=[fast] * pp).step_time
    assert same == simulate(costs, part, "gpipe", m, link=fast).step_time
    one_slow = simulate(costs, part, "gpipe", m, link=[fast, slow, fast, fast]).step_time
    assert one_slow == same + 2 * 0.25  # one boundary on the critical path, forward and backward
    with pytest.raises(ValueError, match="one Link per pipeline rank"):
        simulate(costs, part, "gpipe", m, link=[fast] * 3)
    # the one boundary of 2 ranks crosses link 0 (link 1 would close an interleaved ring)
    assert matching_cost_model("1f1b", m, [Link(0.0, 8.0), Link(0.0, 2.0)]).bandwidth == 8.0
    # every action pays the overhead: GPipe's step grows by (m + p - 1) x (F + B) overheads
    over = simulate(costs, part, "gpipe", m, action_overhead=0.5).step_time
    assert over == simulate(costs, part, "gpipe", m).step_time + (m + pp - 1) * 2 * 0.5
    # frozen layers can be left out of the data-parallel all-reduce
    dp = DataParallel(replicas=2, bandwidth=10.0)
    full = simulate(costs, part, "gpipe", m, dp=dp)
    none = simulate(costs, part, "gpipe", m, dp=dp, reduced_params=[0] * 8)
    assert none.allreduce == (0.0,) * pp and full.allreduce[0] == dp.allreduce_time(20)


# ---- per-message costs, frozen prefixes, slow ranks, and reading them off a timeline ---------
def test_message_overheads_cost_their_ranks():
    # 1F1B, 2 stages of F=1, B=2, m=2 (torch: rank 0 F0 F1 B0 B1, rank 1 F0 B0 F1 B1), hand-replayed
    costs, part = uniform(2), Partition((0, 1, 2))
    assert simulate(costs, part, "1f1b", 2).step_time == 9.0
    # rank 1 receives F1 (arrived at 2) when it is free at 4: only the receive's own cost shows
    assert simulate(costs, part, "1f1b", 2, link=Link(recv_overhead=0.125)).step_time == 9.125
    # each send holds its sender: rank 1 sends B0 (4 -> 4.25), then B1 ends at 7.25 and B0 of
    # stage 0 runs 7.25 -> 9.25
    assert simulate(costs, part, "1f1b", 2, link=Link(send_overhead=0.25)).step_time == 9.25
    with pytest.raises(ValueError, match="recv_overhead"):
        Link(recv_overhead=-1.0)


def test_frozen_prefix_carries_no_gradient():
    # layer 0 frozen (backward 0): stage 0's backward waits for nothing from stage 1
    costs = LayerCosts((F, F), (0.0, B), (1, 1), (0.0, 0.0), (0.0, 0.0))
    r = simulate(costs, Partition((0, 1, 2)), "1f1b", 2, link=Link(latency=0.5))
    assert [e["start"] for e in r.events if e["stage"] == 0 and e["kind"] == "B"] == [2.0, 2.0]
    assert r.step_time == 7.5  # rank 1: F0 1.5-2.5, B0 -4.5, F1 -5.5, B1 -7.5


def test_rank_slowdown():
    costs, part = uniform(4), megatron_layout(4, 2)
    base = simulate(costs, part, "1f1b", 4)
    slow = simulate(costs, part, "1f1b", 4, rank_slowdown=[2.0, 1.0])
    assert slow.busy == (2 * base.busy[0], base.busy[1]) and slow.step_time > base.step_time
    with pytest.raises(ValueError, match="rank_slowdown"):
        simulate(costs, part, "1f1b", 4, rank_slowdown=[1.0])


@pytest.mark.parametrize("schedule,pp,m", [("1f1b", 2, 4), ("1f1b", 4, 8), ("gpipe", 2, 4)])
def test_message_costs_read_back_from_a_timeline(schedule, pp, m):
    link = Link(latency=0.25, send_overhead=0.125, recv_overhead=0.5)
    r = simulate(uniform(8), megatron_layout(8, pp), schedule, m, link=link)
    got = message_costs([r.events, r.events], pp)
    assert (got.send_overhead, got.recv_overhead, got.latency) == (0.125, 0.5, 0.25)
    assert all(n > 0 for n in got.samples)
    none = message_costs([simulate(uniform(8), megatron_layout(8, pp), schedule, m).events], pp)
    assert (none.send_overhead, none.recv_overhead, none.latency) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="expected"):
        message_costs([r.events], pp + 1)


# ---- dynamism scenarios at paper scale (details: tests/unit/test_paper_scale.py) --------------
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("layers", [24, 48])
def test_scenarios_are_valid_and_seeded(case, layers):
    kw = {} if case == "pruning" else {"snapshots": 4}
    trajectory = CASES[case](layers, **kw)
    assert len(trajectory) >= 3 and all(s.costs.num_layers == layers + 3 for s in trajectory)  # + emb, norm, head
    assert CASES[case](layers, **kw) == trajectory
    profile = load_profile()
    dense_blocks = layers * sum(profile.block(1.0))
    most = 1.6 * dense_blocks if case == "moe" else dense_blocks  # top-2 of 8 experts: up to ~2 x the MLP
    for s in trajectory:
        blocks = s.costs.time_sum(1, layers + 1)
        assert 0 < blocks <= most * (1 + 1e-9)
        assert s.iterations > 0 and len(s.stored_activation) == layers + 3


def test_scenario_shapes():
    frozen = freezing(24, snapshots=4, final_frozen=0.5)
    assert [sum(b == 0.0 for b in s.costs.backward[1:25]) for s in frozen] == [0, 4, 8, 12]
    assert frozen[-1].reduced_params[:13] == (0,) * 13  # embedding + 12 frozen blocks skip the all-reduce
    assert frozen[0].reduced_params is None
    exits = [t for t in early_exit(32, snapshots=3)[-1].costs.time[1:33]]
    assert exits[0] == exits[7] > exits[8] == exits[15] > exits[16] > exits[24]
    pruned = pruning(24)
    blocks = [s.costs.time_sum(1, 25) for s in pruned]
    assert [round(zhu_gupta(x), 3) for x in (0, 3000, 4000, 5000, 7000, 9000)] == [0, 0, 0.52, 0.787, 0.9, 0.9]
    assert blocks == sorted(blocks, reverse=True) and blocks[-1] < 0.8 * blocks[0]
    assert sum(s.iterations for s in pruned) == 10_000
    routed = moe(8, snapshots=2)[0].costs
    # expert parallelism over 8 ranks: each rank holds one expert per layer (a dense block's parameters)
    assert routed.params[1] == load_profile().block_params() and min(routed.time[1:9]) > sum(load_profile().block(1.0))


def test_dynamic_balancing_beats_static_on_freezing():
    profile = Profile.from_flops()
    c = compare(freezing(24, profile, snapshots=6), stages=4, dynamic=("partition_time", "diffusion_time"))
    assert c.speedup["partition_time"] > 1.1 and c.best_speedup >= c.speedup["partition_time"]
    assert c.bubble_fraction["partition_time"] < c.bubble_fraction[c.best_static]
    assert set(c.step_time) == {"megatron", "uniform", "param", "static_time", "partition_time", "diffusion_time"}
    assert c.rebalances["partition_time"] >= 1 and c.migration_seconds["partition_time"] == 0.0  # free links


# ---- the balancers see each boundary's own link ------------------------------------------------
@pytest.mark.parametrize("schedule", available_schedules())
def test_matching_cost_model_charges_each_boundary_its_link(schedule):
    """Per-rank links become one bandwidth per (virtual) stage boundary, the link ``simulate``
    charges for that crossing (same stage -> rank placement as torch's schedule)."""
    pp, m = 4, 8
    links = [Link(0.0, float(10 ** (r + 1))) for r in range(pp)]  # every link distinct
    spec = get_schedule(schedule)
    v = spec.virtual_stages(None)
    rank_of = {op.stage: r for r, ops in enumerate(schedule_ops(spec.name, pp, v, m)) for op in ops}
    want = tuple(x.bandwidth for x in boundary_links(rank_of.__getitem__, pp * v, links))
    model = matching_cost_model(schedule, m, links)
    assert model.bandwidth == (want if len(set(want)) > 1 else want[0])
    assert matching_cost_model(schedule, m, [links[0]] * pp).bandwidth == 10.0  # all alike: one value
    assert matching_cost_model(schedule, m, [Link()] * pp).bandwidth is None  # free links


def test_nvlink_inside_infiniband_between_nodes():
    nv, ib = Link(5e-6, 3.6e11), Link(1e-5, 4.5e10)
    links = [ib if (r + 1) % 4 == 0 else nv for r in range(8)]
    assert matching_cost_model("1f1b", 32, links).bandwidth == (3.6e11,) * 3 + (4.5e10,) + (3.6e11,) * 3
    mixed = matching_cost_model("1f1b", 32, [Link(), Link(0.0, 2.0), Link(), Link()])
    assert mixed.bandwidth == (math.inf, 2.0, math.inf)  # a free link is an inf boundary


def test_per_boundary_links_let_the_balancer_cut_wide_activations_on_fast_links():
    """One slow (inter-node) link among fast ones: the balancer pays the wide activations only on
    the fast hops, and the simulated step is no slower than balancing for the slowest link."""
    L, pp, m = 24, 8, 32  # 3 layers a stage: cuts after wide outputs, except at the inter-node link
    costs = LayerCosts([1.0] * L, [2.0] * L, [1] * L, [0.0] * L, [0.5 if i % 4 == 3 else 4.0 for i in range(L)])
    links = [Link(0.0, 0.5 if (r + 1) % 4 == 0 else 64.0) for r in range(pp)]
    per = matching_cost_model("1f1b", m, links)
    slowest = CostModel(m, bandwidth=0.5)
    step = {}
    for name, model in (("per", per), ("slowest", slowest)):
        part = get_balancer("partition_time")(BalanceProblem(costs, pp, model)).partition
        step[name] = simulate(costs, part, "1f1b", m, link=links).step_time
    assert step["per"] < step["slowest"]
