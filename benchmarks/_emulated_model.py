"""An emulated GPT for ``benchmarks/emulated_scale.py``: pipeline layers that *wait* for their cost.

Each layer owns real parameters (their count is the paper GPT's layer scaled down by
``PARAM_SCALE``, so the ``param`` balancer sees the real proportions), runs a tiny real
computation on a tiny activation (so autograd, gradients, AdamW state and migrations are real)
and then sleeps until its forward cost has passed; its backward sleeps its backward cost inside a
custom autograd function. A sleeping rank uses no core, so 8-24 ranks run on 2 cores with the
timing of 8-24 devices.

What each layer waits for comes from the process-global :data:`CLOCK`: one row of per-layer
(forward, backward) seconds per scenario snapshot (``lightning_dynmo.sim.scenarios``, scaled to
the chosen step length); :class:`ScenarioClock` selects the row from the step index on every
rank. Layers look their cost up by their global index (a plain int that migrates with them), so
a layer that moved to another rank keeps its cost.
"""
from __future__ import annotations

import math
import time

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

HIDDEN, SEQ, MICRO_BATCH = 8, 16, 1  # the tiny real activation: [micro-batch, seq, hidden]
PARAM_SCALE = 4096  # real parameters per emulated parameter
CHAIN_SLACK = 0.005  # the most CPU time between two layers of a chunk that the queued waits hide


class _Clock:
    """Per-layer (forward, backward) seconds of every snapshot, and the row in force."""

    def __init__(self) -> None:
        self.forward: list[list[float]] = []
        self.backward: list[list[float]] = []
        self.reference: list[float] = []  # per layer: forward seconds that mean load factor 1
        self.row = 0
        self.strategy = None  # the running DynMoStrategy (its partition says where chunks start)
        self.deadline = 0.0  # end of the last wait: this rank's emulated device is busy until then
        self.slowdown: list[float] | None = None  # per row, how many times this rank's waits last (a straggler)

    def set(self, forward: list[list[float]], backward: list[list[float]], reference: list[float]) -> None:
        self.forward, self.backward, self.reference, self.row = forward, backward, reference, 0

    def cost(self, i: int) -> tuple[float, float]:
        return self.forward[self.row][i], self.backward[self.row][i]

    def wait(self, seconds: float, starts_chunk: bool, ends_chunk: bool) -> None:
        """Spend ``seconds`` of emulated device time. Within a chunk (one stage's forward or
        backward of one micro-batch) the layers' work is queued back to back, as kernels on a
        device stream: each ends at the previous one's end plus its cost, and the rank sleeps
        only at the chunk's last layer, until the end of the queue. The CPU time between layers
        (Python, the tiny computation) is hidden as a GPU hides launch overhead behind queued
        work; one sleep per chunk instead of one per layer keeps 16-24 ranks off the cores. While
        the strategy profiles layers, every layer sleeps its own cost, so that its hooks time each
        layer as they would time a real one. A chunk's first layer starts when the chunk starts:
        messages and the schedule's work between chunks are never hidden."""
        if self.slowdown is not None:
            seconds *= self.slowdown[self.row]
        now = time.perf_counter()
        start = now if starts_chunk else max(self.deadline, now - CHAIN_SLACK)
        self.deadline = start + seconds
        profiling = self.strategy is not None and self.strategy.pipeline.profiler.layer_profiling
        if ends_chunk or profiling:
            left = self.deadline - time.perf_counter()
            if left > 0:
                time.sleep(left)


CLOCK = _Clock()


class _WaitBackward(torch.autograd.Function):
    """Identity forward; the backward waits ``seconds`` before passing the gradient on."""

    @staticmethod
    def forward(ctx, x, seconds: float, starts_chunk: bool, ends_chunk: bool):
        ctx.seconds, ctx.starts_chunk, ctx.ends_chunk = seconds, starts_chunk, ends_chunk
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        CLOCK.wait(ctx.seconds, ctx.starts_chunk, ctx.ends_chunk)
        return grad, None, None, None


class EmulatedLayer(nn.Module):
    """``kind``: embedding (tokens -> activation), block / norm (activation -> activation) or
    head (activation -> logits over a tiny vocabulary); ``params``: the real layer's count."""

    def __init__(self, index: int, kind: str, params: int, reports_load: bool = False) -> None:
        super().__init__()
        self.index, self.kind, self.reports_load = index, kind, reports_load
        rows = max(1, round(params / PARAM_SCALE / HIDDEN))
        self.weight = nn.Parameter(torch.randn(rows, HIDDEN) * 0.02)
        self._load_sum, self._load_n = 0.0, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f, b = CLOCK.cost(self.index)
        bounds = CLOCK.strategy.pipeline.partition.boundaries if CLOCK.strategy is not None else (0,)
        first = self.index in bounds  # a stage's backward starts at its last layer
        last = self.index + 1 in bounds
        if self.kind == "embedding":
            y = F.embedding(x % self.weight.shape[0], self.weight)
        elif self.kind == "head":
            y = x @ self.weight.t()
        else:
            y = x * (1.0 + torch.tanh(self.weight).mean(0))
        if y.requires_grad:  # backward runs last layer first; it ends where no gradient flows on
            y = _WaitBackward.apply(y, b, last, first or not x.requires_grad)
        if self.reports_load and CLOCK.reference[self.index] > 0:
            self._load_sum += f / CLOCK.reference[self.index]
            self._load_n += 1
        CLOCK.wait(f, first, last)
        return y

    # ReportsLoad (per-iteration cases only): the work of this step relative to the reference
    def load_factor(self) -> float | None:
        if not self.reports_load or self._load_n == 0:
            return None
        return self._load_sum / self._load_n

    def reset_load(self) -> None:
        self._load_sum, self._load_n = 0.0, 0

    def extra_repr(self) -> str:
        return f"index={self.index}, kind={self.kind}, params={self.weight.numel()}"


class EmulatedGPT(L.LightningModule):
    """``[embedding] + blocks + [final norm, head]`` of emulated layers with the given real
    parameter counts (one per layer, as ``Snapshot.costs.params`` lists them)."""

    def __init__(self, params: list[int], reports_load: list[bool] | None = None, lr: float = 1e-3) -> None:
        super().__init__()
        n = len(params)
        kinds = ["embedding", *["block"] * (n - 3), "norm", "head"]
        loads = reports_load or [False] * n
        self.layers = nn.ModuleList(EmulatedLayer(i, k, p, r) for i, (k, p, r) in enumerate(zip(kinds, params, loads)))
        self.lr = lr

    def pipeline_layers(self) -> nn.ModuleList:
        return self.layers

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), (target % output.shape[-1]).reshape(-1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.pipeline_loss(self.forward(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)


class ScenarioClock(L.Callback):
    """Selects the cost row of each step (every rank, before the step) and tells the strategy
    about a change as a dynamism callback would: ``request_rebalance`` when the row changes
    (``requests=True``; freezing instead freezes layers through ``LayerFreezing``, which
    requests itself), and once at ``first_request`` so that the dynamic run starts from a
    partition balanced on measured times. Per-iteration cases set ``requests=False``: their
    layers report load factors and ``rebalance="auto"`` decides from them."""

    def __init__(self, rows: list[int], requests: bool, first_request: int | None) -> None:
        self.rows, self.requests, self.first_request = rows, requests, first_request

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        from lightning_dynmo.callbacks._pipeline_access import request_rebalance

        CLOCK.strategy = trainer.strategy
        step = trainer.global_step
        row = self.rows[min(step, len(self.rows) - 1)]
        changed = row != CLOCK.row
        CLOCK.row = row
        if step == self.first_request or (self.requests and changed):
            request_rebalance(trainer, f"scenario row {row} from step {step}")


def rows_of_steps(warmup: int, rows: int, per_row: int) -> list[int]:
    """Row in force at each step: row 0 through the warm-up, then ``per_row`` steps per row."""
    return [0] * warmup + [r for r in range(rows) for _ in range(per_row)]


def measured_steps(warmup: int, rows: int, per_row: int) -> dict[int, list[int]]:
    """Steps whose time counts for each row: all but a row's first (profiled, and followed by
    the migration) step."""
    return {r: [warmup + r * per_row + k for k in range(1, per_row)] for r in range(rows)}


def finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
