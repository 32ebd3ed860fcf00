"""When to rebalance: the policy, a small state machine fed with numbers every rank agrees on.

Algorithm 1 of the DynMo paper: after a trigger, profile the next step per layer, then balance
and migrate before the step after it. Triggers:

* ``never``;
* ``every_n``: every ``interval`` steps;
* ``on_event``: a callback called ``strategy.request_rebalance(reason)``;
* ``auto``: the per-rank busy time (measured every step at no extra communication) shows an
  imbalance ``(max - min) / mean`` above ``threshold``; the new partition is applied only if the
  predicted saving over ``horizon`` steps exceeds the measured cost of migrating.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .cost_model import imbalance

MODES = ("never", "every_n", "on_event", "auto")


@dataclass
class RebalancePolicy:
    mode: str = "never"
    interval: int = 50
    threshold: float = 0.1
    horizon: int = 100
    cooldown: int = 10
    ema_decay: float = 0.7
    # state
    last_rebalance_step: int = -(10**9)
    ema_busy: list[float] | None = None
    pending_reasons: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown rebalance mode {self.mode!r}; valid modes: {', '.join(MODES)}")
        for name in ("interval", "horizon"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"rebalance {name} must be a positive integer, got {v!r}")
        if not (isinstance(self.cooldown, int) and self.cooldown >= 0):
            raise ValueError(f"rebalance cooldown must be a non-negative integer, got {self.cooldown!r}")
        if not self.threshold >= 0:
            raise ValueError(f"imbalance threshold must be >= 0, got {self.threshold!r}")
        if not 0 <= self.ema_decay < 1:
            raise ValueError(f"ema_decay must be in [0, 1), got {self.ema_decay!r}")

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

    def profile_reason(self, step: int) -> str | None:
        """Why this step should be profiled per layer (None: it should not)."""
        if self.mode == "never":
            self.pending_reasons.clear()
            return None
        if self.pending_reasons:
            reason = "event: " + "; ".join(dict.fromkeys(self.pending_reasons))
            self.pending_reasons.clear()
            return reason
        if self.mode == "every_n" and step % self.interval == self.interval - 1:
            return f"every {self.interval} steps"
        if self.mode == "auto" and self.ema_busy and step - self.last_rebalance_step >= self.cooldown:
            imb = imbalance(self.ema_busy)
            if imb > self.threshold:
                return f"auto: busy-time imbalance {imb:.2f} > {self.threshold:.2f}"
        return None

    def accept(self, predicted_now: float, predicted_new: float, migration_cost: float) -> tuple[bool, str]:
        """Whether to apply a new partition (only ``auto`` weighs gain against cost)."""
        gain = predicted_now - predicted_new
        if self.mode != "auto":
            return True, f"mode {self.mode}"
        if gain * self.horizon > migration_cost:
            return True, f"gain {gain * 1e3:.2f} ms/step x {self.horizon} > cost {migration_cost * 1e3:.1f} ms"
        return False, f"gain {gain * 1e3:.2f} ms/step x {self.horizon} <= cost {migration_cost * 1e3:.1f} ms"

    def applied(self, step: int) -> None:
        self.last_rebalance_step = step
        self.ema_busy = None

