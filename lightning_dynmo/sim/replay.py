"""Timing of a fixed per-rank action order: each rank runs its actions in order, each as soon as
the rank is free and its inputs have arrived.

Dependencies are those of the pipeline's data flow: ``F`` of stage s, micro-batch i needs ``F`` of
stage s-1 for i plus the link crossing; the input-gradient backward (``B``, or ``I`` in
zero-bubble schedules) of stage s needs that of stage s+1 (the last stage: its own ``F``) plus the
crossing; ``W`` needs its own ``I``. Crossings between stages on the same rank are free. A
boundary that carries no gradient (every layer before it frozen: nothing to differentiate) adds
no backward dependency: the stage before it runs its backward as soon as its own forward is
done, as torch does (it posts no receive).

Messages also cost their ranks time besides the transit (``crossing``): the sender spends
``send[s]`` after the action whose output crosses boundary s (posting the send; the send itself
is asynchronous, as with torch's batched isend), the receiver ``recv[s]`` before the action that
consumes it, even when the message arrived long before (posting the receive and waiting on it:
transports such as gloo move the data only once the receive is posted). On a busy host these
per-message costs are milliseconds, a large share of a small pipeline's step.

The replay is a list schedule: it sweeps the ranks, advancing each while its next action's
inputs are known. An order that cannot finish (a dependency cycle) raises instead of looping.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from .actions import Op


class Span(NamedTuple):
    rank: int
    op: Op
    start: float
    end: float


def replay(
    ops: Sequence[Sequence[Op]],
    durations: Mapping[str, Sequence[float]],
    crossing: Sequence[float],
    *,
    send: Sequence[float] | None = None,
    recv: Sequence[float] | None = None,
    gradient: Sequence[bool] | None = None,
) -> list[Span]:
    """Spans of every action, rank by rank in execution order.

    ``durations[kind][stage]``: seconds per micro-batch of each kind of action in ``ops``;
    ``crossing[s]``: seconds for a tensor to cross boundary s|s+1 (either direction);
    ``send[s]`` / ``recv[s]``: the sender's / the receiver's own seconds per message over that
    boundary (default 0); ``gradient[s]``: whether a gradient crosses it (default: every one)."""
    rank_of = {op.stage: r for r, rank_ops in enumerate(ops) for op in rank_ops}
    last = max(rank_of)
    send = [0.0] * last if send is None else list(send)
    recv = [0.0] * last if recv is None else list(recv)
    grad = [True] * last if gradient is None else [bool(g) for g in gradient]
    if not len(crossing) == len(send) == len(recv) == len(grad) == last:
        raise ValueError(f"need one crossing, send, recv and gradient entry per stage boundary ({last})")
    done: dict[tuple[str, int, int], float] = {}  # ("F" | "B", stage, mb) -> end time

    def source(op: Op) -> tuple[tuple[str, int, int], int | None]:
        """The action whose output ``op`` consumes, and the boundary it crosses (None: none)."""
        s, i = op.stage, op.mb
        if op.kind == "F":
            return ("F", s - 1, i), (s - 1 if s > 0 else None)
        if op.kind == "W" or s == last or not grad[s]:
            return ("B" if op.kind == "W" else "F", s, i), None
        return ("B", s + 1, i), s

    def remote(hop: int | None) -> bool:
        return hop is not None and rank_of[hop] != rank_of[hop + 1]

    def sent_over(op: Op) -> int | None:
        """The boundary ``op``'s output crosses to another rank (None: it stays on the rank)."""
        s = op.stage
        if op.kind == "F" and s < last:
            hop = s
        elif op.kind in ("B", "I") and s > 0 and grad[s - 1]:
            hop = s - 1
        else:
            return None
        return hop if remote(hop) else None

    spans: list[list[Span]] = [[] for _ in ops]
    clock = [0.0] * len(ops)
    pos = [0] * len(ops)
    remaining = sum(len(r) for r in ops)
    while remaining:
        progressed = False
        for r, rank_ops in enumerate(ops):
            while pos[r] < len(rank_ops):
                op = rank_ops[pos[r]]
                src, hop = source(op)
                if op.kind == "F" and op.stage == 0:
                    t = 0.0
                else:
                    t = done.get(src)
                    if t is None:
                        break
                free = clock[r]
                if remote(hop):
                    t += crossing[hop]
                    free += recv[hop]
                start = max(free, t)
                end = start + durations[op.kind][op.stage]
                out = sent_over(op)
                clock[r] = end + (0.0 if out is None else send[out])
                if op.kind != "W":
                    done[("F" if op.kind == "F" else "B", op.stage, op.mb)] = end
                spans[r].append(Span(r, op, start, end))
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            blocked = {r: str(ops[r][pos[r]]) for r in range(len(ops)) if pos[r] < len(ops[r])}
            raise RuntimeError(f"the action order cannot finish: every rank waits on a missing input {blocked}")
    return [s for rank_spans in spans for s in rank_spans]
