"""Per-message costs of a real pipeline, read off its own chunk timeline.

A ping-pong between two otherwise idle ranks measures the transport at its best. Inside a running
pipeline a message costs more: torch's schedules post each receive (fused with the pending sends)
and wait on it between two chunks, and on a busy host the peer's transport threads must first be
scheduled. What the simulator needs (:class:`~lightning_dynmo.sim.Link`) is visible in the chunk
timeline every step already records (``lightning_dynmo.plotting``'s event dicts, one clock for
all ranks of a host):

* ``send_overhead``: the gap after a chunk whose output goes to another rank, before a next chunk
  that needs no message, counted only where the receiver was already free to take it (torch's
  1F1B waits for its sends to complete, and a send to a busy receiver completes only when that
  receiver gets to it: a wait on the peer, not a cost of the message);
* ``recv_overhead``: the gap before a chunk whose input came from another rank and had *arrived
  before* the rank was free (less the send overhead when the previous chunk also sent);
* ``latency``: from the producing chunk's end to the consuming chunk's start when the consumer
  did wait for the message (its own overheads cannot explain the start), less the transfer.

Each is the median over all such gaps of the steps given, so a few descheduled gaps do not move
it. A kind of gap a schedule never shows (no warm-up sends, no waiting) gives 0.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise


@dataclass(frozen=True)
class MessageCosts:
    send_overhead: float  # seconds
    recv_overhead: float  # seconds
    latency: float  # seconds in transit beyond the transfer time
    samples: tuple[int, int, int]  # gaps behind each estimate (send, recv, latency)


def _median(xs: list[float]) -> float:
    return max(0.0, statistics.median(xs)) if xs else 0.0


def _step_gaps(events: Sequence[dict], num_stages: int, grad: Sequence[bool], sends: list, ready: list,
               waited: list) -> None:
    """Sort one step's gaps between consecutive chunks of a rank into the three kinds (appended
    to ``sends``, ``ready`` and ``waited``; see :func:`message_costs`)."""
    last = num_stages - 1
    rank_of = {e["stage"]: e["rank"] for e in events}
    if len(rank_of) != num_stages:
        raise ValueError(f"a step's events cover stages {sorted(rank_of)}, expected {num_stages} stages")
    end = {("F" if e["kind"] == "F" else "B", e["stage"], e["mb"]): e["end"] for e in events if e["kind"] != "W"}
    by_rank: dict[int, list[dict]] = {}
    for e in events:
        by_rank.setdefault(e["rank"], []).append(e)
    free_before: dict[tuple[str, int, int], float] = {}  # chunk -> end of its rank's previous chunk
    for chunks in by_rank.values():
        chunks.sort(key=lambda e: e["start"])
        free_before[("F" if chunks[0]["kind"] == "F" else "B", chunks[0]["stage"], chunks[0]["mb"])] = -math.inf
        for prev, e in pairwise(chunks):
            free_before[("F" if e["kind"] == "F" else "B", e["stage"], e["mb"])] = prev["end"]

    def remote(hop: int) -> bool:
        return rank_of[hop] != rank_of[hop + 1]

    def consumer(e: dict) -> tuple[str, int, int] | None:
        """The chunk on another rank that takes ``e``'s output (None: it stays on the rank)."""
        s = e["stage"]
        if e["kind"] == "F" and s < last and remote(s):
            return ("F", s + 1, e["mb"])
        if e["kind"] in ("B", "I") and s > 0 and grad[s - 1] and remote(s - 1):
            return ("B", s - 1, e["mb"])
        return None

    def producer(e: dict) -> tuple[str, int, int] | None:
        """The chunk on another rank whose output ``e`` takes (None: its input is local)."""
        s = e["stage"]
        if e["kind"] == "F" and s > 0 and remote(s - 1):
            return ("F", s - 1, e["mb"])
        if e["kind"] in ("B", "I") and s < last and grad[s] and remote(s):
            return ("B", s + 1, e["mb"])
        return None

    for chunks in by_rank.values():
        for prev, e in pairwise(chunks):
            gap, to, src = e["start"] - prev["end"], consumer(prev), producer(e)
            if src is None:
                if to is not None and free_before.get(to, math.inf) <= prev["end"]:
                    sends.append(gap)  # the receiver was free: the gap is the send's own cost
                continue
            arrival = end.get(src)
            if arrival is None:
                continue
            if arrival <= prev["end"]:
                ready.append((gap, to is not None))
            else:
                waited.append((e["start"] - arrival, gap, to is not None, src[1] - (src[0] == "B")))


def message_costs(
    steps: Sequence[Sequence[dict]],
    num_stages: int,
    gradient: Sequence[bool] | None = None,
    transfer: Sequence[float] | None = None,
) -> MessageCosts:
    """Per-message costs from the chunk events of one or more steps of one pipeline.

    ``steps``: per step, every rank's chunks as dicts with ``rank, stage, kind, mb, start, end``
    (kinds F, B or I, W); ``num_stages``: pipeline stages; ``gradient[s]``: whether a gradient
    crosses boundary s (default all); ``transfer[s]``: bytes / bandwidth of a message over
    boundary s, taken out of the latency (default 0)."""
    last = num_stages - 1
    grad = [True] * last if gradient is None else list(gradient)
    transfer = [0.0] * last if transfer is None else list(transfer)
    if len(grad) != last or len(transfer) != last:
        raise ValueError(f"need one gradient and transfer entry per stage boundary ({last})")
    sends: list[float] = []
    ready: list[tuple[float, bool]] = []  # (gap, previous chunk sent)
    waited: list[tuple[float, float, bool, int]] = []  # (since arrival, gap, previous sent, boundary)
    for events in steps:
        _step_gaps(events, num_stages, grad, sends, ready, waited)
    send = _median(sends)
    recv = _median([gap - (send if did_send else 0.0) for gap, did_send in ready])
    # a wait the receiver's own overheads explain says nothing about the transit time
    transit = [since - transfer[hop] for since, gap, did_send, hop in waited
               if gap > recv + (send if did_send else 0.0)]
    return MessageCosts(send, recv, _median(transit), (len(sends), len(ready), len(transit)))
