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
    cached = _PLANS.get((id(ops), tuple(grad)))
    if cached is None or cached[0] is not ops:
        if len(_PLANS) > 64:
            _PLANS.clear()
        cached = _PLANS[(id(ops), tuple(grad))] = (ops, _plan(ops, tuple(grad), rank_of, last))
    plan = cached[1]
    stages = last + 1
    m = 1 + max(op.mb for rank_ops in ops for op in rank_ops)
    dur = [float(d) for kind in _KINDS for d in (durations[kind] if kind in durations else [0.0] * stages)]
    done: list[float | None] = [None] * (2 * stages * m)  # end of (F | B, stage, mb)
    spans: list[list[Span]] = [[] for _ in ops]
    new = tuple.__new__  # Span(...) without NamedTuple's Python-level __new__ (hundreds of thousands per projection)
    clock = [0.0] * len(ops)
    pos = [0] * len(ops)
    remaining = sum(len(r) for r in ops)
    while remaining:
        progressed = False
        for r, rank_plan in enumerate(plan):
            k, clk, out_spans, n = pos[r], clock[r], spans[r], len(rank_plan)
            while k < n:
                op, d, src, hop, out, key = rank_plan[k]
                if src < 0:
                    t = 0.0
                else:
                    t = done[src]
                    if t is None:
                        break
                free = clk
                if hop >= 0:
                    t += crossing[hop]
                    free += recv[hop]
                start = free if free > t else t
                end = start + dur[d]
                clk = end + send[out] if out >= 0 else end
                if key >= 0:
                    done[key] = end
                out_spans.append(new(Span, (r, op, start, end)))
                k += 1
            if k != pos[r]:
                remaining -= k - pos[r]
                pos[r], clock[r] = k, clk
                progressed = True
        if not progressed:
            blocked = {r: str(ops[r][pos[r]]) for r in range(len(ops)) if pos[r] < len(ops[r])}
            raise RuntimeError(f"the action order cannot finish: every rank waits on a missing input {blocked}")
    return [s for rank_spans in spans for s in rank_spans]


_KINDS = ("F", "B", "I", "W")
_PLANS: dict[tuple[int, tuple[bool, ...]], tuple] = {}  # (id(ops), gradient) -> (ops, plan): orders repeat


def _plan(ops, grad, rank_of, last) -> list[list[tuple]]:
    """Per rank, each action as ``(op, duration index, source key, inbound boundary, outbound
    boundary, output key)``: integer keys into the replay's tables, -1 for none (a boundary
    counts only where it joins two ranks)."""
    stages = last + 1
    m = 1 + max(op.mb for rank_ops in ops for op in rank_ops)

    def key(kind: str, s: int, i: int) -> int:
        return ((0 if kind == "F" else 1) * stages + s) * m + i

    def remote(hop: int | None) -> int:
        return hop if hop is not None and rank_of[hop] != rank_of[hop + 1] else -1

    out = []
    for rank_ops in ops:
        rows = []
        for op in rank_ops:
            s, i, kind = op.stage, op.mb, op.kind
            if kind == "F":  # consumes the previous stage's forward
                src, hop = (key("F", s - 1, i) if s > 0 else -1), (s - 1 if s > 0 else None)
            elif kind == "W" or s == last or not grad[s]:  # its own I / its own forward
                src, hop = key("B" if kind == "W" else "F", s, i), None
            else:  # the next stage's input gradient
                src, hop = key("B", s + 1, i), s
            if kind == "F" and s < last:
                sent = s
            elif kind in ("B", "I") and s > 0 and grad[s - 1]:
                sent = s - 1
            else:
                sent = None
            rows.append((op, _KINDS.index(kind) * stages + s, src, remote(hop), remote(sent),
                         -1 if kind == "W" else key("F" if kind == "F" else "B", s, i)))
        out.append(rows)
    return out
