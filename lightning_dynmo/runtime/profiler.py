"""Measures what the balancer needs: per-layer forward/backward time, memory and activation size.

Two levels, so that the cheap one can always run:

* **stage level** (always on): each local ``PipelineStage``'s ``forward_one_chunk`` /
  ``backward_one_chunk`` / ``backward_weight_one_chunk`` are timed. This gives per-rank busy and
  idle time and the timeline of a step (the paper's Figure 5) for two clock reads per chunk.
* **layer level** (only in profiling windows): forward pre/post hooks time each layer's forward;
  gradient hooks on each layer's output activation time its backward (the backward of layer k
  runs from the moment the gradient of its output is ready until the gradient of its input is).
  The first layer of a stage ends when the stage's backward call returns.

On CUDA the clock reads synchronise the device so that times are the kernels' times; on CPU
``perf_counter`` is exact. Under zero-bubble schedules the weight-gradient pass runs separately;
its time is shared among the stage's layers in proportion to their input-gradient time.
"""
from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ChunkEvent:
    stage: int
    kind: str  # "F" forward, "B" backward (input grads, or full), "W" weight grads
    microbatch: int
    start: float
    end: float


class PipelineProfiler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.events: list[ChunkEvent] = []
        self.layer_profiling = False
        self._handles: list = []
        self._stage_layers: dict[int, range] = {}
        self._fwd_start: dict[int, float] = {}
        self._grad_ready: dict[int, float] = {}
        self.fwd: dict[int, float] = defaultdict(float)
        self.bwd: dict[int, float] = defaultdict(float)
        self.wgt: dict[int, float] = defaultdict(float)  # per stage, zero-bubble weight pass
        self.fwd_calls: dict[int, int] = defaultdict(int)
        self.step_start = 0.0
        self.step_end = 0.0

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    # ------------------------------------------------------------------ stage level
    def instrument(self, engine) -> None:
        """Wrap the chunk methods of an engine's stages (idempotent per stage object)."""
        for stage_id, stage in zip(engine.local_stage_ids, engine.stages):
            if getattr(stage, "_dynmo_profiled", False):
                continue
            stage._dynmo_profiled = True
            self._stage_layers[stage_id] = engine.partition.layers_of(stage_id)
            stage.forward_one_chunk = self._wrap(stage_id, "F", stage.forward_one_chunk)
            stage.backward_one_chunk = self._wrap(stage_id, "B", stage.backward_one_chunk)
            if hasattr(stage, "backward_weight_one_chunk"):
                stage.backward_weight_one_chunk = self._wrap(stage_id, "W", stage.backward_weight_one_chunk)

    def _wrap(self, stage_id: int, kind: str, fn):
        def timed(chunk_id, *args, **kwargs):
            if kind == "B":
                self._grad_ready = {}
            t0 = self.now()
            out = fn(chunk_id, *args, **kwargs)
            t1 = self.now()
            self.events.append(ChunkEvent(stage_id, kind, int(chunk_id), t0, t1))
            if self.layer_profiling:
                if kind == "B":
                    self._attribute_backward(stage_id, t0, t1)
                elif kind == "W":
                    self.wgt[stage_id] += t1 - t0
            return out

        return timed

    def begin_step(self) -> None:
        self.events = []
        self.step_start = time.perf_counter()

    def end_step(self) -> None:
        self.step_end = time.perf_counter()

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
            self._fwd_start[i] = self.now()

        return pre

    def _make_post(self, i: int):
        def post(module, args, output):
            t = self.now()
            self.fwd[i] += t - self._fwd_start.pop(i, t)
            self.fwd_calls[i] += 1
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(self._make_grad_hook(i))

        return post

    def _make_grad_hook(self, i: int):
        def hook(grad):
            self._grad_ready[i] = self.now()

        return hook

    def _attribute_backward(self, stage_id: int, t0: float, t1: float) -> None:
        """Layer k's backward spans from "gradient of its output ready" to "gradient of its input
        ready" (the output of layer k-1), or to the end of the stage's backward call for the first
        layer of the stage. A layer whose output needs no gradient ran no backward."""
        rng = self._stage_layers.get(stage_id)
        if rng is None:
            return
        ready = self._grad_ready
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
                rng = self._stage_layers[s]
                total_b = sum(self.bwd.get(k, 0.0) for k in rng) or 1.0
                share = self.bwd.get(i, 0.0) / total_b if total_b else 1.0 / len(rng)
                b += self.wgt[s] * share / calls
            out[i] = (f, b)
        return out


def layer_memory_bytes(layer: nn.Module, optimizers) -> int:
    """Bytes a layer owns: parameters, gradients, buffers (masks, sparse structure), optimizer state."""
    total = 0
    params = list(layer.parameters())
    for p in params:
        total += p.numel() * p.element_size()
        if p.grad is not None:
            total += p.grad.numel() * p.grad.element_size()
    for b in layer.buffers():
        total += b.numel() * b.element_size()
    ids = {id(p) for p in params}
    for opt in optimizers:
        opt = getattr(opt, "_optimizer", opt)
        for p, st in opt.state.items():
            if id(p) in ids:
                for v in st.values():
                    if torch.is_tensor(v):
                        total += v.numel() * v.element_size()
    return total
