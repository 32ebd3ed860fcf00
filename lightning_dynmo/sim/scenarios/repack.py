"""Re-packing a trajectory onto fewer pipeline ranks as it gets cheaper: GPUs over time and
GPU-hours saved."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_dynmo.plan.balancers import BalanceProblem, get_balancer
from lightning_dynmo.plan.repack import RepackRefused, plan_repack, rescale
from lightning_dynmo.plan.schedules import choose_microbatches, get_schedule
from lightning_dynmo.sim.simulate import DataParallel, Link, matching_cost_model, simulate
from .snapshot import Snapshot


@dataclass(frozen=True)
class RepackProjection:
    ranks: list[int]  # pipeline ranks in use during each snapshot
    iterations: list[float]
    mean_ranks: float  # iteration-weighted
    gpu_hours_saved_fraction: float  # 1 - mean_ranks / stages
    throughput_ratio: list[float]  # packed throughput over the reference's, per snapshot
    peak_stage_memory_gb: list[float]  # of the pipeline in use (estimate; see Profile.stored_*)
    reasons: list[str]
    reference: str


def repack_projection(
    trajectory: Sequence[Snapshot],
    stages: int,
    schedule: str = "1f1b",
    *,
    link: Link | Sequence[Link] = Link(),
    dp: DataParallel | None = None,
    capacity: float = 80e9,
    tolerance: float = 0.05,
    balancer: str = "partition_time",
    reference: str = "start",
) -> RepackProjection:
    """At each snapshot, the fewest pipeline ranks whose time-balanced partition fits
    ``capacity`` bytes per GPU and whose simulated step stays within ``tolerance`` of the
    reference: ``"start"``, the balanced pipeline on ``stages`` ranks at the first snapshot
    (the paper's "sustaining the training throughput" as the model shrinks), or ``"current"``,
    the balanced pipeline on ``stages`` ranks at this snapshot (the runtime's ``repack="auto"``
    rule, which packs only what costs no throughput now). Partitions and micro-batches come from
    the library's :func:`~lightning_dynmo.plan.repack.plan_repack` (micro-batches re-tuned by the
    runtime's rule at a fixed global batch of 8 x stages samples); released GPUs do not come back,
    so a later snapshot can only pack further. ``link``: as in :func:`simulate`, the first
    ranks' links are kept."""
    if reference not in ("start", "current"):
        raise ValueError(f"reference must be 'start' or 'current', got {reference!r}")
    spec = get_schedule(schedule)
    v = spec.virtual_stages(None)
    batch = 8 * stages
    m0 = choose_microbatches(spec, batch, stages, v, None)
    links = [link] * stages if isinstance(link, Link) else list(link)
    model0 = matching_cost_model(schedule, m0, Link(), capacity=capacity)
    ranks_now, first = stages, None
    out_r, ratio, mem, why = [], [], [], []
    for snap in trajectory:
        mview = snap.memory_view()
        full = get_balancer(balancer)(BalanceProblem(mview, stages * v, model0)).partition
        base = simulate(snap.costs, full, schedule, m0, link=links, dp=dp, reduced_params=snap.reduced_params).step_time
        first = base if first is None else first
        ref = first if reference == "start" else base
        chosen, notes = None, []
        for r in range(1, ranks_now + 1):
            m = choose_microbatches(spec, batch, r, v, None) if r < stages else m0
            if r == stages:
                part = full
            else:
                try:
                    part = plan_repack(mview, full, model0, stages, r, balancer,
                                       lambda n: choose_microbatches(spec, batch, n, v, None), v, tolerance).partition
                except (RepackRefused, ValueError) as err:
                    notes.append(f"{r}: {err}"[:120])
                    continue
            scaled = rescale(snap.costs, m0 / m)
            step = simulate(scaled, part, schedule, m, link=links[:r], dp=dp,
                            reduced_params=snap.reduced_params).step_time
            if step <= (1 + tolerance) * ref or r == ranks_now:
                model = matching_cost_model(schedule, m, Link(), capacity=capacity)
                chosen = (r, step, max(model.stage_memory(rescale(mview, m0 / m), part)) / 1e9)
                break
            notes.append(f"{r}: step {step * 1e3:.1f} ms > {1 + tolerance:.2f} x {ref * 1e3:.1f} ms")
        r, step, peak = chosen
        ranks_now = r
        out_r.append(r)
        ratio.append(ref / step)
        mem.append(peak)
        why.append(f"{r} ranks" + (f" (fewer refused: {notes[-1]})" if notes else ""))
    its = [s.iterations for s in trajectory]
    mean = sum(r * w for r, w in zip(out_r, its)) / sum(its)
    return RepackProjection(out_r, its, mean, 1 - mean / stages, ratio, mem, why, reference)
