"""What DynMo's own work costs, and whether it may spend more: the overhead budget, the back-off
and the payback of applied decisions (pure).

A user who turns DynMo on for a model it cannot help must lose (almost) nothing. Every source of
overhead is charged here in seconds every rank agrees on: profiled steps (their wall time above
the unprofiled steps'), decisions on a profile (gathering the costs, balancing, the determinism
check, recording) and decisions from load counters. Three rules follow:

* **budget**: over the last ``window`` steps the optional work (what the ``auto`` policy starts
  by itself) may cost at most ``overhead_budget`` of the window's training time, plus the measured
  saving of the last applied decision over the window when it paid for itself;
* **payback**: an applied decision is judged by the step time it left behind: the mean of
  ``payback_steps`` unprofiled steps after it against the same before it. Until measured, it
  gets the benefit of the doubt (no budget limit);
* **back-off**: each optional decision that changed nothing doubles the wait before the next
  one (capped at ``max_backoff`` steps); an applied decision or a structural event (freezing,
  pruning, a re-pack, a callback's request to re-profile) resets it.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

#: Kinds of overhead, as charged and reported.
SOURCES = ("profiling", "decision", "counters")
#: What an optional action is expected to cost: the sources it charges.
ACTION_SOURCES = {"profile": ("profiling", "decision"), "counters": ("counters",)}


@dataclass
class Payback:
    """Step time after vs before one applied decision (seconds per step)."""

    step: int
    before: float
    cost: float  # seconds the decision cost: its overhead and migration
    after: list[float] = field(default_factory=list)
    gain: float | None = None  # before - mean(after), once measured

    @property
    def measured(self) -> bool:
        return self.gain is not None

    def paid(self, window: int) -> bool:
        """Measured, and its saving over ``window`` steps is more than it cost."""
        return self.gain is not None and self.gain > 0 and self.gain * window > self.cost

    def to_record(self, window: int) -> dict[str, float | bool | None]:
        after = statistics.fmean(self.after) if self.after else None
        return {"step": self.step, "step_ms_before": round(self.before * 1e3, 3),
                "step_ms_after": None if after is None else round(after * 1e3, 3),
                "gain": None if self.gain is None or self.before <= 0 else round(self.gain / self.before, 4),
                "cost_ms": round(self.cost * 1e3, 3), "paid": self.paid(window) if self.measured else None}


@dataclass(kw_only=True)
class OverheadBudget:
    overhead_budget: float  # the option of that name: share of the window's training time (inf: no limit)
    window: int = 100  # steps (PipelineOptions.budget: max(100, rebalance_horizon))
    payback_steps: int = 5
    max_backoff: int = 128  # steps
    # state
    walls: deque[tuple[int, float]] = field(default_factory=deque)  # (step, wall seconds) of the last `window` steps
    # (step, seconds, source) of the last `window` steps
    charges: deque[tuple[int, float, str]] = field(default_factory=deque)
    clean: deque[float] = field(default_factory=lambda: deque(maxlen=16))  # recent unprofiled step walls
    totals: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0.0))  # whole run, per source
    train_seconds: float = 0.0  # whole run
    estimates: dict[str, float] = field(default_factory=dict)  # source -> moving average of one charge
    noops: int = 0  # optional decisions in a row that changed nothing
    next_allowed: int = -(10**9)
    paybacks: list[Payback] = field(default_factory=list)

    def __post_init__(self) -> None:
        budget = self.overhead_budget
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget >= 0:
            raise ValueError(f"overhead_budget must be a fraction >= 0 of the training time (e.g. 0.01), "
                             f"got {self.overhead_budget!r}")
        for name in ("window", "payback_steps", "max_backoff"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"overhead budget {name} must be a positive integer, got {v!r}")

    # ------------------------------------------------------------------ what happened
    def baseline(self) -> float | None:
        """An unprofiled step's wall seconds (median of the recent ones)."""
        return statistics.median(self.clean) if self.clean else None

    def observe_step(self, step: int, wall: float, profiled: bool) -> None:
        """One training step's wall seconds (agreed by every rank); a profiled step is charged
        what it took above an unprofiled one."""
        base = self.baseline()
        self.walls.append((step, wall))
        self.train_seconds += wall
        if profiled:
            if base is not None:
                self.charge(step, max(0.0, wall - base), "profiling")
        else:
            self.clean.append(wall)
            pending = self.paybacks[-1] if self.paybacks else None
            if pending is not None and not pending.measured and step >= pending.step:
                pending.after.append(wall)
                if len(pending.after) >= self.payback_steps:
                    pending.gain = pending.before - statistics.fmean(pending.after)
        self._forget(step)

    def charge(self, step: int, seconds: float, source: str) -> None:
        if source not in SOURCES:
            raise ValueError(f"unknown overhead source {source!r}; valid: {', '.join(SOURCES)}")
        seconds = max(0.0, float(seconds))
        self.charges.append((step, seconds, source))
        self.totals[source] += seconds
        old = self.estimates.get(source)
        self.estimates[source] = seconds if old is None else 0.5 * old + 0.5 * seconds
        self._forget(step)

    def _forget(self, step: int) -> None:
        for q in (self.walls, self.charges):
            while q and q[0][0] <= step - self.window:
                q.popleft()

    # ------------------------------------------------------------------ decisions
    def decided(self, step: int, applied: bool, cost: float = 0.0) -> None:
        """An optional decision's outcome: an applied one resets the back-off and starts its
        payback measurement; one that changed nothing backs off."""
        if applied:
            self.noops, self.next_allowed = 0, -(10**9)
            before = statistics.fmean(list(self.clean)[-self.payback_steps:]) if self.clean else 0.0
            self.paybacks.append(Payback(step=step, before=before, cost=cost))
            return
        self.noops += 1
        wait = 0 if self.noops < 2 else min(self.max_backoff, 2 ** (self.noops - 1))
        self.next_allowed = step + wait

    def structural(self) -> None:
        """Freezing, pruning, a re-pack or a callback's request: what layers compute changed, so
        decisions that changed nothing before may now (re-arms the back-off)."""
        self.noops, self.next_allowed = 0, -(10**9)

    # ------------------------------------------------------------------ the rules
    def spent(self) -> float:
        return sum(s for _, s, _ in self.charges)

    def window_seconds(self) -> float:
        return sum(w for _, w in self.walls)

    def allowance(self) -> float:
        """Seconds of optional overhead the window may hold (inf while the last applied decision's
        payback is still being measured)."""
        last = self.paybacks[-1] if self.paybacks else None
        if last is not None and not last.measured:
            return float("inf")
        if not self.walls:
            return float("inf")
        allowed = self.overhead_budget * self.window_seconds()  # what ran so far, not a full window's worth
        if last is not None and last.paid(self.window):
            assert last.gain is not None  # paid() holds only once the gain is measured
            allowed += last.gain * self.window
        return allowed

    def estimate(self, action: str) -> float:
        return sum(self.estimates.get(s, 0.0) for s in ACTION_SOURCES[action])

    def refusal(self, step: int, action: str) -> str | None:
        """Why an optional ``action`` (``"profile"`` or ``"counters"``) is not taken at ``step``
        (``None``: it may be). The back-off costs one comparison."""
        if step < self.next_allowed:
            return (f"skipped: back-off, {self.noops} decisions in a row changed nothing; next one at step "
                    f"{self.next_allowed} at the earliest")
        allowed = self.allowance()
        spent, need = self.spent(), self.estimate(action)
        if spent + need > allowed:
            return (f"skipped: overhead budget, {spent * 1e3:.1f} ms spent + {need * 1e3:.1f} ms for this {action} "
                    f"> {allowed * 1e3:.1f} ms allowed over the last {self.window} steps "
                    f"({self.overhead_budget:.1%} of their training time, "
                    "plus the saving of the last applied decision if it paid)")
        return None

    # ------------------------------------------------------------------ reporting
    def overhead_fraction(self) -> float:
        """Overhead over the window's training time (what ``rebalance/overhead_fraction`` logs)."""
        total = self.window_seconds()
        return self.spent() / total if total > 0 else 0.0

    def summary(self) -> dict[str, Any]:  # a JSON record, like Decision.to_record
        spent = sum(self.totals.values())
        return {"overhead_s": round(spent, 4), "train_s": round(self.train_seconds, 4),
                "overhead_fraction": round(spent / self.train_seconds, 5) if self.train_seconds > 0 else None,
                "overhead_s_by_source": {k: round(v, 4) for k, v in self.totals.items()},
                "applied_decisions": [p.to_record(self.window) for p in self.paybacks]}
