"""When a rank's speed has drifted from the one the partition was balanced for (pure).

A rank that slows down with no dynamism event (same layers, more time: a throttled or shared
device) shows up only in its own busy time. :class:`SpeedWatch` follows per-rank speed estimates
(:mod:`lightning_dynmo.plan.speed`; each rank's is the median of its last ``window`` ones) and says
when some rank's speed relative to the fastest differs from the one the current partition was
balanced for by more than a factor ``1 + tolerance``, either way (a slowdown, or the recovery from
one), on ``confirm_steps`` consecutive steps. A decision (applied or not) rebases it on the speeds
it was taken for (:attr:`SpeedWatch.for_balancing`), so it fires again only after a further drift
of the same size: the hysteresis. Below the tolerance decisions keep balancing for the old speeds.
A profile's own estimate, taken when it drifted as far and the last step's estimate
(:attr:`SpeedWatch.latest`) drifted the same way, restarts the watch on it
(:meth:`SpeedWatch.restart`; see :meth:`~lightning_dynmo.plan.controller.RebalanceController.profile_speeds`).

Why a move is not a drift: busy times hold more than the work measured per layer (chunk
hand-offs, and the boundary layers' shares of them timed where they were profiled), so after
layers move each rank's reading carries another share of that, and a rank left with few layers
reads slower than it is. Compared with the readings before the move, that bias looks like a
drift, and balancing for it moves more layers, which biases further: a feedback loop. So readings
are compared only under one partition: :meth:`SpeedWatch.moved` forgets those before a move and
takes the first window after it as reading the speeds the move balanced for: a per-rank
*calibration*, where the bias exceeds a third of the tolerance (within that, a window's median is noise:
+-10 % jitter moves a median of 5 by ~3 %), kept within the tolerance (a bias larger than that is
taken for a real change). The window is shorter than the default cooldown, so no reaction waits
for it; a real change within it is seen only beyond what the calibration absorbed.

Why jitter does not fire it: on ranks of equal speed whose estimates stay within ``[1 - j, 1 + j]``
of it, every relative speed (over the fastest; a median of estimates or a single one) lies in
``[(1 - j) / (1 + j), 1]``, so it moves by at most a factor ``(1 + j) / (1 - j)`` between any two
steps: 1.22 for j = 10 %. The default tolerance of 0.3 therefore never fires there on a +-10 %
jitter (nor on anything below +-13 %), whatever its pattern. A rank slower than the fastest is not
clipped at 1.0, and its bound is the square, 1.49 for j = 10 %; the median keeps a random jitter
well inside it, which the tests check. A drop to half speed (a factor 2) fires within 4 steps (the
median turns after 3, then the drift is confirmed), and the decision balances for the new speed
itself, not a blend of the old and the new.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from .speed import normalise_speeds


#: how :meth:`SpeedWatch.reason` starts: a decision for it needs no profile when the work is known
DRIFT_REASON = "auto: pipeline rank "


@dataclass
class SpeedWatch:
    tolerance: float = 0.3  # fire beyond a factor 1 + tolerance between the relative speeds
    confirm_steps: int = 2  # ... on this many consecutive steps
    window: int = 5  # each rank's estimate: the median of its last this many
    # state
    balanced_for: tuple[float, ...] | None = None  # relative speeds the partition was balanced for
    recent: deque[tuple[float, ...]] = field(default_factory=deque, repr=False)  # the last ``window`` estimates
    streak: int = 0
    calibration: tuple[float, ...] | None = None  # per rank: reading -> speed under this partition
    calibrating: bool = False  # the partition changed: the next window sets the calibration
    _drift: tuple[int, float] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        t = self.tolerance
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (math.isfinite(t) and t > 0):
            raise ValueError(f"speed tolerance must be a finite number > 0, got {t!r}")
        c = self.confirm_steps
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            raise ValueError(f"confirm_steps must be an int >= 1, got {c!r}")
        w = self.window
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ValueError(f"window must be an int >= 1, got {w!r}")
        self.recent = deque(self.recent, maxlen=w)

    @property
    def smoothed(self) -> list[float] | None:
        """Per rank, the median of its recent estimates (None before any). A median, not a moving
        average: after a step change it is the new speed itself once half the window has seen it,
        never a blend of the old and new, so a decision is not taken for a speed on its way."""
        if not self.recent:
            return None
        return [statistics.median(col) for col in zip(*self.recent)]

    @property
    def quorum(self) -> int:
        """Estimates a drift needs: half a window (a median of one or two is a step's noise, at the
        start as after a restart)."""
        return (self.window + 1) // 2

    @property
    def estimate(self) -> tuple[float, ...] | None:
        """The smoothed speeds, calibrated to the partition and normalised (fastest 1.0)."""
        return None if self.smoothed is None else self._calibrated(self.smoothed)

    @property
    def latest(self) -> tuple[float, ...] | None:
        """The last step's estimate alone, calibrated and normalised (None before any): what has
        turned already when the median has not."""
        return self._calibrated(self.recent[-1]) if self.recent else None

    def _calibrated(self, readings: Sequence[float]) -> tuple[float, ...]:
        now = normalise_speeds(readings)
        if self.calibration is None or len(self.calibration) != len(now):
            return now
        return normalise_speeds([v * c for v, c in zip(now, self.calibration)])

    @property
    def for_balancing(self) -> tuple[float, ...] | None:
        """What a decision should balance for: the current estimate once it drifted beyond the
        tolerance, else the speeds the partition was balanced for. A decision for another reason
        (a dynamism event, the busy-time imbalance) so does not chase jitter: speeds within the
        tolerance of the last ones balanced for give the same problem, so the same partition."""
        return self.estimate if self._drift is not None else self.balanced_for

    def observe(self, speeds: Sequence[float]) -> None:
        """One step's per-pipeline-rank speed estimates, in a unit common to the steps: best the
        raw ``work / busy`` (``speeds_from_busy(..., to=None)``), whose per-rank medians carry no
        step's normalisation noise (normalised ones work too). A change in the rank count
        (re-packing) starts over."""
        now = tuple(float(v) for v in speeds)
        if not all(math.isfinite(v) and v > 0 for v in now):
            raise ValueError(f"speeds must be finite numbers > 0, got {speeds!r}")
        if self.recent and len(self.recent[-1]) != len(now):
            self.recent.clear()
            self.streak = 0
        if self.calibration is not None and len(self.calibration) != len(now):
            self.calibration = None
        if self.balanced_for is None or len(self.balanced_for) != len(now):
            self.balanced_for = tuple(1.0 for _ in now)  # what a partition balanced without speeds assumed
        self.recent.append(now)
        if self.calibrating and len(self.recent) >= self.window:
            self._calibrate()
        self._drift = self.drift()
        self.streak = self.streak + 1 if self._drift is not None else 0

    def drift(self) -> tuple[int, float] | None:
        """``(rank, factor)`` of the rank whose relative speed moved most since the partition was
        balanced (``factor`` = now / then, below 1 for a slowdown), if beyond the tolerance."""
        if self.balanced_for is None or len(self.recent) < self.quorum or self.calibrating:
            return None
        estimate = self.estimate
        assert estimate is not None  # recent holds quorum >= 1 estimates
        return self.drift_of(estimate)

    def drift_of(self, speeds: Sequence[float]) -> tuple[int, float] | None:
        """:meth:`drift` of ``speeds`` (e.g. a profile's own estimate) from what the partition was
        balanced for (every rank alike before any balancing, or after the rank count changed)."""
        now = normalise_speeds(speeds)
        base = self.balanced_for if self.balanced_for is not None and len(self.balanced_for) == len(now) else None
        then = normalise_speeds(base) if base is not None else tuple(1.0 for _ in now)
        if not now:
            return None
        rank = max(range(len(now)), key=lambda r: abs(math.log(now[r] / then[r])))
        factor = now[rank] / then[rank]
        return (rank, factor) if abs(math.log(factor)) > math.log1p(self.tolerance) else None

    def reason(self) -> str | None:
        """Why to rebalance now (None: not yet): a drift held for ``confirm_steps`` steps."""
        if self.streak < self.confirm_steps or self._drift is None:
            return None
        rank, factor = self._drift
        return (f"{DRIFT_REASON}{rank} runs at {factor:.2f}x the relative speed the partition was balanced for "
                f"(beyond 1/{1 + self.tolerance:.2f}..{1 + self.tolerance:.2f})")

    def restart(self, speeds: Sequence[float] | None) -> None:
        """A profile settled new speeds (``speeds``): forget the estimates taken before the change
        (their median would report it as a drift back until it turns), measure drift from
        ``speeds``, and report none until half a window of new estimates is in (a median of one
        or two is a step's noise)."""
        self.recent.clear()
        self.rebase(speeds)

    def moved(self) -> None:
        """The partition changed for :attr:`for_balancing`: rebase on it, forget the readings under
        the old partition, and calibrate on the first window under the new one."""
        self.rebase()
        self.recent.clear()
        self.calibration, self.calibrating = None, True

    def _calibrate(self) -> None:
        """Per rank, what turns this partition's readings into the speeds it was balanced for:
        the factor, where it exceeds a third of the tolerance (noise within it), at most
        ``1 + tolerance``."""
        band, hi = math.log1p(self.tolerance / 3), math.log1p(self.tolerance)
        balanced_for, smoothed = self.balanced_for, self.smoothed
        assert balanced_for is not None and smoothed is not None  # observe() set both before calling it
        logs = [math.log(b / v) for b, v in zip(normalise_speeds(balanced_for), normalise_speeds(smoothed))]
        beyond = [math.copysign(min(hi, abs(x)), x) if abs(x) > band else 0.0 for x in logs]
        self.calibration = tuple(math.exp(x) for x in beyond) if any(beyond) else None
        self.calibrating = False

    def rebase(self, speeds: Sequence[float] | None = None) -> None:
        """A decision was taken for ``speeds`` (default: :attr:`for_balancing`): drift is measured
        from them now."""
        base = speeds if speeds is not None else self.for_balancing
        if base is not None:
            self.balanced_for = normalise_speeds(base)
        self.streak, self._drift = 0, None
