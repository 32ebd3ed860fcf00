"""When and whether to rebalance: the policy, and ``decide`` which turns costs into a Decision.

Algorithm 1 of the DynMo paper: after a trigger, profile the next step per layer, then balance
and migrate before the step after it. Triggers:

* ``never``;
* ``every_n``: every ``rebalance_interval`` steps;
* ``on_event``: a callback called ``strategy.pipeline.request_rebalance(reason)``;
* ``auto``: the per-rank busy time (measured every step at no extra communication) shows an
  imbalance ``(max - min) / mean`` above ``imbalance_threshold``; the new partition is applied only
  if the predicted saving over ``rebalance_horizon`` steps exceeds the measured cost of migrating.

Every decision starts the ``rebalance_cooldown`` (no ``auto`` profiling for that many steps), applied or
not. A decision that changed nothing (refused by the cost/benefit check, or "already balanced")
also disarms ``auto`` with hysteresis: it fires again only once the imbalance has grown beyond
``(1 + rebalance_hysteresis)`` x the level that was just judged not worth acting on, or after it has fallen
below ``(1 - rebalance_hysteresis)`` x ``imbalance_threshold`` (the pipeline became balanced, then drifted again).
An imbalance hovering at the threshold therefore costs one profiled decision, not one per cooldown.
``auto`` also fires when a rank's speed drifted from the one the partition was balanced for
(:class:`~lightning_dynmo.plan.straggler.SpeedWatch`, fed by :meth:`RebalancePolicy.observe_speeds`;
every decision rebases it); without speed estimates it never does.

Everything here works on numbers every rank agrees on, so every rank decides the same.
"""
from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from .balancers import BalanceProblem, InfeasiblePartitionError, get_balancer
from .cost_model import CostModel, LayerCosts, imbalance
from .decision import Decision
from .partition import Partition
from .straggler import SpeedWatch
from .validation import enum_value, non_negative_int, positive_int


class Rebalance(StrEnum):
    """When to rebalance: the ``rebalance`` option (its values are the strings users write)."""

    AUTO = "auto"
    ON_EVENT = "on_event"
    EVERY_N = "every_n"
    NEVER = "never"


@dataclass(kw_only=True)
class RebalancePolicy:
    """The ``rebalance*`` options (named as in ``PipelineOptions``, which holds their defaults and
    builds this with :meth:`PipelineOptions.policy`) plus the state that decides when to act."""

    rebalance: Rebalance
    rebalance_interval: int
    imbalance_threshold: float
    rebalance_horizon: int
    rebalance_cooldown: int
    rebalance_hysteresis: float
    profile_steps: int  # consecutive steps one profile spans (per-layer means over them)
    ema_decay: float = 0.7  # smoothing of busy times (auto) and of layer load factors (counter decisions)
    # state
    last_rebalance_step: int = -(10**9)  # last applied decision
    last_decision_step: int = -(10**9)  # last decision of any outcome (starts the cooldown)
    disarmed_at: float | None = None  # imbalance judged not worth acting on (None: armed)
    ema_busy: list[float] | None = None
    pending_reasons: list[str] = field(default_factory=list)
    left_at: dict[Partition, int] = field(default_factory=dict)  # partitions applied decisions left, and when
    left_for: dict[Partition, tuple[float, ...] | None] = field(default_factory=dict)  # ... the speeds it was left for
    speed_watch: SpeedWatch = field(default_factory=SpeedWatch)  # rank speeds vs those last balanced for

    def __post_init__(self) -> None:
        self.rebalance = enum_value("rebalance", Rebalance, self.rebalance)
        positive_int("rebalance_interval", self.rebalance_interval)
        positive_int("rebalance_horizon", self.rebalance_horizon)
        non_negative_int("rebalance_cooldown", self.rebalance_cooldown)
        positive_int("profile_steps", self.profile_steps)
        if not self.imbalance_threshold >= 0:
            raise ValueError(f"imbalance_threshold must be >= 0, got {self.imbalance_threshold!r}")
        h = self.rebalance_hysteresis
        if isinstance(h, bool) or not isinstance(h, (int, float)) or not 0 <= h < 1:
            raise ValueError(f"rebalance_hysteresis must be in [0, 1), got {h!r}")
        if not 0 <= self.ema_decay < 1:
            raise ValueError(f"ema_decay must be in [0, 1), got {self.ema_decay!r}")

    @property
    def rebalances(self) -> bool:
        """Whether this policy ever moves layers (``never`` keeps the partition; re-packing still runs)."""
        return self.rebalance is not Rebalance.NEVER

    def request(self, reason: str) -> None:
        self.pending_reasons.append(reason)

    def observe_busy(self, busy: list[float]) -> float:
        """Feed per-pipeline-rank busy seconds of the last step; returns the smoothed imbalance."""
        if self.ema_busy is None or len(self.ema_busy) != len(busy):
            self.ema_busy = list(busy)
        else:
            d = self.ema_decay
            self.ema_busy = [d * a + (1 - d) * b for a, b in zip(self.ema_busy, busy)]
        return imbalance(self.ema_busy)

    def observe_speeds(self, speeds: Sequence[float]) -> None:
        """Feed per-pipeline-rank speed estimates of the last step (:mod:`~lightning_dynmo.plan.speed`)."""
        self.speed_watch.observe(speeds)

    @property
    def speed_estimate(self) -> tuple[float, ...] | None:
        """Per-pipeline-rank speeds (fastest 1.0) a decision now balances for
        (:attr:`~lightning_dynmo.plan.straggler.SpeedWatch.for_balancing`); None before any estimate."""
        return self.speed_watch.for_balancing

    def profile_reason(self, step: int) -> str | None:
        """Why this step should be profiled per layer (None: it should not)."""
        if not self.rebalances:
            self.pending_reasons.clear()
            return None
        if self.pending_reasons:
            reason = "event: " + "; ".join(dict.fromkeys(self.pending_reasons))
            self.pending_reasons.clear()
            return reason
        if self.rebalance is Rebalance.EVERY_N and step % self.rebalance_interval == self.rebalance_interval - 1:
            return f"every {self.rebalance_interval} steps"
        if self.rebalance is not Rebalance.AUTO:
            return None
        imb = imbalance(self.ema_busy) if self.ema_busy else None
        if imb is not None and self.disarmed_at is not None and \
                imb < self.imbalance_threshold * (1 - self.rebalance_hysteresis):
            self.disarmed_at = None  # balanced again: re-arm
        # A confirmed speed drift waits out the cooldown of a move only: its decision profiles
        # nothing and the watch fires once per drift, so a decision that changed nothing (which
        # rebased the watch) has nothing to hold back, and a recovery is not delayed by it.
        if step - self.last_rebalance_step >= self.rebalance_cooldown:
            drifted = self.speed_watch.reason()
            if drifted is not None:  # a rank's speed explains the imbalance: the decision needs no new profile
                return drifted
        if step - max(self.last_rebalance_step, self.last_decision_step) < self.rebalance_cooldown:
            return None
        if imb is None:
            return None
        if self.disarmed_at is None:
            return f"auto: busy-time imbalance {imb:.2f} > {self.imbalance_threshold:.2f}" \
                if imb > self.imbalance_threshold else None
        if imb > max(self.imbalance_threshold, self.disarmed_at * (1 + self.rebalance_hysteresis)):
            return (f"auto: busy-time imbalance {imb:.2f} grew beyond {self.disarmed_at:.2f} x "
                    f"{1 + self.rebalance_hysteresis:.2f}")
        return None

    def accept(self, predicted_now: float, predicted_new: float, migration_cost: float) -> tuple[bool, str]:
        """Whether to apply a new partition (only ``auto`` weighs gain against cost)."""
        gain = predicted_now - predicted_new
        if self.rebalance is not Rebalance.AUTO:
            return True, f"mode {self.rebalance}"
        if gain * self.rebalance_horizon > migration_cost:
            return True, (f"gain {gain * 1e3:.2f} ms/step x {self.rebalance_horizon} > "
                          f"cost {migration_cost * 1e3:.1f} ms")
        return False, f"gain {gain * 1e3:.2f} ms/step x {self.rebalance_horizon} <= cost {migration_cost * 1e3:.1f} ms"

    def undo_refusal(self, step: int, new: Partition) -> str | None:
        """Why moving to ``new`` at ``step`` is refused (``auto`` only): an applied decision left
        that partition less than ``horizon`` steps ago. That decision was paid for by a saving
        predicted over the horizon; coming back before the horizon is over says the loads it was
        judged on did not last (a per-step signal that flips: a router's or a predictor's noise),
        and the migrations pay for gains that lasted a few steps. ``None``: no recent partition, or
        the ranks' speeds changed since it was left (settled speeds change only beyond the speed
        watch's tolerance: the move back follows a straggler's recovery, not noise)."""
        if self.rebalance is not Rebalance.AUTO or new not in self.left_at:
            return None
        when = self.left_at[new]
        if step - when >= self.rebalance_horizon:
            return None
        if self.left_for.get(new) != _speed_key(self.speed_estimate):
            return None
        return (f"refused: would return to the partition left at step {when}, {step - when} of the "
                f"{self.rebalance_horizon} steps its replacement's saving was predicted over (the loads it was "
                "judged on did not last; raise ema_decay to smooth them more, or lower rebalance_horizon)")

    def applied(self, step: int, left: Partition | None = None) -> None:
        """The partition changed at ``step`` (a rebalance or a re-pack) away from ``left``."""
        self.last_rebalance_step = self.last_decision_step = step
        self.disarmed_at = None
        self.ema_busy = None
        self.speed_watch.moved()
        self.left_at = {p: t for p, t in self.left_at.items() if step - t < self.rebalance_horizon}
        self.left_for = {p: v for p, v in self.left_for.items() if p in self.left_at}
        if left is not None:
            self.left_at[left] = step
            self.left_for[left] = _speed_key(self.speed_estimate)

    def decided(self, step: int, applied: bool, left: Partition | None = None) -> None:
        """Every decision starts the cooldown; one that changed nothing also disarms ``auto``
        until the imbalance grows by ``hysteresis`` or falls below the threshold band. ``left``:
        the partition an applied decision moved away from."""
        if applied:
            self.applied(step, left)
            return
        self.last_decision_step = step
        self.speed_watch.rebase()
        if self.ema_busy:
            self.disarmed_at = max(imbalance(self.ema_busy), self.imbalance_threshold)


def _speed_key(speeds: Sequence[float] | None) -> tuple[float, ...] | None:
    """Speeds as the cost model sees them: None while every rank is alike."""
    return None if speeds is None or all(v == 1.0 for v in speeds) else tuple(speeds)


def decide(
    *,
    step: int,
    reason: str,
    costs: LayerCosts,
    model: CostModel,
    balancer: str,
    current: Partition,
    policy: RebalancePolicy,
    migration_cost: float,
    samples: Sequence[LayerCosts] = (),
    runs_per_step: int = 1,
) -> tuple[Decision, Partition | None]:
    """Balance ``costs`` and weigh the result: ``(decision, new partition or None)``.

    ``migration_cost`` is the measured (or, before the first migration, estimated) seconds a
    migration costs; only the ``auto`` policy weighs it, against the gain over its horizon of
    optimizer steps: ``runs_per_step`` pipeline runs each (``accumulate_grad_batches``), since
    ``costs`` predict one run. ``samples``: the costs under each of
    the last steps' own load factors (decisions from load counters); ``auto`` then moves only if
    the move's gain is clearly positive over them (:func:`refusal_unless_gain_clear`), so a per-step signal
    that is noise (a router's or a predictor's draw) moves nothing however its average looks."""
    if isinstance(runs_per_step, bool) or not isinstance(runs_per_step, int) or runs_per_step < 1:
        raise ValueError(f"runs_per_step must be an int >= 1 (accumulate_grad_batches), got {runs_per_step!r}")
    t0 = time.perf_counter()
    base = Decision(step=step, reason=reason, before=str(current), applied=False, why="", balancer=balancer,
                    speeds=model.speed)
    try:
        result = get_balancer(balancer)(
            BalanceProblem(costs=costs, num_stages=current.num_stages, model=model, current=current)
        )
    except InfeasiblePartitionError as err:
        return base.with_(why=f"refused: {err}"), None
    new = result.partition
    pred_now = model.predicted_step_time(costs, current)
    pred_new = model.predicted_step_time(costs, new)
    decision = base.with_(
        after=str(new),
        rounds=result.rounds,
        decision_ms=(time.perf_counter() - t0) * 1e3,
        predicted_step_before=pred_now,
        predicted_step_after=pred_new,
        imbalance_before=imbalance(model.stage_times(costs, current)),
        imbalance_after=imbalance(model.stage_times(costs, new)),
        bubble_before=model.bubble_fraction(costs, current),
        bubble_after=model.bubble_fraction(costs, new),
    )
    if new == current:
        return decision.with_(why="already balanced"), None
    undo = policy.undo_refusal(step, new)
    if undo:
        return decision.with_(why=undo), None
    unclear = refusal_unless_gain_clear(model, samples, current, new) if policy.rebalance is Rebalance.AUTO else None
    if unclear:
        return decision.with_(why=unclear), None
    accept, why = policy.accept(pred_now * runs_per_step, pred_new * runs_per_step, migration_cost)
    if not accept:
        return decision.with_(why=why), None
    return decision.with_(applied=True, why=why, moved_layers=current.moved_layers(new)), new


def refusal_unless_gain_clear(model: CostModel, samples: Sequence[LayerCosts], current: Partition, new: Partition,
                  z: float = 2.0) -> str | None:
    """Why moving ``current -> new`` is refused (``None``: it is not). The predicted per-step gain
    is computed under each sample's costs (one per recent step); the move must gain on average by
    more than ``z`` standard errors of that mean. With fewer than 2 samples nothing is refused."""
    if len(samples) < 2:
        return None
    gains = [model.predicted_step_time(c, current) - model.predicted_step_time(c, new) for c in samples]
    n = len(gains)
    mean = sum(gains) / n
    se = math.sqrt(sum((g - mean) ** 2 for g in gains) / (n - 1) / n)
    if mean - z * se > 0:
        return None
    return (f"refused: gain {mean * 1e3:.2f} +- {se * 1e3:.2f} ms/step over the last {n} steps' loads is not "
            f"clearly positive ({z:g} standard errors): the loads change from step to step more than the move gains")
