"""Rank speed: how fast each rank runs the same work, estimated from what it measured (pure).

The cost model's time of a layer on stage ``s`` is ``work / speed[s]`` (``CostModel.speed``): a
layer timed on a slow rank is not an expensive layer, and moving it to a fast rank makes it cheap.
A pipeline runs at its slowest stage's pace, so a straggler (a throttled or shared device) must be
given less work, not have its layers' times carried to wherever they go.

Speeds are relative: normalised so that the fastest rank is 1.0 (its seconds are the work's
units). Two estimates, one source of truth each:

* from a profile (:func:`estimate_speeds`): each layer's measured seconds on a rank against a
  rank-independent *reference* for the same layer (the work from the last profile, valid while no
  dynamism event changed what the layers compute; the same layer's time on its data-parallel
  replicas; or ``LayerCosts.from_params(...).time``, a crude proxy when layers are alike). A rank's
  slowness is the reference-weighted median of its ratios, so a few layers whose work changed, or
  a few noisy timings, do not move it;
* every step at no extra cost (:func:`speeds_from_busy`): a rank's busy seconds against the work
  its layers hold (:func:`rank_work`). At the profile step both agree by construction: work is the
  measured time times the speed of the rank that measured it (:func:`work_costs`).

With data parallelism there is one partition for all replicas, and each stage waits for its
slowest replica: :func:`slowest_replicas` reduces per-global-rank speeds to per-pipeline-rank ones,
and :meth:`~lightning_dynmo.plan.layout.PipelineLayout.stage_speed` maps those to the (virtual)
stages the cost model sees. The estimates cannot tell a rank that slowed down from layers that all
got heavier on it at once without an event saying so (e.g. a data mix that only one rank's layers
feel); such a change is balanced as a slow rank, which is what its busy time shows.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

from .cost_model import CostModel, LayerCosts
from .partition import Partition
from .topology import Topology

NORMALISATIONS = ("max", "mean")


def _check_speeds(speeds: Sequence[float], what: str = "speeds") -> tuple[float, ...]:
    out = tuple(float(v) for v in speeds)
    for i, v in enumerate(out):
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"{what}[{i}] must be a finite number > 0, got {v!r}")
    return out


def normalise_speeds(speeds: Sequence[float], to: str = "max") -> tuple[float, ...]:
    """``speeds`` scaled so that their ``to`` (``"max"``: the fastest rank, or ``"mean"``) is 1.0.
    Only ratios between ranks mean anything; a common scale is what makes two estimates comparable."""
    v = _check_speeds(speeds)
    if to not in NORMALISATIONS:
        raise ValueError(f"unknown normalisation {to!r}; valid: {', '.join(NORMALISATIONS)}")
    if not v:
        return ()
    base = max(v) if to == "max" else math.fsum(v) / len(v)
    return tuple(x / base for x in v)


def weighted_median(values: Sequence[float], weights: Sequence[float]) -> float:
    """The lower weighted median: the smallest value whose cumulative weight (values in ascending
    order) reaches half the total. Deterministic (ties by value, then input order)."""
    pairs = sorted((float(v), float(w)) for v, w in zip(values, weights) if w > 0)
    if not pairs:
        raise ValueError("weighted_median needs at least one value with a positive weight")
    half, acc = math.fsum(w for _, w in pairs) / 2, 0.0
    for v, w in pairs:
        acc += w
        if acc >= half:
            return v
    return pairs[-1][0]  # pragma: no cover - rounding of acc below half


def estimate_speeds(
    measured: Sequence[Mapping[int, float]],
    reference: Sequence[float],
    *,
    previous: Sequence[float] | None = None,
    to: str = "max",
) -> tuple[float, ...]:
    """Per-rank speed from profiled layer times: ``measured[r]`` maps layer -> seconds rank ``r``
    measured (forward + backward per micro-batch; NaN, inf or <= 0: not timed), ``reference[l]``
    is layer ``l``'s work in any unit common to all layers (<= 0 or not finite: no reference).

    Rank ``r``'s slowness is the weighted median over its layers of ``measured / reference``
    (weights: the reference, so the layers that carry the time decide and a tiny layer's launch
    overhead does not); its speed is the inverse, normalised by :func:`normalise_speeds`. A rank
    with no usable layer keeps ``previous[r]`` (already normalised; default 1.0, i.e. it is not
    taken for a straggler without evidence)."""
    ref = [float(x) for x in reference]
    raw: list[float | None] = []
    for times in measured:
        ratios, weights = [], []
        for layer, t in times.items():
            if not 0 <= layer < len(ref):
                raise ValueError(f"measured names layer {layer}, the reference has {len(ref)} layers")
            t, w = float(t), ref[layer]
            if math.isfinite(t) and t > 0 and math.isfinite(w) and w > 0:
                ratios.append(t / w)
                weights.append(w)
        raw.append(1.0 / weighted_median(ratios, weights) if ratios else None)
    if previous is not None and len(previous) != len(raw):
        raise ValueError(f"previous has {len(previous)} speeds for {len(raw)} ranks")
    known = [v for v in raw if v is not None]
    if not known:
        return tuple(1.0 for _ in raw) if previous is None else _check_speeds(previous, "previous")
    scaled = dict(zip((i for i, v in enumerate(raw) if v is not None), normalise_speeds(known, to)))
    fallback = [1.0] * len(raw) if previous is None else _check_speeds(previous, "previous")
    return tuple(scaled.get(i, fallback[i]) for i in range(len(raw)))


def speeds_from_busy(busy: Sequence[float], work: Sequence[float], *, to: str | None = "max") -> tuple[float, ...]:
    """Per-rank speed from one step's busy seconds: rank ``r`` did ``work[r]`` (from
    :func:`rank_work`, any common unit) in ``busy[r]`` seconds. Normalised by
    :func:`normalise_speeds` (``to=None``: the raw ratios, in work units per second, comparable
    from step to step while the unit is). A rank with no busy time or no work says nothing: it is
    taken as fast as the fastest that does (never a straggler by default)."""
    if len(busy) != len(work):
        raise ValueError(f"busy has {len(busy)} ranks, work has {len(work)}")
    raw = [w / b if b > 0 and w > 0 and math.isfinite(w / b) else None for b, w in zip(busy, work)]
    known = [v for v in raw if v is not None]
    if not known:
        return tuple(1.0 for _ in raw)
    top = max(known)
    filled = [top if v is None else v for v in raw]
    return tuple(filled) if to is None else normalise_speeds(filled, to)


def rank_work(costs: LayerCosts, model: CostModel, partition: Partition, rank_of_stage: Sequence[int],
              num_ranks: int) -> list[float]:
    """Per pipeline rank: the per-micro-batch compute work (speed 1.0, no transfers) of the stages
    it holds; ``rank_of_stage[s]`` is stage ``s``'s rank (virtual stages: several per rank)."""
    costs._check(partition)
    if len(rank_of_stage) != partition.num_stages:
        raise ValueError(f"rank_of_stage names {len(rank_of_stage)} stages, the partition has {partition.num_stages}")
    out = [0.0] * num_ranks
    for s, r in enumerate(rank_of_stage):
        rng = partition.layers_of(s)
        out[r] += model.segment_work(costs, rng.start, rng.stop)
    return out


def slowest_replicas(speeds: Sequence[float], topology: Topology, active: int | None = None) -> tuple[float, ...]:
    """Per pipeline rank, the speed of its slowest data-parallel replica: ``speeds`` has one entry
    per global rank; the result one per pipeline rank (the first ``active`` after re-packing).
    One partition serves every replica, and each stage waits for its slowest one."""
    if len(speeds) != topology.world_size:
        raise ValueError(f"speeds has {len(speeds)} entries for a world of {topology.world_size} ranks")
    v = _check_speeds(speeds)
    pp = topology.pp if active is None else active
    return tuple(min(v[d * topology.pp + r] for d in range(topology.dp)) for r in range(pp))


def describe_slowest(speeds: Sequence[float] | None, what: str = "pipeline rank") -> str | None:
    """``"pipeline rank 1 at 0.52x"``: the slowest rank of per-rank ``speeds`` against the fastest
    (None when there are none or all are equal): what a decision record and the fit summary say."""
    if not speeds:
        return None
    v = normalise_speeds(speeds)
    slow = min(range(len(v)), key=lambda r: (v[r], r))
    return None if v[slow] == 1.0 else f"{what} {slow} at {v[slow]:.2f}x"


def work_costs(costs: LayerCosts, partition: Partition, stage_speed: Sequence[float] | None) -> LayerCosts:
    """Measured per-layer times -> work: each layer's time times the speed of the stage that timed
    it (``partition``: where the layers were when measured). With replicas the merged time is the
    slowest replica's (:func:`~lightning_dynmo.plan.measurements.merge_layer_costs`), so the stage
    speeds are the slowest replicas' too (:func:`slowest_replicas`). ``None`` or all 1.0: ``costs``
    itself."""
    if stage_speed is None:
        return costs
    costs._check(partition)
    v = _check_speeds(stage_speed, "stage_speed")
    if len(v) != partition.num_stages:
        raise ValueError(f"stage_speed has {len(v)} factors, the partition has {partition.num_stages} stages")
    if all(x == 1.0 for x in v):
        return costs
    k = [v[s] for s in partition.owner_map()]
    return LayerCosts(tuple(t * f for t, f in zip(costs.forward, k)), tuple(t * f for t, f in zip(costs.backward, k)),
                      costs.params, costs.memory, costs.activation)
