"""Static against dynamic balancing of a cost trajectory in the simulator: every balancer on
every snapshot, migrations charged, the best of each kind compared."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from lightning_dynmo.plan.balancers import BalanceProblem, get_balancer, megatron_layout
from lightning_dynmo.plan.cost_model import LayerCosts
from lightning_dynmo.plan.partition import Partition
from lightning_dynmo.plan.schedules import get_schedule
from lightning_dynmo.sim.simulate import DataParallel, Link, matching_cost_model, simulate
from .snapshot import Snapshot

STATIC = ("megatron", "uniform", "param", "static_time")
#: the time-balanced static split: the exact min-max partition of the first snapshot's profiled
#: costs, decided once (a profiler-driven static partitioner; Megatron-LM's uneven first/last
#: stages tuned by hand). Without it, equal piece counts (``uniform``) are a strawman wherever the
#: pieces differ in cost (fine granularity: a QKV projection beside an attention core)
STATIC_TIME = "static_time"
DYNAMIC = ("partition_time", "partition_param", "diffusion_time", "diffusion_param")


def _as_snapshots(trajectory: Sequence[Snapshot | LayerCosts]) -> list[Snapshot]:
    return [s if isinstance(s, Snapshot) else Snapshot(s, 1.0, tuple(s.activation)) for s in trajectory]


def megatron_gpt_layout(num_layers: int, num_stages: int, prefix: int = 1, suffix: int = 2,
                        per_block: int = 1) -> Partition:
    """Megatron-LM's GPT layout: the transformer blocks split into equal counts (remainder on
    the first stages; a block's ``per_block`` pipeline layers stay together), the embedding
    (``prefix`` layers) added to the first stage and the final norm + head (``suffix`` layers)
    to the last. (The ``uniform`` balancer instead counts every pipeline layer, embedding and
    head included, as one.)"""
    blocks, rest = divmod(num_layers - prefix - suffix, per_block)
    if blocks < num_stages or rest:
        return megatron_layout(num_layers, num_stages)
    sizes = [per_block * n for n in megatron_layout(blocks, num_stages).sizes]
    sizes[0] += prefix
    sizes[-1] += suffix
    return Partition.from_sizes(sizes)


@dataclass(frozen=True)
class Comparison:
    step_time: dict[str, float]  # iteration-weighted seconds over the trajectory (+ migrations)
    bubble_fraction: dict[str, float]  # idle share of ranks x time
    speedup: dict[str, float]  # each dynamic balancer over the best static baseline
    rebalances: dict[str, int]  # applied (partition-changing) rebalances per dynamic balancer
    migration_seconds: dict[str, float]
    inherent_bubble: float  # the schedule's own bubble with equal stages and free links
    series: dict[str, list[float]]  # step seconds per snapshot, per strategy
    iterations: list[float]
    best_static: str
    best_dynamic: str
    partitions: dict[str, list[str]] = field(default_factory=dict)

    @property
    def best_speedup(self) -> float:
        return self.speedup[self.best_dynamic]


def migration_seconds(old: Partition, new: Partition, costs: LayerCosts, link: Link, ranks: int,
                      schedule: str = "1f1b") -> float:
    """Time to move layers whose owner changes: each rank sends its leaving layers' state
    (``costs.memory``) over ``link``; ranks send in parallel, the slowest sets the time. Stages
    sit on ranks as ``schedule`` places them (round robin, or ZBV's V)."""
    if old == new:
        return 0.0
    spec = get_schedule(schedule)
    sent = [0.0] * ranks
    for layer in range(costs.num_layers):
        a, b = spec.rank_of_stage(old.stage_of(layer), ranks), spec.rank_of_stage(new.stage_of(layer), ranks)
        if a != b:
            sent[a] += costs.memory[layer]
    return max(link.time(x) if x > 0 else 0.0 for x in sent)


def inherent_bubble(stages: int, schedule: str, microbatches: int) -> float:
    """Bubble of ``schedule`` with identical stages and free links ((p-1)/(m+p-1) for 1F1B)."""
    v = get_schedule(schedule).virtual_stages(None)
    return simulate(LayerCosts.uniform(stages * v), megatron_layout(stages * v, stages * v), schedule,
                    microbatches).bubble_fraction


def compare(
    trajectory: Sequence[Snapshot | LayerCosts],
    stages: int,
    schedule: str = "1f1b",
    microbatches: int | None = None,
    *,
    link: Link | Sequence[Link] = Link(),
    dp: DataParallel | None = None,
    static: Sequence[str] = STATIC,
    dynamic: Sequence[str] = ("partition_time",),
    rebalance_every: int = 1,
    horizon: float = 10.0,
    migration_link: Link | None = None,
) -> Comparison:
    """Static partitions (decided once, on the first snapshot, as Megatron-LM / DeepSpeed do;
    ``megatron`` is :func:`megatron_gpt_layout`, ``static_time`` the ``partition_time`` split of the
    first snapshot (:data:`STATIC_TIME`), the others are registered balancers)
    vs each ``dynamic`` balancer re-run every ``rebalance_every`` snapshots. A snapshot of one
    iteration (per-iteration routing) is balanced on the *previous* snapshot's costs (a step's
    routing is known only once it ran; the first decision uses the first snapshot); a snapshot
    that lasts longer (a slow change: freezing, early exit, pruning) is balanced on its own costs
    after its first iteration, which runs on the old partition (Algorithm 1: profile the step
    after the change, then balance), so a snapshot's length is not charged as decision lag.
    A dynamic decision is applied when its predicted saving over the next
    ``max(horizon, snapshot iterations)`` iterations exceeds its migration time (the strategy's
    ``auto`` rule); migrations are charged over ``migration_link`` (default: the slowest link).
    ``stages`` are pipeline ranks; multi-stage schedules get the table's default virtual stages.
    Micro-batches default to 4 x stages (the paper's appendix A)."""
    snaps = _as_snapshots(trajectory)
    if set(static) & set(dynamic):
        raise ValueError(f"a balancer is either static or dynamic: {sorted(set(static) & set(dynamic))} is both "
                         f"(the time-balanced static split is {STATIC_TIME!r})")
    spec = get_schedule(schedule)
    S, m = stages * spec.virtual_stages(None), microbatches or 4 * stages
    model = matching_cost_model(schedule, m, link)
    links = [link] if isinstance(link, Link) else list(link)
    mlink = migration_link or min(links, key=lambda x: x.bandwidth or math.inf)

    prefix, per_block, suffix = snaps[0].layout

    def balance(name: str, costs: LayerCosts, current: Partition | None) -> Partition:
        if name == "megatron":
            return megatron_gpt_layout(costs.num_layers, S, prefix, suffix, per_block)
        if name == STATIC_TIME:
            name = "partition_time"
        return get_balancer(name)(BalanceProblem(costs, S, model, current)).partition

    def run(costs_snap: Snapshot, part: Partition):
        return simulate(costs_snap.costs, part, schedule, m, link=link, dp=dp, reduced_params=costs_snap.reduced_params)

    fixed = {name: balance(name, snaps[0].costs, None) for name in static}
    names = (*fixed, *dynamic)
    total = dict.fromkeys(names, 0.0)
    busy = dict.fromkeys(names, 0.0)
    series: dict[str, list[float]] = {n: [] for n in names}
    parts: dict[str, list[str]] = {n: [] for n in names}
    current: dict[str, Partition | None] = dict.fromkeys(dynamic)
    applied = dict.fromkeys(dynamic, 0)
    moved = dict.fromkeys(dynamic, 0.0)
    for t, snap in enumerate(snaps):
        slow = snap.iterations > 1
        before = dict(current)
        for name in dynamic:
            if t % rebalance_every:
                continue
            seen = (snap if slow else snaps[max(0, t - 1)]).costs
            cur = current[name]
            new = balance(name, seen, cur)
            if cur is None:
                current[name] = new
            elif new != cur:
                cost = migration_seconds(cur, new, seen, mlink, stages, schedule)
                gain = model.predicted_step_time(seen, cur) - model.predicted_step_time(seen, new)
                if gain * max(horizon, snap.iterations) > cost:
                    current[name], applied[name] = new, applied[name] + 1
                    moved[name] += cost
                    total[name] += cost
        for name in names:
            part = fixed.get(name) or current[name]
            r = run(snap, part)
            its = snap.iterations
            old = before.get(name)
            if slow and old is not None and old != part:  # the profiled first step, before the move
                first = run(snap, old)
                total[name] += first.step_time
                busy[name] += sum(first.busy)
                its -= 1
            total[name] += its * r.step_time
            busy[name] += its * sum(r.busy)
            series[name].append(r.step_time)
            parts[name].append(str(part))
    best_static = min(fixed, key=lambda n: total[n])
    best_dynamic = min(dynamic, key=lambda n: total[n])
    return Comparison(
        step_time=total,
        bubble_fraction={n: 1 - busy[n] / (stages * total[n]) for n in names},
        speedup={n: total[best_static] / total[n] for n in dynamic},
        rebalances=applied,
        migration_seconds=moved,
        inherent_bubble=inherent_bubble(stages, schedule, m),
        series=series,
        iterations=[s.iterations for s in snaps],
        best_static=best_static,
        best_dynamic=best_dynamic,
        partitions=parts,
    )
