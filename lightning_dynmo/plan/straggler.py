"""When a rank's speed has drifted from the one the partition was balanced for (pure).

A rank that slows down with no dynamism event (same layers, more time: a throttled or shared
device) shows up only in its own busy time. :class:`SpeedWatch` follows the per-rank speed
estimates (:mod:`lightning_dynmo.plan.speed`), smoothed, and says when some rank's speed relative
to the fastest differs from the one the current partition was balanced for by more than a factor
``1 + tolerance``, either way (a slowdown, or the recovery from one), on ``confirm_steps``
consecutive steps. A decision (applied or not) rebases it on the speeds it was taken for, so it
fires again only after a further drift of the same size: the hysteresis.

Why jitter cannot fire it: if every rank's estimate stays within ``[1 - j, 1 + j]`` of its true
speed, the smoothed estimates (an average of them) do too, and so does the reference the partition
was balanced for; a relative speed (over the fastest) then moves by at most a factor
``(1 + j) / (1 - j)`` between the two, 1.22 for j = 10 %. The default tolerance of 0.3 therefore
never fires on a +-10 % jitter (nor on anything below +-13 %), whatever its pattern, while a drop to
half speed (a factor 2) fires within a few steps.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from .speed import normalise_speeds


@dataclass
class SpeedWatch:
    tolerance: float = 0.3  # fire beyond a factor 1 + tolerance between the relative speeds
    confirm_steps: int = 2  # ... on this many consecutive steps
    ema_decay: float = 0.7  # smoothing of the estimates (decay x previous + the rest x now)
    # state
    balanced_for: tuple[float, ...] | None = None  # relative speeds the partition was balanced for
    smoothed: list[float] | None = None
    streak: int = 0
    _drift: tuple[int, float] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        t = self.tolerance
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and t > 0):
            raise ValueError(f"speed tolerance must be a finite number > 0, got {t!r}")
        c = self.confirm_steps
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            raise ValueError(f"confirm_steps must be an int >= 1, got {c!r}")
        if not 0 <= self.ema_decay < 1:
            raise ValueError(f"ema_decay must be in [0, 1), got {self.ema_decay!r}")

    @property
    def estimate(self) -> tuple[float, ...] | None:
        """The smoothed speeds, normalised (fastest 1.0): what to balance for now."""
        return None if self.smoothed is None else normalise_speeds(self.smoothed)

    def observe(self, speeds: Sequence[float]) -> None:
        """One step's per-pipeline-rank speed estimates. A change in the rank count (re-packing)
        starts over, balanced for the first estimate it sees."""
        now = list(normalise_speeds(speeds))
        if self.smoothed is None or len(self.smoothed) != len(now):
            self.smoothed, self.streak = now, 0
            if self.balanced_for is None or len(self.balanced_for) != len(now):
                self.balanced_for = tuple(1.0 for _ in now)  # what a partition balanced without speeds assumed
        else:
            d = self.ema_decay
            self.smoothed = [d * a + (1 - d) * b for a, b in zip(self.smoothed, now)]
        self._drift = self.drift()
        self.streak = self.streak + 1 if self._drift is not None else 0

    def drift(self) -> tuple[int, float] | None:
        """``(rank, factor)`` of the rank whose relative speed moved most since the partition was
        balanced (``factor`` = now / then, below 1 for a slowdown), if beyond the tolerance."""
        if self.smoothed is None or self.balanced_for is None:
            return None
        now, then = normalise_speeds(self.smoothed), normalise_speeds(self.balanced_for)
        rank = max(range(len(now)), key=lambda r: abs(math.log(now[r] / then[r])))
        factor = now[rank] / then[rank]
        return (rank, factor) if abs(math.log(factor)) > math.log1p(self.tolerance) else None

    def reason(self) -> str | None:
        """Why to rebalance now (None: not yet): a drift held for ``confirm_steps`` steps."""
        if self.streak < self.confirm_steps or self._drift is None:
            return None
        rank, factor = self._drift
        return (f"auto: pipeline rank {rank} runs at {factor:.2f}x the relative speed the partition was balanced for "
                f"(beyond 1/{1 + self.tolerance:.2f}..{1 + self.tolerance:.2f})")

    def rebase(self, speeds: Sequence[float] | None = None) -> None:
        """A decision was taken for ``speeds`` (default: the current estimate): drift is measured
        from them now."""
        base = speeds if speeds is not None else self.smoothed
        if base is not None:
            self.balanced_for = normalise_speeds(base)
        self.streak, self._drift = 0, None
