"""The rebalance state machine (pure): when to profile, when to decide and on what; the
rebalancer (strategy/) only carries its answers out.

Per step, on numbers every rank agrees on (so every rank answers the same):

1. :meth:`RebalanceController.profile_closed` before the step: a profile window just ended, so
   decide on it now (the reason), or ``None``. Inside a window :attr:`in_profile_window` says
   to keep profiling.
2. :meth:`RebalanceController.plan` after that decision: what else this step does
   (:class:`StepActions`): a decision from load counters (no profiling: the last profile
   scaled by each layer's load, c_i = r_i t_i), profiling this step, and the triggers skipped
   with why (the back-off and the overhead budget of :mod:`~lightning_dynmo.plan.budget`,
   which govern only what ``auto`` starts by itself: events, ``every_n`` and ``on_event`` run
   as asked).
3. :meth:`RebalanceController.after_step` with the step's shared statistics.

It holds what the policy (:class:`~lightning_dynmo.plan.policy.RebalancePolicy`: requests,
cooldown, hysteresis) does not: counter requests, re-pack requests and the configured target,
the profile window, load smoothing and the recent loads a move's gain is tested under, the
measured cost of migrating (what ``auto`` weighs a move against), and the budget.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from .budget import OverheadBudget
from .cost_model import LayerCosts
from .measurements import loads_near_profile, scale_by_load, smooth_load
from .partition import Partition
from .policy import Rebalance, RebalancePolicy
from .speed import normalise_speeds, speeds_from_busy
from .straggler import DRIFT_REASON

#: Decisions from load counters reuse a profile for at most this many steps, then re-profile.
REPROFILE_STEPS = 200
#: Decisions from load counters test a move's gain under each of this many recent steps' loads.
LOAD_SAMPLE_STEPS = 8
#: Loads within this of a no-op decision's from counters repeat it: skipped at the cost of a comparison.
LOAD_TOLERANCE = 0.01

PEER_REQUEST = "peer request"  # the reason of a rank that profiled only because another rank asked
#: the reason of the profile that rank speeds are measured against when nothing else profiled first
REFERENCE_PROFILE = "rank speeds: a reference profile (no layer work measured yet)"


@dataclass(frozen=True)
class StepActions:
    counters: str | None = None  # decide now from load counters, with this reason
    profile: str | None = None  # profile this step per layer, with this reason
    skipped: tuple[tuple[str, str], ...] = ()  # (trigger, why it was skipped) to record


def _speeds_only(reason: str) -> bool:
    """The speed watch's reason alone (no request, event or imbalance beside it)."""
    return reason.startswith(DRIFT_REASON) and "; " not in reason


def _same_way(a: tuple[int, float] | None, b: tuple[int, float] | None) -> bool:
    """Two drifts (rank, factor) of the same rank in the same direction."""
    return a is not None and b is not None and a[0] == b[0] and (a[1] < 1) == (b[1] < 1)


class RebalanceController:
    def __init__(self, policy: RebalancePolicy, budget: OverheadBudget, repack: int | str) -> None:
        self.policy = policy
        self.budget = budget
        self.repack = repack  # the configured re-pack target ("off", "auto" or a rank count)
        self.migration_cost: float | None = None  # measured seconds of the last rebalance's migration
        self.migration_seconds = 0.0  # all migrations of the run
        self.counter_requests: list[str] = []  # request(..., reprofile=False)
        self.repack_requested: int | str | None = None
        self.profiling_reason: str | None = None
        self.event_noted = False  # a dynamism event was requested since the last profile closed
        self.decide_next = False
        self.profiled_steps = 0  # profiled steps so far in the current window
        self.closed_window_steps = 0  # profiled steps of the window that closed last (its times are their mean)
        self.load_sum: list[float | None] = []  # per-layer load summed over the window
        self.load_at_profile: list[float | None] = []  # the window's mean load (what its times were measured at)
        self.profiled_costs: LayerCosts | None = None
        self.profile_step = -(10**9)
        self.layer_load: list[float | None] = []  # the last step's load factors
        self.smoothed_load: list[float | None] | None = None  # their moving average (what decisions use)
        self.recent_loads: deque[list[float | None]] = deque(maxlen=LOAD_SAMPLE_STEPS)  # per step, newest last
        self.rank_busy: list[float] = []
        self.rank_wall: list[float] = []
        self._skip_noted = False  # a skip was recorded since the last decision
        # (profile step, loads, speeds) of a counter decision that changed nothing
        self._unmoved: tuple[int, list[float | None], tuple[float, ...] | None] | None = None

    # ------------------------------------------------------------------ requests
    @property
    def rebalancing(self) -> bool:
        """Whether the policy ever rebalances (``never`` keeps the partition; re-packing still runs)."""
        return self.policy.rebalances

    def request(self, reason: str, reprofile: bool = True) -> bool:
        """Note a rebalance request; ``False``: ignored (``rebalance="never"``)."""
        if not self.rebalancing:
            return False
        if reprofile:
            self.policy.request(str(reason))
            self.event_noted = True
        else:
            self.counter_requests.append(str(reason))
        return True

    def request_repack(self, target: int | str) -> None:
        self.repack_requested = target

    def take_repack(self) -> int | str | None:
        target, self.repack_requested = self.repack_requested, None
        return target

    def repack_target(self, requested: int | str | None) -> int | str:
        """What to pack onto after a profile: the (agreed) request, else the configured target."""
        return requested if requested is not None else self.repack

    @property
    def profiling(self) -> bool:
        return self.profiling_reason is not None

    @property
    def in_profile_window(self) -> bool:
        return self.profiled_steps > 0 and not self.decide_next

    # ------------------------------------------------------------------ per step
    def profile_closed(self) -> str | None:
        """Before a step: the reason to decide on the profile window that just ended (``None``:
        none ended). Inside a window, keeps the reason (a peer may have started it)."""
        if self.decide_next:
            self.decide_next = False
            self.closed_window_steps, self.profiled_steps = self.profiled_steps, 0
            reason, self.profiling_reason = self.profiling_reason or PEER_REQUEST, None
            return reason
        if self.profiled_steps:
            self.profiling_reason = self.profiling_reason or PEER_REQUEST
        return None

    def plan(self, step: int, decided: bool, reference: bool = False) -> StepActions:
        """What this step does besides a decision on a closed profile (``decided``). ``reference``:
        rank speeds need work to measure busy times against and none was profiled yet, so this
        step profiles if nothing else asks it to (once: the profile becomes the reference). A
        balanced start never trips ``auto``'s imbalance trigger, so without it the first profile
        would come only after a slowdown, and the slow rank's layers would look heavy."""
        if self.counter_requests and not self.policy.rebalances:
            self.counter_requests.clear()
        reasons = []
        if self.counter_requests:
            reasons.append("counters: " + "; ".join(dict.fromkeys(self.counter_requests)))
            self.counter_requests.clear()
        policy_reason = self.policy.profile_reason(step)
        event = policy_reason is not None and policy_reason.startswith("event:")
        if event:
            self.budget.structural()
        if policy_reason:
            reasons.append(policy_reason)
        if reference and not reasons and self.policy.rebalances and not self.profiled_steps:
            reasons.append(REFERENCE_PROFILE)
        reason = "; ".join(reasons) or None
        counters, skipped = None, []
        if reason and self.can_decide_from_counters(step, reason):
            speeds_only = _speeds_only(reason)
            how = "known work at the measured speeds" if speeds_only else "load counters"
            # a speed drift's decision measures nothing and fires once per drift (the watch rebases
            # on each decision), so the budget, spent on measuring, does not hold it back
            why = None if speeds_only else self._refusal(step, "counters")
            if why:
                skipped.append((f"{reason} ({how})", why))
            elif not decided:  # (a decision was just taken on a fresh profile: nothing to add)
                counters = f"{reason} ({how})"
            reason = None
        elif reason:
            if self.profiled_costs is not None and not loads_near_profile(self._loads_now(), self.load_at_profile):
                reason += " (layer loads left the profiled band: re-profiling)"
            why = None if event else self._refusal(step, "profile")
            if why:
                skipped.append((reason, why))
                reason = None
        if self.repack_requested is not None:
            self.budget.structural()
            reason = "; ".join(r for r in (reason, f"repack to {self.repack_requested}") if r)
        self.profiling_reason = reason
        if skipped and self._skip_noted:
            skipped = []  # one record per run of skips: the first says why
        self._skip_noted = self._skip_noted or bool(skipped)
        return StepActions(counters=counters, profile=reason, skipped=tuple(skipped))

    def _unchanged_refusal(self) -> str | None:
        """A decision from counters on the same profile and (within ``LOAD_TOLERANCE``) the same
        loads as the last one, which changed nothing, would change nothing: one comparison."""
        if self._unmoved is None or self._unmoved[0] != self.profile_step or self._unmoved[2] != self.rank_speed:
            return None
        then = self._unmoved[1]
        now = self.smoothed_load or []
        # (b is not None follows from a is not None once the first test failed: it narrows b)
        if len(then) != len(now) or any((a is None) != (b is None)
                                        or (a is not None and b is not None and abs(a - b) > LOAD_TOLERANCE)
                                        for a, b in zip(then, now)):
            return None
        return f"skipped: layer loads within {LOAD_TOLERANCE} of the last decision from counters, which changed nothing"

    def _refusal(self, step: int, action: str) -> str | None:
        """Only what ``auto`` starts by itself is weighed against the budget and the back-off
        (an infinite budget: nothing is)."""
        if self.policy.rebalance is not Rebalance.AUTO or math.isinf(self.budget.overhead_budget):
            return None
        return (self._unchanged_refusal() if action == "counters" else None) or self.budget.refusal(step, action)

    def after_step(self, step: int, profiled: bool, rank_busy: list[float], rank_wall: list[float],
                   layer_load: list[float | None], rank_work: list[float] | None = None) -> None:
        """The step's shared statistics (``profiled``: some rank profiled layers). ``rank_work``:
        per pipeline rank, the work its layers hold (:func:`~lightning_dynmo.plan.speed.rank_work`
        on the current work costs, scaled by the loads); with it each unprofiled step's busy times
        give the ranks' speeds (:func:`~lightning_dynmo.plan.speed.speeds_from_busy`: a profiled
        step's busy time carries the profiler's hooks), which ``auto`` watches for a straggler."""
        self.rank_busy, self.rank_wall = list(rank_busy), list(rank_wall)
        if profiled:  # the profile window's mean load is what its times were measured at
            self.profiled_steps += 1
            if self.profiled_steps == 1:
                self.load_sum = list(layer_load)
            else:
                self.load_sum = [None if n is None or t is None else n + t for n, t in zip(layer_load, self.load_sum)]
            self.load_at_profile = [None if t is None else t / self.profiled_steps for t in self.load_sum]
        self.decide_next = profiled and self.profiled_steps >= self.policy.profile_steps
        self.layer_load = list(layer_load)
        self.recent_loads.append(list(layer_load))
        self.smoothed_load = smooth_load(self.smoothed_load, layer_load, self.policy.ema_decay)
        self.policy.observe_busy(rank_busy)
        if rank_work is not None and not profiled and len(rank_work) == len(rank_busy):
            self.policy.observe_speeds(speeds_from_busy(rank_busy, rank_work, to=None))
        self.budget.observe_step(step, max(rank_wall) if rank_wall else 0.0, profiled)

    # ------------------------------------------------------------------ decisions
    @property
    def rank_speed(self) -> tuple[float, ...] | None:
        """Per-pipeline-rank speeds to balance for (fastest 1.0; None: no estimate yet)."""
        return self.policy.speed_estimate

    def take_event(self, reason: str) -> bool:
        """Whether the profile closing now may have measured layers a dynamism event changed (this
        rank's view: its reason, or a request since the last close; agree it over the ranks)."""
        noted, self.event_noted = self.event_noted, False
        return noted or "event:" in reason

    def profile_speeds(self, estimate: tuple[float, ...] | None) -> tuple[float, ...] | None:
        """Per-pipeline-rank speeds a decision on the profile closing now balances for, and that
        its measured times are turned into work with. ``estimate``: the profile's own
        (:func:`~lightning_dynmo.plan.speed.estimate_speeds` against the last work; None without
        one, e.g. after a dynamism event: the speeds from before it stand). It is taken only when
        it drifted beyond the watch's tolerance from the speeds the partition was balanced for and
        the busy-time estimates drifted the same way (the same rank, slower or faster): their
        median, or, for a drift beyond the square of the tolerance, the last unprofiled step's
        alone. One profile's noise (a rank holding one small layer has one noisy ratio) or one
        step's moves nothing, and ranks alike stay exactly alike (``None``); a large slowdown is
        caught at the first decision, whatever its trigger, before the median has turned.
        Taken, the watch restarts on it (its recent estimates were at the old speeds)."""
        watch = self.policy.speed_watch
        drift = watch.drift_of(estimate) if estimate is not None else None
        if drift is not None and (_same_way(drift, watch.drift()) or (
                abs(math.log(drift[1])) > 2 * math.log1p(watch.tolerance)
                and _same_way(drift, watch.drift_of(watch.latest) if watch.latest is not None else None))):
            assert estimate is not None  # a drift is found only on an estimate
            watch.restart(normalise_speeds(estimate))
        return self.rank_speed

    def profiled(self, step: int, costs: LayerCosts) -> None:
        """The merged costs of the profile window that closed at ``step``."""
        self.profiled_costs, self.profile_step = costs, step

    def decided(self, step: int, applied: bool, left: Partition | None = None, cost: float = 0.0,
                counters: bool = False) -> None:
        """A rebalance decision's outcome (``cost``: the seconds it took, migration included;
        ``counters``: it was taken from load counters)."""
        self._unmoved = (self.profile_step, list(self.smoothed_load or []), self.rank_speed) \
            if counters and not applied else None
        self.policy.decided(step, applied=applied, left=left)
        self.budget.decided(step, applied, cost)
        self._skip_noted = False

    def expected_migration_cost(self) -> float:
        """What ``auto`` weighs a move against: the last rebalance's measured migration (plus its
        decision); before any, one step's wall time."""
        if self.migration_cost is not None:
            return self.migration_cost
        return max(self.rank_wall) if self.rank_wall else 0.0

    def migrated(self, seconds: float, cost: float | None = None) -> None:
        """A migration took ``seconds`` (agreed); ``cost``: what the next move is to be weighed
        against (a rebalance's; a re-pack's leaves it)."""
        self.migration_seconds += seconds
        if cost is not None:
            self.migration_cost = cost

    def repacked(self, step: int, ranks: int | None = None) -> None:
        """A re-pack onto ``ranks`` pipeline ranks was applied: the ranks that stay keep their speeds."""
        speeds = self.rank_speed
        if ranks is not None and speeds is not None and len(speeds) >= ranks:
            self.policy.speed_watch.restart(normalise_speeds(speeds[:ranks]))
        self.policy.applied(step)  # a re-pack changes the rank count: nothing to undo
        self.budget.structural()
        self._skip_noted = False

    def charge(self, step: int, seconds: float, source: str) -> None:
        self.budget.charge(step, seconds, source)

    # ------------------------------------------------------------------ decisions from load counters
    def can_decide_from_counters(self, step: int, reason: str) -> bool:
        """Layers that report their load (MoE, MoD, sparse attention, early exit) let the policy
        decide without a profiled step: the last profile scaled by the step's load factors
        (c_i = r_i t_i). So does a rank whose speed drifted alone (the speed watch's reason): the
        layers' work is what the last profile measured, and the speeds come from busy times at no
        cost, so the decision balances that work for them. A dynamism *event* (e.g. freezing
        changes what a layer computes), a profile older than ``REPROFILE_STEPS`` and loads that
        moved beyond the band where scaling is credible
        (:func:`~lightning_dynmo.plan.measurements.loads_near_profile`) still take a fresh profile."""
        return (
            self.profiled_costs is not None
            and (any(x is not None for x in self.layer_load) or _speeds_only(reason))
            and "event:" not in reason
            and step - self.profile_step < REPROFILE_STEPS
            and loads_near_profile(self._loads_now(), self.load_at_profile)
        )

    def counter_costs(self) -> LayerCosts:
        """The last profiled costs scaled to the layers' smoothed load factors (same on every rank)."""
        assert self.profiled_costs is not None, "counter_costs() needs a profile (can_decide_from_counters)"
        return scale_by_load(self.profiled_costs, self._loads_now(), self._at_profile())

    def load_cost_samples(self) -> list[LayerCosts]:
        """The last profiled costs under each recent step's own load factors: how much a move's
        predicted gain varies from step to step (see :func:`~lightning_dynmo.plan.policy.refusal_unless_gain_clear`).
        Empty when no layer reports its load (nothing varies that a profile does not show)."""
        if self.profiled_costs is None or not any(x is not None for loads in self.recent_loads for x in loads):
            return []
        at_profile = self._at_profile()
        return [scale_by_load(self.profiled_costs, loads, at_profile) for loads in self.recent_loads]

    def _loads_now(self) -> list[float | None]:
        """The smoothed load factors, which are set once a profile is in: its window closes only after
        :meth:`after_step` (which sets them) saw its profiled steps. Callers check ``profiled_costs``."""
        assert self.smoothed_load is not None, "a profile closes only after after_step set the loads"
        return self.smoothed_load

    def _at_profile(self) -> list[float | None]:
        assert self.profiled_costs is not None, "load factors at the profile need a profile"
        n = self.profiled_costs.num_layers
        return [self.load_at_profile[i] if i < len(self.load_at_profile) else None for i in range(n)]
