"""One training step of a pipeline, simulated: per-layer costs + partition + torch's schedule.

Stage times come from the same :class:`LayerCosts` the balancers use (forward and backward
seconds per micro-batch, summed exactly over the stage's layers); a zero-bubble schedule splits
a stage's backward into input-gradient ``I = (1 - w) B`` and weight-gradient ``W = w B``. Each
boundary crossing costs ``latency + activation bytes / bandwidth`` (the boundary layer's output
forward, its gradient backward); ``link`` is one :class:`Link` for every pair of neighbouring
ranks, or one per rank (``links[r]`` joins rank ``r`` and ``r + 1``; the last one closes the ring
of interleaved schedules), e.g. NVLink inside a node and InfiniBand between nodes; a link's
``send_overhead`` / ``recv_overhead`` are the seconds a message costs its sending / receiving rank
itself (posting and waiting on it, see :mod:`.replay`). A boundary before which every layer has
zero backward cost (a frozen prefix) carries no gradient. With data parallelism each rank then all-reduces its stages'
gradients (ring: ``2 (d-1)/d`` of the bytes over the bandwidth, ``2 (d-1)`` latencies), either
after its last action (``overlap=False``, as our runtime does) or per stage as soon as the
stage's last gradient is done, on one communication channel per rank beside the compute
(``overlap=True``: the most that reducing stage by stage can hide). Sends never block their
sender and links carry any number of messages at once (no contention).

:func:`matching_cost_model` gives the :class:`CostModel` that describes the same pipeline to a
balancer, so a simulated rebalance uses the balancers exactly as training does.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..plan.cost_model import CostModel, LayerCosts
from ..plan.partition import Partition
from ..plan.schedules import get_schedule
from .actions import schedule_ops
from .replay import Span, replay


@dataclass(frozen=True)
class Link:
    """Point-to-point link between adjacent pipeline ranks."""

    latency: float = 0.0  # seconds per message in transit
    bandwidth: float | None = None  # bytes/s; None: bytes cost nothing
    send_overhead: float = 0.0  # seconds of the sending rank's own time per message
    recv_overhead: float = 0.0  # seconds of the receiving rank's own time per message

    def __post_init__(self) -> None:
        for name in ("latency", "send_overhead", "recv_overhead"):
            if not getattr(self, name) >= 0.0:
                raise ValueError(f"Link.{name} must be >= 0 seconds, got {getattr(self, name)!r}")
        if self.bandwidth is not None and not self.bandwidth > 0:
            raise ValueError(f"Link.bandwidth must be > 0 bytes/s or None, got {self.bandwidth!r}")

    def time(self, nbytes: float) -> float:
        return self.latency + (0.0 if self.bandwidth is None else nbytes / self.bandwidth)


@dataclass(frozen=True)
class DataParallel:
    """Gradient all-reduce over ``replicas`` copies of the pipeline (ring algorithm)."""

    replicas: int
    bandwidth: float  # bytes/s each rank sends and receives
    bytes_per_param: float = 4.0  # gradient dtype (fp32: 4, bf16: 2)
    latency: float = 0.0  # seconds per ring step
    overlap: bool = False  # per stage as soon as its gradients are final, beside the compute

    def __post_init__(self) -> None:
        if self.replicas < 1 or not self.bandwidth > 0:
            raise ValueError(f"need replicas >= 1 and bandwidth > 0, got {self.replicas}, {self.bandwidth}")

    def allreduce_time(self, params: int) -> float:
        d = self.replicas
        if d == 1:
            return 0.0
        return 2 * (d - 1) / d * params * self.bytes_per_param / self.bandwidth + 2 * (d - 1) * self.latency


@dataclass(frozen=True)
class SimResult:
    step_time: float  # seconds from the first action to the last rank's end (all-reduce included)
    bubble_fraction: float  # idle share of ranks x step_time, counting only compute as busy
    busy: tuple[float, ...]  # compute seconds per pipeline rank
    allreduce: tuple[float, ...]  # data-parallel all-reduce seconds per pipeline rank
    spans: tuple[Span, ...] = ()  # every compute action's timing

    @property
    def events(self) -> tuple[dict, ...]:
        """Compute chunks in lightning_dynmo.plotting's timeline format (built on demand: a
        projection simulates thousands of steps and plots none of them)."""
        return tuple(
            {"rank": sp.rank, "stage": sp.op.stage, "kind": "B" if sp.op.kind == "I" else sp.op.kind,
             "mb": sp.op.mb, "start": sp.start, "end": sp.end}
            for sp in self.spans
        )


def _links(link: Link | Sequence[Link], pp: int) -> list[Link]:
    if isinstance(link, Link):
        return [link] * pp
    links = list(link)
    if len(links) != pp or not all(isinstance(x, Link) for x in links):
        raise ValueError(f"need one Link or one Link per pipeline rank ({pp}), got {link!r}")
    return links


def boundary_links(rank_of, num_stages: int, links: Sequence[Link]) -> list[Link]:
    """The link each stage boundary crosses: ``rank_of(s)`` is stage ``s``'s rank, ``links[r]``
    joins ranks ``r`` and ``r + 1`` (the last one closes the ring of interleaved schedules)."""
    pp = len(links)

    def link_of(s: int) -> Link:  # the link joining the ranks of stages s and s+1
        a, c = sorted((rank_of(s), rank_of(s + 1)))
        return links[c if (a, c) == (0, pp - 1) and pp > 2 else a]

    return [link_of(s) for s in range(num_stages - 1)]


def matching_cost_model(
    schedule: str, microbatches: int, link: Link | Sequence[Link] = Link(), virtual: int | None = None,
    capacity: float | None = None,
) -> CostModel:
    """The cost model a balancer should see for this simulated pipeline (same in-flight rule;
    each stage boundary's link bandwidth as the receive cost of the stage behind it: with one link
    per rank, the link joining the two stages' ranks, as :func:`simulate` charges it; a free link
    is ``inf``). One bandwidth for all boundaries when they are all alike."""
    spec = get_schedule(schedule)
    v = spec.virtual_stages(virtual)
    if isinstance(link, Link):
        bandwidth = link.bandwidth
    else:
        links = list(link)
        pp = len(links)
        crossed = boundary_links(lambda s: spec.rank_of_stage(s, pp), pp * v, links)
        per = tuple(math.inf if x.bandwidth is None else float(x.bandwidth) for x in crossed)
        if not per or set(per) == {math.inf}:  # one stage, or free links only
            bandwidth = None
        else:
            bandwidth = per[0] if len(set(per)) == 1 else per
    return CostModel(microbatches, spec.cost_schedule, bandwidth=bandwidth, capacity=capacity, virtual_stages=v)


def simulate(
    costs: LayerCosts,
    partition: Partition,
    schedule: str,
    microbatches: int,
    *,
    virtual: int | None = None,
    link: Link | Sequence[Link] = Link(),
    dp: DataParallel | None = None,
    w_fraction: float = 0.5,
    reduced_params: Sequence[int] | None = None,
    action_overhead: float = 0.0,
    rank_slowdown: Sequence[float] | None = None,
) -> SimResult:
    """Simulate one step. ``partition`` has one stage per (virtual) pipeline stage: ``pp x
    virtual`` stages for a multi-stage schedule, placed on ranks as torch places them.
    ``reduced_params``: per layer, the parameters whose gradients the data-parallel all-reduce
    carries (default ``costs.params``; e.g. 0 for frozen layers). ``action_overhead``: seconds
    added to every compute action (the framework's per-chunk work that per-layer profiling does
    not see: the schedule loop, posting sends and receives, the loss on the last stage).
    ``rank_slowdown``: per pipeline rank, how many times the costs its compute actions take
    (default 1: every rank as profiled; e.g. a rank sharing its cores with other work)."""
    spec = get_schedule(schedule)
    v = spec.virtual_stages(virtual)
    S = partition.num_stages
    if S % v:
        raise ValueError(f"schedule {spec.name!r} with {v} stages per rank needs a multiple of {v} stages, got {S}")
    if partition.num_layers != costs.num_layers:
        raise ValueError(f"partition {partition} covers {partition.num_layers} layers, costs have {costs.num_layers}")
    if not 0.0 <= w_fraction <= 1.0:
        raise ValueError(f"w_fraction must be in [0, 1], got {w_fraction}")
    pp = S // v
    ops = schedule_ops(spec.name, pp, v, microbatches)
    b = partition.boundaries
    forward = [math.fsum(costs.forward[b[s] : b[s + 1]]) for s in range(S)]
    backward = [math.fsum(costs.backward[b[s] : b[s + 1]]) for s in range(S)]
    if not action_overhead >= 0.0:
        raise ValueError(f"action_overhead must be >= 0, got {action_overhead}")
    slow = [1.0] * pp if rank_slowdown is None else list(rank_slowdown)
    if len(slow) != pp or not all(x > 0 and math.isfinite(x) for x in slow):
        raise ValueError(f"rank_slowdown needs one finite factor > 0 per pipeline rank ({pp}), got {rank_slowdown!r}")
    rank_of = {op.stage: r for r, rank_ops in enumerate(ops) for op in rank_ops}
    k = [slow[rank_of[s]] for s in range(S)]
    durations = {
        "F": [k[s] * (x + action_overhead) for s, x in enumerate(forward)],
        "B": [k[s] * (x + action_overhead) for s, x in enumerate(backward)],
        "I": [k[s] * ((1.0 - w_fraction) * x + action_overhead) for s, x in enumerate(backward)],
        "W": [k[s] * (w_fraction * x + action_overhead) for s, x in enumerate(backward)],
    }
    crossed = boundary_links(rank_of.__getitem__, S, _links(link, pp))
    crossing = [x.time(costs.activation[b[s + 1] - 1]) for s, x in enumerate(crossed)]
    gradient = [any(x > 0 for x in costs.backward[: b[s + 1]]) for s in range(S - 1)]
    spans = replay(ops, durations, crossing, send=[x.send_overhead for x in crossed],
                   recv=[x.recv_overhead for x in crossed], gradient=gradient)
    if reduced_params is not None and len(reduced_params) != costs.num_layers:
        raise ValueError(f"reduced_params has {len(reduced_params)} entries, costs have {costs.num_layers} layers")
    grad_params = list(costs.params if reduced_params is None else reduced_params)

    busy = [0.0] * pp
    compute_end = [0.0] * pp
    grads_done = [0.0] * S  # end of each stage's last gradient action
    for sp in spans:
        busy[sp.rank] += sp.end - sp.start
        compute_end[sp.rank] = max(compute_end[sp.rank], sp.end)
        if sp.op.kind != "F":
            grads_done[sp.op.stage] = max(grads_done[sp.op.stage], sp.end)
    allreduce = [0.0] * pp
    end = list(compute_end)
    if dp is not None:
        stages_of = [sorted({op.stage for op in rank_ops}) for rank_ops in ops]
        for r, stages in enumerate(stages_of):
            channel = 0.0
            for s in sorted(stages, key=lambda s: grads_done[s]):
                t = dp.allreduce_time(sum(grad_params[b[s] : b[s + 1]]))
                channel = max(channel, grads_done[s] if dp.overlap else compute_end[r]) + t
                allreduce[r] += t
            end[r] = max(end[r], channel)
    step = max(end)
    bubble = 1.0 - math.fsum(busy) / (pp * step) if step > 0 else 0.0
    return SimResult(step, bubble, tuple(busy), tuple(allreduce), tuple(spans))
