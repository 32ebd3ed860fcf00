"""Wires plan/ and runtime/ for Algorithm 1: profile after a trigger, decide, migrate, re-pack.

When to profile and decide is :class:`~lightning_dynmo.plan.controller.RebalanceController`'s
(pure): per step, ``before_step`` asks it and carries the answers out (profiling hooks, the cost
gather, the balancer, migrations, records), and ``after_step`` hands it the step's shared
statistics. Every rank runs the same code on the same agreed numbers, so decisions agree, provided
the balancer is deterministic: each rank calls it itself, so every decision (and the initial
partition) is checked with one small all-reduce (MIN of a hash and its negation; the same
all-reduce agrees on what the decision cost, for the overhead budget), and a balancer that answers
differently on different ranks stops training on every rank with a message saying so.

Rank speed (:mod:`~lightning_dynmo.plan.speed`): every rank converts the layer times it profiled
into work (seconds at speed 1.0) with its pipeline rank's speed at that profile, and keeps the work,
not the time: a layer that migrates off a slow rank does not carry the slow rank's seconds along,
and a layer profiled long ago keeps the speed it was timed at. The speed at a profile is its own
estimate against the last profile's work (the same layers, so a straggler is seen at the first
decision, whatever triggered it), or the speeds balanced for until then after a dynamism event (the
work changed, so the times say nothing about the ranks). Between profiles each step's busy times
against the work each rank holds feed the controller's speed watch.

The rebalancer never holds the strategy: each call gets this rank's pipeline as a value
(:class:`~lightning_dynmo.strategy.state.RankPipeline`), and a call that moves layers returns the
new layout (:class:`~lightning_dynmo.strategy.state.Relayout`) for the strategy to adopt.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
import zlib
from contextlib import contextmanager

import torch
import torch.distributed as dist

from ..plan.balancers import BalanceProblem, BalancerResultError, get_balancer
from ..plan.cost_model import CostModel, LayerCosts
from ..plan.controller import RebalanceController
from ..plan.layout import PipelineLayout
from ..plan.measurements import KnownWork, merge_layer_costs, scale_by_load
from ..plan.migration_plan import MigrationPlan
from ..plan.partition import Partition
from ..plan.decision import Decision
from ..plan.policy import decide
from ..plan.repack import RepackRefused, check_repack_target, plan_repack
from ..plan.schedules import choose_microbatches
from ..plan.speed import describe_slowest, estimate_speeds, normalise_speeds, rank_work, slowest_replicas
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from ..runtime.groups import packed_groups
from ..runtime.migration import MigrationStats, execute_migration
from ..runtime.memory import layer_state_bytes
from ..runtime.step_stats import StepStats
from .options import PipelineOptions
from .recorder import DecisionRecorder, write_cost_trace
from .requests import agree_on_actions
from .state import RankPipeline, Relayout

log = logging.getLogger(__name__)

#: the first step whose times a reference profile may take (step 0's carry its allocations)
REFERENCE_STEP = 1


class BalancerDisagreementError(RuntimeError):
    """Ranks computed different partitions from the same costs: the balancer is not deterministic."""


class Rebalancer:
    """Carries out what :class:`~lightning_dynmo.plan.controller.RebalanceController` answers:
    profiles, decides, migrates, records, and charges what each of those cost (seconds agreed by
    every rank) to its overhead budget."""

    def __init__(self, options: PipelineOptions, known_work: KnownWork | None = None) -> None:
        self.options = options
        self.controller = RebalanceController(options.policy(), options.budget(), options.repack)
        self.recorder = DecisionRecorder(options.plot, options.plot_interval)
        self._warned_never = False
        # layer -> (fwd, bwd) s per micro-batch as work: x this rank's speed when timed
        self.known_work = known_work if known_work is not None else KnownWork()
        self._window: dict[int, tuple[float, float]] = {}  # this profile window's times, not yet work
        self._reference: tuple[LayerCosts, list[float | None]] | None = None  # last profile's work, its loads
        self._rank_work: tuple | None = None  # (work costs, layout key, per-rank work) without loads
        self._migrated = False  # layers moved before the coming step
        self._unagreed = 0.0  # this rank's overhead seconds not yet agreed (sent with the next agreement check)

    policy = property(lambda self: self.controller.policy)
    balancer = property(lambda self: self.options.balancer)

    # ------------------------------------------------------------------ requests
    def request_rebalance(self, reason: str, reprofile: bool = True) -> None:
        if not self.controller.request(reason, reprofile) and not self._warned_never:
            self._warned_never = True
            rank_zero_warn(
                f"dynmo: request_rebalance({str(reason)!r}) is ignored because DynMoStrategy(rebalance='never') "
                "keeps the initial partition. Use rebalance='auto' (the default) or rebalance='on_event' to "
                "rebalance when dynamism callbacks ask (this warning is given once)"
            )

    def request_repack(self, target: int | str) -> None:
        """Re-packing has its own path: it works under every rebalance mode, ``never`` included."""
        self.controller.request_repack(check_repack_target(target))

    @property
    def profiling(self) -> bool:
        return self.controller.profiling

    # read-only views of the controller's state (metrics, benchmarks)
    rank_busy = property(lambda self: self.controller.rank_busy)
    rank_wall = property(lambda self: self.controller.rank_wall)
    layer_load = property(lambda self: self.controller.layer_load)
    profiled_costs = property(lambda self: self.controller.profiled_costs)
    profile_step = property(lambda self: self.controller.profile_step)

    # ------------------------------------------------------------------ per step
    def before_step(self, step: int, pipe: RankPipeline) -> Relayout | None:
        """Before training step ``step``: what the controller asks; returns the new layout if
        layers moved (``None``: they did not)."""
        c, change = self.controller, None
        reason = c.profile_closed()
        if reason is not None:
            pipe.profiler.stop_layer_profiling()
            change = self._act_on_profile(step, reason, pipe)
            pipe = pipe.adopted(change)
        elif c.in_profile_window:  # (the same step on every rank): keep measuring
            if not pipe.profiler.layer_profiling:
                pipe.profiler.start_layer_profiling(pipe.layers, pipe.local_layer_indices())
            return None
        self._agree_on_counter_requests(pipe)
        actions = c.plan(step, decided=reason is not None, reference=self._needs_reference(step))
        for trigger, why in actions.skipped:
            self._record(pipe, Decision(step=step, reason=trigger, before=str(pipe.layout.partition), applied=False,
                                        why=why, kind="skip"))
        if actions.counters:
            moved = self._rebalance(step, actions.counters, c.counter_costs(), [], pipe,
                                    samples=c.load_cost_samples(), source="counters")
            change, pipe = Relayout.chain(change, moved), pipe.adopted(moved)
        if actions.profile:
            pipe.profiler.start_layer_profiling(pipe.layers, pipe.local_layer_indices())
        return change

    def _needs_reference(self, step: int) -> bool:
        """Rank speeds are on and no profile has given the work they are measured against. Not
        at step 0, whose times carry the first step's allocations (the same answer on every rank)."""
        return self.options.rank_speeds and self._reference is None and step >= REFERENCE_STEP

    def _agree_on_counter_requests(self, pipe: RankPipeline) -> None:
        """Load monitors reduce over their own pipeline, so with several replicas (or ranks
        released by re-packing) one rank may ask for a decision from load counters while another
        does not, and the decision is a collective: any rank's request counts for all (one small
        all-reduce per step, only when the world holds more than one pipeline's ranks)."""
        c = self.controller
        if pipe.layout.topology.world_size == pipe.layout.pp_size:
            return
        flag = torch.tensor([1.0 if c.counter_requests else 0.0], dtype=torch.float64, device=pipe.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0 and not c.counter_requests:
            c.request("a load monitor of another replica", reprofile=False)

    def after_step(self, step: int, stats: StepStats, pipe: RankPipeline) -> None:
        c = self.controller
        if c.profiling:
            self._window.update(pipe.profiler.layer_times())
        # (not the step after a migration either: the ranks that received layers rebuilt their stages in it)
        work = None if stats.profiled or self._migrated or not self.options.rank_speeds \
            else self.rank_work(pipe.layout, stats.layer_load)
        self._migrated = False
        c.after_step(step, stats.profiled, stats.rank_busy, stats.rank_wall, stats.layer_load, rank_work=work)
        if c.rebalancing:
            pipe.module.log("rebalance/overhead_fraction", c.budget.overhead_fraction(), on_step=True,
                            on_epoch=False, batch_size=1)

    def summary(self) -> dict:
        """What DynMo cost and what its applied decisions gained, measured (see
        :meth:`~lightning_dynmo.plan.budget.OverheadBudget.summary`), plus the migrations' seconds
        and the decisions taken for a slow rank (``stragglers``; only when there were any)."""
        out = self.controller.budget.summary()
        out["migration_s"] = round(self.controller.migration_seconds, 4)
        out["decisions"] = sum(1 for d in self.recorder.decisions if d.kind != "skip")
        out["skipped"] = sum(1 for d in self.recorder.decisions if d.kind == "skip")
        slow = [{"step": d.step, "straggler": d.straggler, "applied": d.applied}
                for d in self.recorder.decisions if d.straggler]
        if slow:
            out["stragglers"] = slow
        return out

    def rank_work(self, layout: PipelineLayout, layer_load: list[float | None]) -> list[float] | None:
        """Per active pipeline rank, the work its layers hold under this step's loads (None
        before any profile): what its busy seconds are compared with for its speed. On the
        reference work (see :meth:`_profile_speeds`), so that a slowdown one profile took as
        heavier layers still shows in the busy times. Cached per partition when no layer
        reports its load."""
        if self._reference is None or layout.partition is None \
                or self._reference[0].num_layers != layout.partition.num_layers:
            return None  # (released ranks compute it too: every rank's controller sees the same)
        costs, at = self._reference
        loaded = any(x is not None for x in layer_load) and len(at) == costs.num_layers
        key = (layout.partition, layout.pp_size, layout.virtual)
        cached = self._rank_work
        if not loaded and cached is not None and cached[0] is costs and cached[1] == key:
            return cached[2]
        model = self.cost_model(layout, None)  # (the per-micro-batch work does not depend on the count)
        work = rank_work(scale_by_load(costs, layer_load, at) if loaded else costs, model,
                         layout.partition, [layout.rank_of_stage(s) for s in range(layout.num_stages)], layout.pp_size)
        if not loaded:
            self._rank_work = (costs, key, work)
        return work

    # ------------------------------------------------------------------ costs
    def cost_model(self, layout: PipelineLayout, last_microbatches: int | None) -> CostModel:
        """The cost model decisions use: this layout's schedule, links and the ranks' speeds
        (``speed=None`` while every rank is taken as alike)."""
        m = last_microbatches or self.options.microbatches or 4 * layout.num_stages
        return CostModel(microbatches=m, schedule=layout.spec.cost_schedule, capacity=self.options.memory_capacity,
                         virtual_stages=layout.virtual,
                         bandwidth=layout.boundary_bandwidth(self.options.link_bandwidth),
                         speed=layout.stage_speed(self._active_speeds(layout)))

    def _active_speeds(self, layout: PipelineLayout) -> tuple[float, ...] | None:
        speeds = self.controller.rank_speed  # (more than pp_size right after a re-pack by hand: the first ones stay)
        return None if speeds is None or len(speeds) < layout.pp_size else tuple(speeds[:layout.pp_size])

    def gather_layer_costs(self, pipe: RankPipeline, timelines: bool = True,
                           event: bool | None = None) -> tuple[LayerCosts, list[dict]]:
        """Per-layer work identical on every rank (collective over the world) as last profiled
        (seconds at speed 1.0: the measured seconds while every rank is alike); plus every rank's
        chunk timeline of the last step (``timelines=False``: none, e.g. when no plot will draw
        them: they are most of what the gather carries). ``event``: this closes a profile window
        (agreed: whether a dynamism event may have changed the layers it measured); its times
        become work at the speeds :meth:`_profile_speeds` settles. ``None`` (a user's call): the
        window stays open and its times count at the speeds balanced for."""
        layout = pipe.layout
        local, fresh = {}, {}
        for i in pipe.local_layer_indices():
            layer = pipe.layers[i]
            if i in self._window:
                fresh[i] = self._window[i]
            f, b = self.known_work.get(i, (math.nan, math.nan))
            params = sum(p.numel() for p in layer.parameters())
            local[i] = (f, b, params, layer_state_bytes(layer, pipe.optimizers))
        events = pipe.last_step_events() if timelines else []
        parts: list = [None] * layout.topology.world_size
        dist.all_gather_object(parts, (local, fresh, events))
        costs = self.work_of_reports([(rep, fr) for rep, fr, _ in parts], layout, len(pipe.layers),
                                     pipe.engines.activation_bytes(), event, pipe.global_rank)
        return costs, [e for _, _, ev in parts for e in ev]

    def work_of_reports(self, reports: list[tuple[dict, dict]], layout: PipelineLayout, num_layers: int,
                        activation, event: bool | None, rank: int) -> LayerCosts:
        """Every rank's ``(report, fresh)`` (global rank order; ``report``: ``{layer: (forward,
        backward, params, memory)}`` with the work known so far, ``fresh``: ``{layer: (forward,
        backward)}`` seconds of the open profile window) -> the merged work. Pure, the same on
        every rank; on a closing window (``event`` not None) this rank (``rank``) keeps its fresh
        layers' work and the result becomes the next profile's reference."""
        closing = event is not None
        speeds, suspect = self._profile_speeds([fr for _, fr in reports], layout, event) if closing \
            else (self._active_speeds(layout), False)
        merged, timed_at = [], {}  # (timed_at: layer -> the speed of the slowest rank that timed it now)
        for g, (rep, fr) in enumerate(reports):
            k = 1.0 if speeds is None or not fr else speeds[layout.topology.pp_rank(g)]
            rep = dict(rep)
            for i, (f, b) in fr.items():
                rep[i] = (f * k, b * k, *rep[i][2:])
                timed_at[i] = min(k, timed_at.get(i, k))
                if closing and g == rank:
                    self.known_work[i] = (f * k, b * k)
            merged.append(rep)
        costs = merge_layer_costs(merged, num_layers, activation)
        if closing:
            self._window.clear()
            if not suspect:
                self._reference = self._anchored(costs, timed_at, bool(event))
        return costs

    def _anchored(self, costs: LayerCosts, timed_at: dict[int, float], event: bool) -> tuple[LayerCosts, list]:
        """The reference the next speeds are measured against: this profile's work, except for
        layers timed now on a rank slower than the fastest, which keep their work in the reference
        before (timed at speed 1.0 in the end): work derived from an estimated speed carries that
        estimate's error, and speeds measured against it would carry it on from profile to profile
        (a random walk that, e.g., leaves a recovered rank looking slow). After a dynamism event
        every layer takes its new work (what it computes changed)."""
        loads, old = list(self.controller.load_at_profile), self._reference
        slow = [i for i, k in timed_at.items() if k < 1.0]
        if event or not slow or old is None or old[0].num_layers != costs.num_layers:
            return costs, loads
        f, b = list(costs.forward), list(costs.backward)
        for i in slow:
            f[i], b[i] = old[0].forward[i], old[0].backward[i]
            if i < len(loads):
                loads[i] = old[1][i] if i < len(old[1]) else None
        return dataclasses.replace(costs, forward=tuple(f), backward=tuple(b)), loads

    def _profile_speeds(self, measured: list[dict], layout: PipelineLayout, event: bool) -> tuple[float, ...] | None:
        """Per pipeline rank, the speeds a closing profile's times are work at (the same on every
        rank: from the gathered times), and whether the profile is suspect. The profile's own
        estimate against the reference work (scaled to this window's loads; each replica's median
        ratio, the slowest replica's per pipeline rank), settled by
        :meth:`~lightning_dynmo.plan.controller.RebalanceController.profile_speeds`. The
        reference is the last profile's work (for layers a slower rank timed: their work from
        before, see :meth:`_anchored`), except one whose estimate drifted but was not confirmed
        (suspect): its times are taken as work as they are (the old behaviour), but speeds are
        still measured against the work before it, so a real slowdown shows once the busy times
        confirm it, and noise leaves no trace."""
        if not self.options.rank_speeds:
            return None, False
        c, topo, pp = self.controller, layout.topology, layout.pp_size
        estimate = None
        if not event and self._reference is not None and self._reference[0].num_layers == layout.partition.num_layers:
            ref = scale_by_load(self._reference[0], c._at_profile(), self._reference[1]) \
                if len(self._reference[1]) == self._reference[0].num_layers else self._reference[0]
            base = self._active_speeds(layout) or (1.0,) * pp
            times = [{i: f + b for i, (f, b) in m.items()} for m in measured]
            if any(times[g] for g in range(topo.world_size) if topo.pp_rank(g) < pp):
                per_rank = estimate_speeds(times, [f + b for f, b in zip(ref.forward, ref.backward)],
                                           previous=[base[topo.pp_rank(g)] if topo.pp_rank(g) < pp else 1.0
                                                     for g in range(topo.world_size)])
                estimate = normalise_speeds(slowest_replicas(per_rank, topo, active=pp))
        watch = c.policy.speed_watch
        drifted = estimate is not None and watch.drift_of(estimate) is not None
        before = watch.balanced_for
        speeds = c.profile_speeds(estimate)
        return speeds, drifted and watch.balanced_for == before

    def initial_partition(self, layers, layout: PipelineLayout, device: torch.device, rank: int,
                          last_microbatches: int | None = None, optimizers=None, sharded_over: int = 1) -> Partition:
        """The user's ``partition``, or the balancer's on what is known before any step: parameter
        counts for time, and the memory rule for the cap (``optimizers``: the fit's, ``None``
        before they are built; ``sharded_over``: the replicas FSDP will shard each layer over,
        whose 1/dp a rank will hold)."""
        given = self.options.partition
        if given is not None:
            if given.num_layers != len(layers) or given.num_stages != layout.num_stages:
                raise ValueError(
                    f"partition {given.boundaries} does not split {len(layers)} layers into {layout.num_stages} stages"
                )
            return given
        params = [sum(p.numel() for p in layer.parameters()) for layer in layers]
        memory = [layer_state_bytes(layer, optimizers) / sharded_over for layer in layers]
        problem = BalanceProblem(costs=LayerCosts.from_params(params, memory=memory), num_stages=layout.num_stages,
                                 model=self.cost_model(layout, last_microbatches), current=None)
        what = "the initial partition at setup"
        with self.agreed_failure(what, device, rank):
            partition = get_balancer(self.balancer)(problem).partition
        self.check_agreement(str(partition), True, what, device, rank)
        return partition

    @contextmanager
    def agreed_failure(self, what: str, device: torch.device, rank: int):
        """A balancer result that fails its check (``BalancerResultError``) on some ranks is
        raised on every rank: the failing ranks join the agreement all-reduce the others make
        next, so no rank waits in it alone."""
        try:
            yield
        except BalancerResultError as err:
            self.check_agreement(f"error: {err}", False, what, device, rank)
            raise

    def check_agreement(self, result: str | None, applied: bool, what: str, device: torch.device, rank: int,
                        started: float | None = None) -> float:
        """Every rank must have reached the same result (one all-reduce over the world). The same
        all-reduce agrees on the overhead seconds spent since ``started`` plus what was left
        unagreed: returns the slowest rank's (what the overhead budget is charged)."""
        h = float(zlib.crc32(repr((result, bool(applied))).encode()))
        local = self._unagreed + (time.perf_counter() - started if started is not None else 0.0)
        both = torch.tensor([h, -h, -local], dtype=torch.float64, device=device)
        dist.all_reduce(both, op=dist.ReduceOp.MIN)
        if float(both[0]) != -float(both[1]):
            raise BalancerDisagreementError(
                f"balancer {self.balancer!r} is not deterministic: the ranks computed different results for "
                f"{what} (rank {rank}: {result}, applied={applied}). Every rank calls the balancer itself "
                "on the same BalanceProblem, so it must return the same partition for the same problem: no "
                "rank-, time- or unseeded-random-dependent choices"
            )
        self._unagreed = 0.0
        return -float(both[2])

    # ------------------------------------------------------------------ decisions
    def _act_on_profile(self, step: int, reason: str, pipe: RankPipeline) -> Relayout | None:
        """Algorithm 1: balance on the profiled costs, migrate, then (optionally) re-pack."""
        started = time.perf_counter()
        c, change = self.controller, None
        # a request made on some ranks only acts on all (strategy/requests.py): one small all-reduce
        rebalance, requested, event = agree_on_actions(reason, c.take_repack(), pipe.device, c.take_event(reason))
        costs, events = self.gather_layer_costs(pipe, timelines=self.recorder.plot, event=event)
        c.profiled(step, costs)
        self._trace(step, costs, pipe)
        if c.rebalancing and rebalance:
            change = self._rebalance(step, reason, costs, events, pipe, samples=c.load_cost_samples(), started=started)
            pipe = pipe.adopted(change)
        target = c.repack_target(requested)
        if target != "off" and pipe.layout.pp_size > 1:
            change = Relayout.chain(change, self._repack(step, target, costs, pipe))
        return change

    def _rebalance(self, step: int, reason: str, costs: LayerCosts, events: list[dict], pipe: RankPipeline,
                   samples: list[LayerCosts] = (), started: float | None = None,
                   source: str = "decision") -> Relayout | None:
        """Decide, agree (and charge the budget what deciding cost), migrate if applied, record."""
        started = time.perf_counter() if started is None else started
        model, before = self.cost_model(pipe.layout, pipe.last_microbatches), pipe.layout.partition
        what = f"the decision at step {step}"
        with self.agreed_failure(what, pipe.device, pipe.global_rank):
            decision, new = decide(step=step, reason=reason, costs=costs, model=model, balancer=self.balancer,
                                   current=before, policy=self.policy,
                                   migration_cost=self.controller.expected_migration_cost(), samples=samples,
                                   runs_per_step=pipe.runs_per_step)
        decision = decision.with_(straggler=describe_slowest(self._active_speeds(pipe.layout)))
        overhead = self.check_agreement(decision.after, new is not None, what, pipe.device, pipe.global_rank, started)
        self.controller.charge(step, overhead, source)
        seconds, change = 0.0, None
        if new is not None:
            change, seconds, moved_bytes = self.migrate(new, pipe)
            pipe = pipe.adopted(change)
            self.controller.migrated(seconds, cost=seconds + (decision.decision_ms or 0.0) / 1e3)
            decision = decision.with_(migration_ms=seconds * 1e3, migration_bytes=moved_bytes)
        self.controller.decided(step, applied=new is not None, left=before, cost=overhead + seconds,
                                counters=source == "counters")
        recording = time.perf_counter()
        self._record(pipe, decision, costs, model, events, before, new)
        self._unagreed += time.perf_counter() - recording  # agreed and charged with the next decision
        return change

    def _repack(self, step: int, target: int | str, costs: LayerCosts, pipe: RankPipeline) -> Relayout | None:
        layout = pipe.layout
        before, ranks_before = layout.partition, layout.pp_size
        base = Decision(step=step, reason=f"repack {target}", kind="repack", before=str(before), applied=False,
                        why="", ranks_before=ranks_before)
        if pipe.last_batch_size is None:
            self._record(pipe, base.with_(why="refused: no step has run yet"))
            return None
        what, o = f"the re-pack decision at step {step}", self.options
        try:
            with self.agreed_failure(what, pipe.device, pipe.global_rank):
                speeds = self._active_speeds(layout)
                plan = plan_repack(
                    costs, before, self.cost_model(layout, pipe.last_microbatches), ranks_before, target, self.balancer,
                    lambda r: choose_microbatches(o.schedule, pipe.last_batch_size, r, o.virtual_stages,
                                                  o.microbatches),
                    layout.virtual, o.repack_tolerance, lambda r: layout.boundary_bandwidth(o.link_bandwidth, r),
                    speed=lambda r: layout.stage_speed(speeds, r),
                )
        except RepackRefused as err:
            self.check_agreement(None, False, what, pipe.device, pipe.global_rank)
            self._record(pipe, base.with_(why=f"refused: {err}"))
            return None
        self.check_agreement(f"{plan.partition} on {plan.ranks} ranks", True, what, pipe.device, pipe.global_rank)
        change, seconds, _ = self.migrate(plan.partition, pipe, ranks=plan.ranks)
        pipe = pipe.adopted(change)
        self.controller.migrated(seconds)
        self.controller.repacked(step, plan.ranks)
        self._record(pipe, base.with_(
            applied=True, after=str(plan.partition), ranks_after=plan.ranks, microbatches=plan.microbatches,
            released=tuple(pipe.layout.released_ranks), predicted_step_after=plan.predicted_step,
            migration_ms=seconds * 1e3, why=f"packed {ranks_before} -> {plan.ranks}",
            straggler=describe_slowest(speeds),
        ))
        return change

    def _trace(self, step: int, costs: LayerCosts, pipe: RankPipeline) -> None:
        layout = pipe.layout
        write_cost_trace(pipe.output_dir(), pipe.is_global_zero, {
            "step": step, "partition": list(layout.partition.boundaries), "schedule": layout.spec.name,
            "pp": layout.pp_size, "virtual": layout.virtual, "dp": layout.topology.dp,
            "microbatches": pipe.last_microbatches, "forward": list(costs.forward), "backward": list(costs.backward),
            "params": list(costs.params), "memory": list(costs.memory), "activation": list(costs.activation),
            "layer_load": self.layer_load, "rank_busy": self.rank_busy, "rank_wall": self.rank_wall,
            "profiled_steps": self.controller.closed_window_steps,  # the steps the per-layer times are the mean of
            "rank_speed": self._active_speeds(layout),  # forward/backward are work: seconds at these speeds' 1.0
        })

    def _record(self, pipe: RankPipeline, decision: Decision, costs=None, model=None, events=(), before=None,
                after=None) -> None:
        out_dir = pipe.output_dir()  # collective (Trainer.log_dir broadcasts): every rank calls it
        self.recorder.record(pipe.module, decision, pipe.layout.partition, out_dir, pipe.is_global_zero, costs, model,
                             events, before, after)

    # ------------------------------------------------------------------ migration
    def execute(self, plan: MigrationPlan, pipe: RankPipeline) -> MigrationStats:
        """Carry out ``plan`` on this rank (collective over the pipeline group)."""
        pipe.profiler.stop_layer_profiling()  # hooks must not travel with the layers
        pipe.engines.clear_engines()  # release stage references to layers that may leave
        rank = pipe.layout.pp_rank
        arriving = [m.layer for m in plan.moves if m.dst == rank]
        pipe.dp_sharding.before_moves([m.layer for m in plan.moves if m.src == rank], pipe.device, arriving)
        stats = execute_migration(plan, pipe.module, pipe.layers, pipe.layers_attr, pipe.optimizers,
                                  pipe.optimizer_layout, pipe.layout.pp_rank, pipe.groups.pipeline, pipe.device,
                                  pipe.tied)
        pipe.dp_sharding.shard(arriving)  # (fsdp: arrived whole on every replica of the stage)
        log.debug("rank %d migrated: %s", pipe.global_rank, plan.describe())
        return stats

    def shrink_pipeline(self, ranks: int, partition: Partition, pipe: RankPipeline,
                        stats: MigrationStats | None = None) -> Relayout:
        """After the layers moved: rebuild every replica's pipeline group on its first ``ranks``
        ranks and release the others. Collective over the world."""
        pipe.engines.clear_engines()
        layout = pipe.layout.packed(ranks, partition)
        groups = packed_groups(layout, pipe.groups.data_parallel, self.options.timeout)
        pipe.tied.update(layout, self.options.timeout)
        if layout.released:
            pipe.engines.clear()
            if pipe.device.type == "cuda":
                torch.cuda.empty_cache()
        return Relayout(layout, groups, stats)

    def rebalance_to(self, new: Partition, pipe: RankPipeline) -> Relayout:
        """Same stage count, new boundaries (see ``DynMoStrategy.rebalance_to``)."""
        current = pipe.layout.partition
        if new.num_layers != current.num_layers or new.num_stages != current.num_stages:
            raise ValueError(
                f"partition {new} must split {current.num_layers} layers into {current.num_stages} stages"
            )
        layout = pipe.layout.with_partition(new)
        if pipe.layout.released:  # not in the pipeline group: nothing to send or receive
            pipe.tied.update(layout, self.options.timeout)
            return Relayout(layout)
        stats = self.execute(MigrationPlan.build(current, new, pipe.layout.rank_of_stage), pipe)
        pipe.tied.update(layout, self.options.timeout)  # collective over the world, like this method
        return Relayout(layout, migration=stats)

    def check_repack(self, ranks: int, partition: Partition, pipe: RankPipeline) -> None:
        layout, n = pipe.layout, len(pipe.layers)
        if not 1 <= ranks < layout.pp_size:
            raise ValueError(f"can only pack {layout.pp_size} pipeline ranks onto 1..{layout.pp_size - 1}, got {ranks}")
        if partition.num_stages != ranks * layout.virtual or partition.num_layers != n:
            raise ValueError(f"partition {partition} does not split {n} layers into {ranks * layout.virtual} stages")

    def migrate(self, new: Partition, pipe: RankPipeline, ranks: int | None = None) -> tuple[Relayout, float, int]:
        """Move layers so that ``new`` (on ``ranks`` pipeline ranks, default: as now) becomes the
        partition; returns the new layout, the slowest rank's seconds and the bytes moved (agreed
        everywhere)."""
        layout = pipe.layout
        t0 = time.perf_counter()
        self._migrated = True
        if ranks is None:
            change = self.rebalance_to(new, pipe)
        else:
            self.check_repack(ranks, new, pipe)
            stats = None
            if not layout.released:
                plan = MigrationPlan.build(layout.partition, new, layout.rank_of_stage,
                                           lambda st: layout.spec.rank_of_stage(st, ranks))
                stats = self.execute(plan, pipe)
            change = self.shrink_pipeline(ranks, new, pipe, stats)
        sent = change.migration.bytes_sent if change.migration is not None else 0
        agreed = torch.tensor([time.perf_counter() - t0, float(sent)], dtype=torch.float64, device=pipe.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        moved = torch.tensor([float(sent)], dtype=torch.float64, device=pipe.device)
        dist.all_reduce(moved)
        return change, float(agreed[0]), int(moved.item())
