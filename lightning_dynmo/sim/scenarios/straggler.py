"""Stragglers at scale, simulated: a trace of per-rank speeds over a run, and what a speed-aware
re-split gains over keeping one partition.

A trace is a list of :class:`Phase`: for some iterations, each pipeline rank runs at a speed
relative to the profiled device (1.0; 0.5: every compute action takes twice as long, the rank's
slowest data-parallel replica's, since one partition serves every replica). The model's per-layer
costs stay the profile's (work); a rank's speed scales only its own compute
(:func:`~lightning_dynmo.sim.simulate.simulate`'s ``rank_slowdown``), not its links.

:func:`project` compares, over the whole trace (iteration-weighted, migrations charged):

* **static** candidates, each one partition for the whole run: the projection's static splits
  (``megatron``, ``uniform``, ``param`` and ``static_time``, the time-balanced split at equal
  speeds, which is also the **even** split), plus the speed-aware ``partition_time`` split of
  every distinct phase held for the whole run (``phase<i>``) and of the run's mean time per work
  (``mean_speed``: each rank at the harmonic mean of its speeds, weighted by iterations). The best
  of them is the best static split; the best single partition over the run is not searched for
  beyond these;
* **dynmo**: starts on the even split; ``react_steps`` iterations after each change of speeds
  (the time to detect it) it re-splits with the speed-aware ``partition_time`` for the phase's
  speeds and migrates (:func:`~.compare.migration_seconds`: the moved layers' state over the
  slowest link) when the ``auto`` rule accepts (predicted saving over ``max(horizon, phase
  iterations)`` iterations above the migration's seconds);
* the **oracle**: the speed-aware split of every phase from its first iteration, no migration.

Assumed (A): dynmo knows a phase's speeds exactly once it reacts (the profile's estimate, not
noise), and detection costs nothing but the ``react_steps`` on the old split.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_dynmo.plan.balancers import BalanceProblem, get_balancer
from lightning_dynmo.plan.cost_model import CostModel, LayerCosts
from lightning_dynmo.plan.partition import Partition
from lightning_dynmo.plan.schedules import get_schedule
from lightning_dynmo.sim.simulate import DataParallel, Link, matching_cost_model, simulate
from .compare import STATIC, STATIC_TIME, megatron_gpt_layout, migration_seconds
from .snapshot import Snapshot

EVEN = STATIC_TIME  # the time-balanced split at equal speeds: where a balanced job starts


@dataclass(frozen=True)
class Phase:
    """``iterations`` of training with pipeline rank ``r`` at ``speeds[r]`` (1.0: as profiled)."""

    iterations: float
    speeds: tuple[float, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "speeds", tuple(float(v) for v in self.speeds))
        if not self.iterations > 0:
            raise ValueError(f"a phase needs iterations > 0, got {self.iterations!r}")
        if not self.speeds or not all(math.isfinite(v) and v > 0 for v in self.speeds):
            raise ValueError(f"speeds must be finite factors > 0, one per pipeline rank, got {self.speeds!r}")


def slow_rank_trace(stages: int, rank: int, speed: float = 0.5, start: float = 0.35, stop: float = 0.65,
                    iterations: float = 10_000) -> list[Phase]:
    """One rank at ``speed`` for the fraction ``[start, stop)`` of ``iterations``, every rank at
    1.0 before and after (it recovers)."""
    if not 0 <= rank < stages:
        raise ValueError(f"rank {rank} outside the {stages} pipeline ranks")
    if not 0.0 <= start < stop <= 1.0:
        raise ValueError(f"need 0 <= start < stop <= 1, got {start}, {stop}")
    slow = tuple(speed if r == rank else 1.0 for r in range(stages))
    spans = [(start, (1.0,) * stages), (stop - start, slow), (1.0 - stop, (1.0,) * stages)]
    return [Phase(f * iterations, s) for f, s in spans if f > 0]


def mixed_trace(stages: int, slow_speed: float = 0.6, gpus_per_node: int = 4,
                iterations: float = 10_000) -> list[Phase]:
    """A job of two device kinds for the whole run: nodes of ``gpus_per_node`` consecutive ranks
    alternate between speed 1.0 and ``slow_speed`` (half the ranks each when the node count is
    even)."""
    if gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
    return [Phase(iterations, tuple(slow_speed if (r // gpus_per_node) % 2 else 1.0 for r in range(stages)))]


@dataclass(frozen=True)
class StragglerProjection:
    seconds: dict[str, float]  # whole-run seconds per strategy (migrations included)
    iterations: float
    best_static: str
    static: tuple[str, ...]  # the static candidates considered
    bubble: dict[str, float]  # idle share of ranks x time (migration time idle)
    migrations: int  # dynmo's applied re-splits
    migration_seconds: float
    phase_step: dict[str, list[float]]  # per phase, the step seconds once dynmo reacted
    partitions: dict[str, list[str]] = field(default_factory=dict)  # per phase (dynmo: after reacting)

    def speedup(self, over: str, of: str = "dynmo") -> float:
        return self.seconds[over] / self.seconds[of]

    @property
    def speedup_vs_best_static(self) -> float:
        return self.speedup(self.best_static)

    @property
    def speedup_vs_even(self) -> float:
        return self.speedup(EVEN)

    @property
    def fraction_of_oracle(self) -> float:
        return self.seconds["oracle"] / self.seconds["dynmo"]


def stage_speeds(speeds: Sequence[float], stages: int, schedule: str) -> tuple[float, ...]:
    """Per (virtual) stage, the speed of the rank ``schedule`` places it on."""
    spec = get_schedule(schedule)
    return tuple(speeds[spec.rank_of_stage(s, len(speeds))] for s in range(stages))


def speed_split(costs: LayerCosts, model: CostModel, speeds: Sequence[float], schedule: str) -> Partition:
    """The speed-aware ``partition_time`` split: the slowest stage's time on its own rank minimised."""
    S = len(speeds) * get_schedule(schedule).virtual_stages(None)
    m = dataclasses.replace(model, speed=stage_speeds(speeds, S, schedule))
    return get_balancer("partition_time")(BalanceProblem(costs, S, m)).partition


def project(
    snapshot: Snapshot,
    trace: Sequence[Phase],
    schedule: str = "1f1b",
    microbatches: int | None = None,
    *,
    link: Link | Sequence[Link] = Link(),
    dp: DataParallel | None = None,
    react_steps: int = 10,
    horizon: float = 10.0,
    migration_link: Link | None = None,
    static: Sequence[str] = STATIC,
) -> StragglerProjection:
    """dynmo vs the static candidates vs the oracle over ``trace`` (see the module docstring).
    ``microbatches`` defaults to 4 x the pipeline ranks, as the projection's."""
    phases = list(trace)
    if not phases:
        raise ValueError("a trace needs at least one phase")
    pp = len(phases[0].speeds)
    if any(len(p.speeds) != pp for p in phases):
        raise ValueError("every phase needs one speed per pipeline rank")
    if react_steps < 0:
        raise ValueError(f"react_steps must be >= 0, got {react_steps}")
    if EVEN not in static:
        raise ValueError(f"the static candidates must include the even split {EVEN!r}")
    spec = get_schedule(schedule)
    S, m = pp * spec.virtual_stages(None), microbatches or 4 * pp
    costs = snapshot.costs
    model = matching_cost_model(schedule, m, link)
    links = [link] if isinstance(link, Link) else list(link)
    mlink = migration_link or min(links, key=lambda x: x.bandwidth or math.inf)
    prefix, per_block, suffix = snapshot.layout
    cache: dict[tuple, tuple[float, float]] = {}

    def step(part: Partition, speeds: tuple[float, ...]) -> tuple[float, float]:
        """(step seconds, busy rank-seconds) of ``part`` at ``speeds``."""
        key = (part.boundaries, speeds)
        if key not in cache:
            r = simulate(costs, part, schedule, m, link=link, dp=dp, reduced_params=snapshot.reduced_params,
                         rank_slowdown=[1.0 / v for v in speeds])
            cache[key] = (r.step_time, math.fsum(r.busy))
        return cache[key]

    def fixed_split(name: str) -> Partition:
        if name == "megatron":
            return megatron_gpt_layout(costs.num_layers, S, prefix, suffix, per_block)
        if name == STATIC_TIME:
            return speed_split(costs, model, (1.0,) * pp, schedule)
        return get_balancer(name)(BalanceProblem(costs, S, model)).partition

    total_its = math.fsum(p.iterations for p in phases)
    candidates = {name: fixed_split(name) for name in static}
    distinct = list(dict.fromkeys(p.speeds for p in phases))
    for i, speeds in enumerate(distinct):
        candidates[f"phase{i}"] = speed_split(costs, model, speeds, schedule)
    mean = tuple(total_its / math.fsum(p.iterations / p.speeds[r] for p in phases) for r in range(pp))
    candidates["mean_speed"] = speed_split(costs, model, mean, schedule)

    seconds: dict[str, float] = {}
    busy: dict[str, float] = {}
    parts: dict[str, list[str]] = {}
    series: dict[str, list[float]] = {}
    for name, part in candidates.items():
        runs = [step(part, p.speeds) for p in phases]
        seconds[name] = math.fsum(p.iterations * t for p, (t, _) in zip(phases, runs))
        busy[name] = math.fsum(p.iterations * b for p, (_, b) in zip(phases, runs))
        parts[name] = [str(part)] * len(phases)
        series[name] = [t for t, _ in runs]

    oracle = [speed_split(costs, model, p.speeds, schedule) for p in phases]
    runs = [step(part, p.speeds) for part, p in zip(oracle, phases)]
    seconds["oracle"] = math.fsum(p.iterations * t for p, (t, _) in zip(phases, runs))
    busy["oracle"] = math.fsum(p.iterations * b for p, (_, b) in zip(phases, runs))
    parts["oracle"], series["oracle"] = [str(x) for x in oracle], [t for t, _ in runs]

    cur, total, work, moves, moved = candidates[EVEN], 0.0, 0.0, 0, 0.0
    parts["dynmo"], series["dynmo"] = [], []
    for p, target in zip(phases, oracle):
        lag = min(float(react_steps), p.iterations)
        if target != cur and lag < p.iterations:
            seen = dataclasses.replace(model, speed=stage_speeds(p.speeds, S, schedule))
            cost = migration_seconds(cur, target, costs, mlink, pp, schedule)
            gain = seen.predicted_step_time(costs, cur) - seen.predicted_step_time(costs, target)
            if gain * max(horizon, p.iterations) > cost:  # the auto rule
                t_old, b_old = step(cur, p.speeds)
                total += lag * t_old + cost
                work += lag * b_old
                cur, moves, moved = target, moves + 1, moved + cost
                p = dataclasses.replace(p, iterations=p.iterations - lag)
        t, b = step(cur, p.speeds)
        total += p.iterations * t
        work += p.iterations * b
        parts["dynmo"].append(str(cur))
        series["dynmo"].append(t)
    seconds["dynmo"], busy["dynmo"] = total, work

    best = min(candidates, key=lambda n: seconds[n])
    return StragglerProjection(
        seconds=seconds, iterations=total_its, best_static=best, static=tuple(candidates),
        bubble={n: 1.0 - busy[n] / (pp * seconds[n]) for n in seconds},
        migrations=moves, migration_seconds=moved, phase_step=series, partitions=parts,
    )
