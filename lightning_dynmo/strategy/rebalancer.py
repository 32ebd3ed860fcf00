"""Wires plan/ and runtime/ for Algorithm 1: profile after a trigger, decide, migrate, re-pack.

When to profile and decide is :class:`~lightning_dynmo.plan.controller.RebalanceController`'s
(pure): per step, ``before_step`` asks it and carries the answers out (profiling hooks, the cost
gather, the balancer, migrations, records), and ``after_step`` hands it the step's shared
statistics. Every rank runs the same code on the same agreed numbers, so decisions agree, provided
the balancer is deterministic: each rank calls it itself, so every decision (and the initial
partition) is checked with one small all-reduce (MIN of a hash and its negation; the same
all-reduce agrees on what the decision cost, for the overhead budget), and a balancer that answers
differently on different ranks stops training on every rank with a message saying so.
"""
from __future__ import annotations

import logging
import math
import time
import zlib
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..plan.balancers import BalanceProblem, BalancerResultError, get_balancer
from ..plan.cost_model import CostModel, LayerCosts
from ..plan.budget import OverheadBudget
from ..plan.controller import RebalanceController
from ..plan.measurements import merge_layer_costs
from ..plan.migration_plan import MigrationPlan
from ..plan.partition import Partition
from ..plan.policy import Decision, RebalancePolicy, decide
from ..plan.repack import RepackRefused, check_repack_target, plan_repack
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from ..runtime.groups import build_packed_groups
from ..runtime.migration import MigrationStats, execute_migration
from ..runtime.profiler import layer_memory_bytes
from ..runtime.step_stats import StepStats
from .recorder import DecisionRecorder, write_cost_trace
from .requests import agree_on_actions

if TYPE_CHECKING:
    from .strategy import DynMoStrategy

log = logging.getLogger(__name__)

class BalancerDisagreementError(RuntimeError):
    """Ranks computed different partitions from the same costs: the balancer is not deterministic."""


class Rebalancer:
    """Carries out what :class:`~lightning_dynmo.plan.controller.RebalanceController` answers:
    profiles, decides, migrates, records, and charges what each of those cost (seconds agreed by
    every rank) to its overhead budget."""

    def __init__(self, strategy: "DynMoStrategy", policy: RebalancePolicy, balancer: str, repack: int | str,
                 repack_tolerance: float, plot: bool, plot_interval: int = 50,
                 budget: OverheadBudget | None = None) -> None:
        self.strategy = strategy
        self.policy = policy
        self.controller = RebalanceController(policy, budget)
        self.balancer = balancer
        self.repack = repack
        self.repack_tolerance = repack_tolerance
        self.recorder = DecisionRecorder(plot, plot_interval)
        self._warned_never = False
        self.known_costs: dict[int, tuple[float, float]] = {}  # layer -> (fwd, bwd) s per micro-batch
        self.migration_cost: float | None = None  # measured seconds of the last migration
        self.migration_seconds = 0.0  # all migrations of the run
        self._unagreed = 0.0  # this rank's overhead seconds not yet agreed (sent with the next agreement check)

    # ------------------------------------------------------------------ requests
    def request_rebalance(self, reason: str, reprofile: bool = True) -> None:
        if self.policy.mode == "never":
            if not self._warned_never:
                self._warned_never = True
                rank_zero_warn(
                    f"dynmo: request_rebalance({str(reason)!r}) is ignored because DynMoStrategy(rebalance='never') "
                    "keeps the initial partition. Use rebalance='auto' (the default) or rebalance='on_event' to "
                    "rebalance when dynamism callbacks ask (this warning is given once)"
                )
            return
        self.controller.request(reason, reprofile)

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

    # ------------------------------------------------------------------ per step
    def before_step(self, step: int) -> None:
        s, c = self.strategy, self.controller
        reason = c.profile_closed()
        if reason is not None:
            s.profiler.stop_layer_profiling()
            self._act_on_profile(step, reason)
        elif c.in_profile_window:  # (the same step on every rank): keep measuring
            if not s.profiler.layer_profiling:
                s.profiler.start_layer_profiling(s.layers, s.local_layer_indices())
            return
        self._agree_on_counter_requests()
        actions = c.plan(step, decided=reason is not None)
        for trigger, why in actions.skipped:
            self._record(Decision(step=step, reason=trigger, before=str(s.partition), applied=False, why=why,
                                  kind="skip"))
        if actions.counters:
            self._rebalance(step, actions.counters, c.counter_costs(), [], samples=c.load_cost_samples(),
                            source="counters")
        if actions.profile:
            s.profiler.start_layer_profiling(s.layers, s.local_layer_indices())

    def _agree_on_counter_requests(self) -> None:
        """Load monitors reduce over their own pipeline, so with several replicas (or ranks
        released by re-packing) one rank may ask for a decision from load counters while another
        does not, and the decision is a collective: any rank's request counts for all (one small
        all-reduce per step, only when the world holds more than one pipeline's ranks)."""
        s, c = self.strategy, self.controller
        if s.layout.topology.world_size == s.layout.pp_size:
            return
        flag = torch.tensor([1.0 if c.counter_requests else 0.0], dtype=torch.float64, device=s.root_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0 and not c.counter_requests:
            c.request("a load monitor of another replica", reprofile=False)

    def after_step(self, stats: StepStats) -> None:
        s, c = self.strategy, self.controller
        if c.profiling:
            for i, ft in s.profiler.layer_times().items():
                self.known_costs[i] = ft
        c.after_step(s.lightning_module.trainer.global_step, stats.profiled, stats.rank_busy, stats.rank_wall,
                     stats.layer_load)
        if self.policy.mode != "never":
            s.lightning_module.log("rebalance/overhead_fraction", c.budget.overhead_fraction(), on_step=True,
                                   on_epoch=False, batch_size=1)

    def summary(self) -> dict:
        """What DynMo cost and what its applied decisions gained, measured (see
        :meth:`~lightning_dynmo.plan.budget.OverheadBudget.summary`), plus the migrations' seconds."""
        out = self.controller.budget.summary()
        out["migration_s"] = round(self.migration_seconds, 4)
        out["decisions"] = sum(1 for d in self.recorder.decisions if d.kind != "skip")
        out["skipped"] = sum(1 for d in self.recorder.decisions if d.kind == "skip")
        return out

    def counter_costs(self) -> LayerCosts:
        return self.controller.counter_costs()

    def load_cost_samples(self) -> list[LayerCosts]:
        return self.controller.load_cost_samples()

    # ------------------------------------------------------------------ costs
    def cost_model(self) -> CostModel:
        s = self.strategy
        m = s.last_microbatches or s.options.microbatches or 4 * s.layout.num_stages
        return CostModel(microbatches=m, schedule=s.layout.spec.cost_schedule, capacity=s.options.memory_capacity,
                         virtual_stages=s.layout.virtual)

    def gather_layer_costs(self, timelines: bool = True) -> tuple[LayerCosts, list[dict]]:
        """Per-layer costs identical on every rank (collective over the world) as last profiled;
        plus every rank's chunk timeline of the last step (``timelines=False``: none, e.g. when no
        plot will draw them: they are most of what the gather carries)."""
        s = self.strategy
        local = {}
        for i in s.local_layer_indices():
            layer = s.layers[i]
            f, b = self.known_costs.get(i, (math.nan, math.nan))
            params = sum(p.numel() for p in layer.parameters())
            local[i] = (f, b, params, layer_memory_bytes(layer, s.optimizers))
        events = s.last_step_events() if timelines else []
        parts: list = [None] * s.layout.topology.world_size
        dist.all_gather_object(parts, (local, events))
        costs = merge_layer_costs([p for p, _ in parts], len(s.layers), s.engines.activation_bytes())
        return costs, [e for _, ev in parts for e in ev]

    def initial_partition(self, layers) -> Partition:
        """The user's ``partition``, or the balancer's on what is known before any step (parameter counts)."""
        s = self.strategy
        given = s.options.partition
        if given is not None:
            if given.num_layers != len(layers) or given.num_stages != s.layout.num_stages:
                raise ValueError(
                    f"partition {given.boundaries} does not split {len(layers)} layers into {s.layout.num_stages} stages"
                )
            return given
        params = [sum(p.numel() for p in layer.parameters()) for layer in layers]
        problem = BalanceProblem(costs=LayerCosts.from_params(params), num_stages=s.layout.num_stages,
                                 model=self.cost_model(), current=None)
        with self.agreed_failure("the initial partition at setup"):
            partition = get_balancer(self.balancer)(problem).partition
        self.check_agreement(str(partition), True, "the initial partition at setup")
        return partition

    @contextmanager
    def agreed_failure(self, what: str):
        """A balancer result that fails its check (``BalancerResultError``) on some ranks is
        raised on every rank: the failing ranks join the agreement all-reduce the others make
        next, so no rank waits in it alone."""
        try:
            yield
        except BalancerResultError as err:
            self.check_agreement(f"error: {err}", False, what)
            raise

    def check_agreement(self, result: str | None, applied: bool, what: str, started: float | None = None) -> float:
        """Every rank must have reached the same result (one all-reduce over the world). The same
        all-reduce agrees on the overhead seconds spent since ``started`` plus what was left
        unagreed: returns the slowest rank's (what the overhead budget is charged)."""
        s = self.strategy
        h = float(zlib.crc32(repr((result, bool(applied))).encode()))
        local = self._unagreed + (time.perf_counter() - started if started is not None else 0.0)
        both = torch.tensor([h, -h, -local], dtype=torch.float64, device=s.root_device)
        dist.all_reduce(both, op=dist.ReduceOp.MIN)
        if float(both[0]) != -float(both[1]):
            raise BalancerDisagreementError(
                f"balancer {self.balancer!r} is not deterministic: the ranks computed different results for "
                f"{what} (rank {s.global_rank}: {result}, applied={applied}). Every rank calls the balancer itself "
                "on the same BalanceProblem, so it must return the same partition for the same problem: no "
                "rank-, time- or unseeded-random-dependent choices"
            )
        self._unagreed = 0.0
        return -float(both[2])

    # ------------------------------------------------------------------ decisions
    def _act_on_profile(self, step: int, reason: str) -> None:
        """Algorithm 1: balance on the profiled costs, migrate, then (optionally) re-pack."""
        started = time.perf_counter()
        c = self.controller
        costs, events = self.gather_layer_costs(timelines=self.recorder.plot)
        c.profiled(step, costs)
        self._trace(step, costs)
        # a request made on some ranks only acts on all (strategy/requests.py): one small all-reduce
        rebalance, requested = agree_on_actions(reason, c.take_repack(), self.strategy.root_device)
        if self.policy.mode != "never" and rebalance:
            self._rebalance(step, reason, costs, events, samples=c.load_cost_samples(), started=started)
        target = requested if requested is not None else self.repack
        if target != "off" and self.strategy.layout.pp_size > 1:
            self._repack(step, target, costs)

    def _rebalance(self, step: int, reason: str, costs: LayerCosts, events: list[dict],
                   samples: list[LayerCosts] = (), started: float | None = None, source: str = "decision") -> None:
        """Decide, agree (and charge the budget what deciding cost), migrate if applied, record."""
        s = self.strategy
        started = time.perf_counter() if started is None else started
        model, before = self.cost_model(), s.partition
        cost = self.migration_cost
        if cost is None:
            cost = max(self.rank_wall) if self.rank_wall else 0.0  # first time: assume one step
        with self.agreed_failure(f"the decision at step {step}"):
            decision, new = decide(step=step, reason=reason, costs=costs, model=model, balancer=self.balancer,
                                   current=before, policy=self.policy, migration_cost=cost, samples=samples)
        overhead = self.check_agreement(decision.after, new is not None, f"the decision at step {step}", started)
        self.controller.charge(step, overhead, source)
        seconds = 0.0
        if new is not None:
            seconds, moved_bytes = self.migrate(new)
            self.migration_cost = seconds + (decision.decision_ms or 0.0) / 1e3
            self.migration_seconds += seconds
            decision = decision.with_(migration_ms=seconds * 1e3, migration_bytes=moved_bytes)
        self.controller.decided(step, applied=new is not None, left=before, cost=overhead + seconds,
                                counters=source == "counters")
        recording = time.perf_counter()
        self._record(decision, costs, model, events, before, new)
        self._unagreed += time.perf_counter() - recording  # agreed and charged with the next decision

    def _repack(self, step: int, target: int | str, costs: LayerCosts) -> None:
        s = self.strategy
        before, ranks_before = s.partition, s.layout.pp_size
        base = Decision(step=step, reason=f"repack {target}", kind="repack", before=str(before), applied=False,
                        why="", ranks_before=ranks_before)
        if s.last_batch_size is None:
            self._record(base.with_(why="refused: no step has run yet"))
            return
        try:
            with self.agreed_failure(f"the re-pack decision at step {step}"):
                plan = plan_repack(
                    costs, before, self.cost_model(), ranks_before, target, self.balancer,
                    lambda r: s.choose_microbatches(s.last_batch_size, pp=r), s.layout.virtual, self.repack_tolerance,
                )
        except RepackRefused as err:
            self.check_agreement(None, False, f"the re-pack decision at step {step}")
            self._record(base.with_(why=f"refused: {err}"))
            return
        self.check_agreement(f"{plan.partition} on {plan.ranks} ranks", True, f"the re-pack decision at step {step}")
        seconds, _ = self.migrate(plan.partition, ranks=plan.ranks)
        self.migration_seconds += seconds
        self.controller.repacked(step)
        self._record(base.with_(
            applied=True, after=str(plan.partition), ranks_after=plan.ranks, microbatches=plan.microbatches,
            released=tuple(s.layout.released_ranks), predicted_step_after=plan.predicted_step, migration_ms=seconds * 1e3,
            why=f"packed {ranks_before} -> {plan.ranks}",
        ))

    def _trace(self, step: int, costs: LayerCosts) -> None:
        s = self.strategy
        write_cost_trace(s.output_dir(), s.is_global_zero, {
            "step": step, "partition": list(s.partition.boundaries), "schedule": s.layout.spec.name,
            "pp": s.layout.pp_size, "virtual": s.layout.virtual, "dp": s.layout.topology.dp,
            "microbatches": s.last_microbatches, "forward": list(costs.forward), "backward": list(costs.backward),
            "params": list(costs.params), "memory": list(costs.memory), "activation": list(costs.activation),
            "layer_load": self.layer_load, "rank_busy": self.rank_busy, "rank_wall": self.rank_wall,
            "profiled_steps": self.controller.closed_window_steps,  # the steps the per-layer times are the mean of
        })

    def _record(self, decision: Decision, costs=None, model=None, events=(), before=None, after=None) -> None:
        s = self.strategy
        out_dir = s.output_dir()  # collective (Trainer.log_dir broadcasts): every rank calls it
        self.recorder.record(s.lightning_module, decision, s.partition, out_dir, s.is_global_zero, costs, model,
                             events, before, after)

    # ------------------------------------------------------------------ migration
    def execute(self, plan: MigrationPlan) -> MigrationStats:
        """Carry out ``plan`` on this rank (collective over the pipeline group)."""
        s = self.strategy
        s.profiler.stop_layer_profiling()  # hooks must not travel with the layers
        s.engines.clear_engines()  # release stage references to layers that may leave
        stats = execute_migration(plan, s.lightning_module, s.layers, s.layers_attr, s.optimizers,
                                  s.optimizer_layout, s.layout.pp_rank, s.pipeline_group, s.root_device, s.tied)
        s.last_migration = stats
        log.debug("rank %d migrated: %s", s.global_rank, plan.describe())
        return stats

    def shrink_pipeline(self, ranks: int, partition: Partition) -> None:
        """After the layers moved: rebuild every replica's pipeline group on its first ``ranks``
        ranks and release the others. Collective over the world."""
        s = self.strategy
        s.engines.clear_engines()
        groups = build_packed_groups(s.layout.topology, ranks, s.options.timeout)
        s.layout.packed_pp = ranks
        s.layout.partition = partition
        s.replica_pipeline_groups = groups
        s.pipeline_group = groups[s.layout.dp_rank] if not s.layout.released else None
        s.tied.update(s.layout, s.options.timeout)
        if s.layout.released:
            s.engines.clear()
            if s.root_device.type == "cuda":
                torch.cuda.empty_cache()
        self._notify_released(s.layout.released_ranks)

    def _notify_released(self, released: list[int]) -> None:
        """Tell the launcher/scheduler: ``on_workers_released(ranks)`` on the LightningModule and
        on every callback that defines it, plus a log line and a metric."""
        s = self.strategy
        module = s.lightning_module
        for obj in [module, *module.trainer.callbacks]:
            hook = getattr(obj, "on_workers_released", None)
            if callable(hook):
                hook(released)
        module.log("pipeline/ranks", float(s.layout.pp_size), on_step=True, on_epoch=False, batch_size=1)
        rank_zero_info(f"dynmo: packed onto {s.layout.pp_size} pipeline ranks per replica; released ranks {released}")

    def rebalance_to(self, new: Partition) -> MigrationStats:
        """Same stage count, new boundaries (see ``DynMoStrategy.rebalance_to``)."""
        s = self.strategy
        if new.num_layers != s.partition.num_layers or new.num_stages != s.partition.num_stages:
            raise ValueError(
                f"partition {new} must split {s.partition.num_layers} layers into {s.partition.num_stages} stages"
            )
        if s.layout.released:  # not in the pipeline group: nothing to send or receive
            s.layout.partition = new
            s.tied.update(s.layout, s.options.timeout)
            return MigrationStats()
        stats = self.execute(MigrationPlan.build(s.partition, new, s.layout.rank_of_stage))
        s.layout.partition = new
        s.tied.update(s.layout, s.options.timeout)  # collective over the world, like this method
        return stats

    def check_repack(self, ranks: int, partition: Partition) -> None:
        s = self.strategy
        if not 1 <= ranks < s.layout.pp_size:
            raise ValueError(f"can only pack {s.layout.pp_size} pipeline ranks onto 1..{s.layout.pp_size - 1}, got {ranks}")
        if partition.num_stages != ranks * s.layout.virtual or partition.num_layers != len(s.layers):
            raise ValueError(f"partition {partition} does not split {len(s.layers)} layers into "
                             f"{ranks * s.layout.virtual} stages")

    def migrate(self, new: Partition, ranks: int | None = None) -> tuple[float, int]:
        """Move layers so that ``new`` (on ``ranks`` pipeline ranks, default: as now) becomes the
        partition; returns the slowest rank's seconds and the bytes moved (agreed everywhere)."""
        s = self.strategy
        spec = s.layout.spec
        t0 = time.perf_counter()
        sent = 0
        if ranks is None:
            sent = self.rebalance_to(new).bytes_sent
        else:
            self.check_repack(ranks, new)
            if not s.layout.released:
                plan = MigrationPlan.build(s.partition, new, s.layout.rank_of_stage, lambda st: spec.rank_of_stage(st, ranks))
                sent = self.execute(plan).bytes_sent
            self.shrink_pipeline(ranks, new)
        agreed = torch.tensor([time.perf_counter() - t0, float(sent)], dtype=torch.float64, device=s.root_device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        moved = torch.tensor([float(sent)], dtype=torch.float64, device=s.root_device)
        dist.all_reduce(moved)
        return float(agreed[0]), int(moved.item())
