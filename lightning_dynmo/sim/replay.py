"""Timing of a fixed per-rank action order: each rank runs its actions in order, each as soon as
the rank is free and its inputs have arrived.

Dependencies are those of the pipeline's data flow: ``F`` of stage s, micro-batch i needs ``F`` of
stage s-1 for i plus the link crossing; the input-gradient backward (``B``, or ``I`` in
zero-bubble schedules) of stage s needs that of stage s+1 (the last stage: its own ``F``) plus the
crossing; ``W`` needs its own ``I``. Crossings between stages on the same rank are free. Sends are
asynchronous (a rank never waits for its own send), as with torch's batched isend.

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
) -> list[Span]:
    """Spans of every action, rank by rank in execution order.

    ``durations[kind][stage]``: seconds per micro-batch of each kind of action in ``ops``;
    ``crossing[s]``: seconds for a tensor to cross boundary s|s+1 (either direction)."""
    rank_of = {op.stage: r for r, rank_ops in enumerate(ops) for op in rank_ops}
    last = max(rank_of)
    done: dict[tuple[str, int, int], float] = {}  # ("F" | "B", stage, mb) -> end time

    def ready(op: Op) -> float | None:
        """When ``op``'s inputs are on its rank (None: not produced yet)."""
        s, i = op.stage, op.mb
        if op.kind == "F":
            if s == 0:
                return 0.0
            src, hop = ("F", s - 1, i), s - 1
        elif op.kind == "W":
            return done.get(("B", s, i))
        elif s == last:
            return done.get(("F", s, i))
        else:
            src, hop = ("B", s + 1, i), s
        t = done.get(src)
        if t is None or rank_of[hop] == rank_of[hop + 1]:
            return t
        return t + crossing[hop]

    spans: list[list[Span]] = [[] for _ in ops]
    clock = [0.0] * len(ops)
    pos = [0] * len(ops)
    remaining = sum(len(r) for r in ops)
    while remaining:
        progressed = False
        for r, rank_ops in enumerate(ops):
            while pos[r] < len(rank_ops):
                op = rank_ops[pos[r]]
                t = ready(op)
                if t is None:
                    break
                start = max(clock[r], t)
                clock[r] = end = start + durations[op.kind][op.stage]
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
