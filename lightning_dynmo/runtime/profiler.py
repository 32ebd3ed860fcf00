"""Measures what the balancer needs: per-layer forward/backward time, memory and activation size.

Two levels, so that the cheap one can always run:

* **stage level** (always on): :class:`TimedPipelineStage` (a ``PipelineStage`` subclass) times
  its ``forward_one_chunk`` / ``backward_one_chunk`` / ``backward_weight_one_chunk`` calls. This gives per-rank busy and
  idle time and the timeline of a step (the paper's Figure 5) for two clock reads per chunk.
* **layer level** (only in profiling windows): forward hooks time each layer's forward (inside a
  forward chunk, from where the previous layer, or the chunk, ended; the last layer also gets the
  chunk's hand-off of its output); gradient hooks on each layer's output activation time its
  backward (the backward of layer k runs from the moment the gradient of its output is ready
  until the gradient of its input is). The first layer of a stage ends when the stage's backward
  call returns, and the last starts when it begins (on the last stage: the loss's backward).
* **the loss**: torch's schedules compute it after the last stage's forward chunk, outside it;
  :meth:`PipelineProfiler.timed_loss` makes it part of that chunk and of the last layer's forward,
  so every busy second belongs to a layer (:meth:`PipelineProfiler.attribution` checks it).

On CUDA the clock reads synchronise the device so that times are the kernels' times; on CPU
``perf_counter`` is exact. Under zero-bubble schedules the weight-gradient pass runs separately;
its time is shared among the stage's layers in proportion to their input-gradient time (their
forward time where the stage measured none). The first stage is the exception: its input (token
ids) needs no gradient, so torch runs its whole backward in the weight pass, and the gradient hooks
that fire there time each layer as in a plain backward.
"""
from __future__ import annotations

import math
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
from torch import nn

from ..protocol.services import is_recomputing
from .torch_compat import PortablePipelineStage


@dataclass(frozen=True)
class ChunkEvent:
    stage: int
    kind: str  # "F" forward, "B" backward (input grads, or full), "W" weight grads
    microbatch: int
    start: float
    end: float


class TimedPipelineStage(PortablePipelineStage):
    """A ``PipelineStage`` that reports the start and end of every chunk to a profiler."""

    def __init__(self, *args, profiler: "PipelineProfiler", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.profiler = profiler

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        with self.profiler.chunk(self.stage_index, "F", fwd_chunk_id):
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        with self.profiler.chunk(self.stage_index, "B", bwd_chunk_id):
            return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        with self.profiler.chunk(self.stage_index, "W", bwd_chunk_id):
            return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)


class PipelineProfiler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.events: list[ChunkEvent] = []
        self.layer_profiling = False
        self._handles: list = []
        self._stage_layers: dict[int, range] = {}
        self._fwd_start: dict[int, float] = {}
        self._cursor: float | None = None  # inside a forward chunk: where the last layer (or the chunk) ended
        self._last_fwd: int | None = None  # ... and which layer that was
        self._grad_ready: dict[int, float] = {}
        self.fwd: dict[int, float] = defaultdict(float)
        self.bwd: dict[int, float] = defaultdict(float)
        self.wgt: dict[int, float] = defaultdict(float)  # per stage, zero-bubble weight pass
        self.fwd_calls: dict[int, int] = defaultdict(int)
        self.window_busy = 0.0  # chunk seconds since layer profiling started (see attribution())
        self.step_start = 0.0

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    # ------------------------------------------------------------------ stage level
    def register_stage(self, stage_id: int, layers: range) -> None:
        """Which global layers a local stage runs (for attributing its backward to layers)."""
        self._stage_layers[stage_id] = layers

    @contextmanager
    def chunk(self, stage_id: int, kind: str, chunk_id: int):
        """Time one chunk of ``stage_id`` (``kind`` F, B or W); see :class:`TimedPipelineStage`."""
        if kind in ("B", "W"):
            self._grad_ready = {}
        t0 = self.now()
        if kind == "F":
            self._cursor, self._last_fwd = t0, None
        try:
            yield
        finally:
            cursor, self._cursor = self._cursor, None
        t1 = self.now()
        self.events.append(ChunkEvent(stage_id, kind, int(chunk_id), t0, t1))
        if self.layer_profiling:
            self.window_busy += t1 - t0
            if kind == "F" and self._last_fwd is not None:  # handing the output on is the last layer's
                self.fwd[self._last_fwd] += t1 - cursor
            elif kind == "B":
                self._attribute_backward(stage_id, t0, t1)
            elif kind == "W" and self._grad_ready:  # the whole backward ran here (see the module docstring)
                self._attribute_backward(stage_id, t0, t1, starts_at_chunk=True)
            elif kind == "W":
                self.wgt[stage_id] += t1 - t0

    def timed_loss(self, loss_fn, stage_id: int):
        """``loss_fn`` timed as part of the last stage: torch's schedules call it right after the
        stage's forward chunk, outside it, so its time extends that chunk (busy) and, in profiling
        windows, the forward of the stage's last layer (the head that computes the loss)."""
        def timed(output, target):
            t0 = self.now()
            loss = loss_fn(output, target)
            self._loss_forward(stage_id, t0, self.now())
            return loss

        return timed

    def _loss_forward(self, stage_id: int, t0: float, t1: float) -> None:
        ev = self.events[-1] if self.events else None
        if ev is not None and ev.stage == stage_id and ev.kind == "F":
            t0 = ev.end  # it follows its forward chunk directly: one chunk, no gap between them left out
            self.events[-1] = replace(ev, end=t1)
        else:
            mb = next((e.microbatch for e in reversed(self.events) if e.stage == stage_id and e.kind == "F"), 0)
            self.events.append(ChunkEvent(stage_id, "F", mb, t0, t1))
        rng = self._stage_layers.get(stage_id)
        if self.layer_profiling:
            self.window_busy += t1 - t0
            if rng:
                self.fwd[rng.stop - 1] += t1 - t0

    def begin_step(self) -> None:
        self.events = []
        self.step_start = time.perf_counter()

    def event_dicts(self, rank: int) -> list[dict]:
        """The last step's chunks as the dicts :mod:`lightning_dynmo.plotting` draws."""
        return [{"rank": rank, "stage": e.stage, "kind": e.kind, "mb": e.microbatch, "start": e.start, "end": e.end}
                for e in self.events]

    def busy_seconds(self) -> dict[int, float]:
        busy: dict[int, float] = defaultdict(float)
        for e in self.events:
            busy[e.stage] += e.end - e.start
        return dict(busy)

    # ------------------------------------------------------------------ layer level
    def start_layer_profiling(self, layers: nn.ModuleList, indices: list[int]) -> None:
        self.stop_layer_profiling()
        self.fwd.clear()
        self.bwd.clear()
        self.wgt.clear()
        self.fwd_calls.clear()
        self.window_busy = 0.0
        for i in indices:
            layer = layers[i]
            self._handles.append(layer.register_forward_pre_hook(self._make_pre(i)))
            self._handles.append(layer.register_forward_hook(self._make_post(i)))
        self.layer_profiling = True

    def stop_layer_profiling(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.layer_profiling = False

    def _make_pre(self, i: int):
        def pre(module, args):
            if is_recomputing():  # activation checkpointing: the recompute is part of the backward
                return
            self._fwd_start[i] = self.now()

        return pre

    def _make_post(self, i: int):
        def post(module, args, output):
            if is_recomputing():
                return
            t = self.now()
            start = self._fwd_start.pop(i, t)
            # in a forward chunk: from where the previous layer (or the chunk's start) ended
            if self._cursor is not None:
                start, self._cursor, self._last_fwd = self._cursor, t, i
            self.fwd[i] += t - start
            self.fwd_calls[i] += 1
            # a tuple output: the layer's backward starts when the last of its outputs' gradients is ready
            for t in (output,) if isinstance(output, torch.Tensor) else output if isinstance(output, tuple) else ():
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._make_grad_hook(i))

        return post

    def _make_grad_hook(self, i: int):
        def hook(grad):
            self._grad_ready[i] = self.now()

        return hook

    def _attribute_backward(self, stage_id: int, t0: float, t1: float, starts_at_chunk: bool = False) -> None:
        """Layer k's backward spans from "gradient of its output ready" to "gradient of its input
        ready" (the output of layer k-1), or to the end of the stage's backward call for the first
        layer of the stage. A layer whose output needs no gradient ran no backward.
        ``starts_at_chunk``: the stage output's gradient was given before the call (a weight pass
        that runs the whole backward), so the stage's last layer starts at ``t0`` even where its
        output's hook does not fire again."""
        rng = self._stage_layers.get(stage_id)
        if rng is None:
            return
        ready = dict(self._grad_ready)
        if starts_at_chunk:
            ready.setdefault(rng.stop - 1, t0)
        # the call's start to the output's gradient (the loss's backward on the last stage) is the top layer's
        if ready:
            ready[max(ready)] = t0
        for k in rng:
            if k not in ready:
                continue
            end = ready.get(k - 1, t1) if k > rng.start else t1
            self.bwd[k] += max(0.0, end - ready[k])

    def layer_times(self) -> dict[int, tuple[float, float]]:
        """``{layer: (forward, backward)}`` seconds per micro-batch over the profiling window."""
        out = {}
        stage_of = {k: s for s, rng in self._stage_layers.items() for k in rng}
        for i, calls in self.fwd_calls.items():
            if calls == 0:
                continue
            f = self.fwd[i] / calls
            b = self.bwd.get(i, 0.0) / calls
            s = stage_of.get(i)
            if s is not None and self.wgt.get(s):
                b += self.wgt[s] * self._weight_share(s, i) / calls
            out[i] = (f, b)
        return out

    def attribution(self) -> tuple[float, float]:
        """``(busy, attributed)`` seconds since layer profiling started: the chunks' time and the
        part of it the layers' costs account for (what the balancer does not see is the rest)."""
        return self.window_busy, math.fsum([*self.fwd.values(), *self.bwd.values(), *self.wgt.values()])

    def _weight_share(self, stage_id: int, i: int) -> float:
        """Layer ``i``'s share of its stage's weight-gradient time: by input-gradient time, or
        by forward time where the stage measured none (no layer of it may look free)."""
        rng = self._stage_layers[stage_id]
        for times in (self.bwd, self.fwd):
            total = sum(times.get(k, 0.0) for k in rng)
            if total > 0:
                return times.get(i, 0.0) / total
        return 1.0 / len(rng)
