"""``LayerLoadMonitor``: the machinery the per-layer load monitors share (``MoELoadMonitor``,
``SparseAttentionMonitor``).

Every ``check_interval`` steps it reads a few numbers from each monitored layer the rank holds,
sums them over the pipeline group (each layer lives on exactly one of its ranks, so every rank
gets every layer's numbers and decides alike), lets the subclass log them, and asks a
:class:`~lightning_dynmo.protocol.PipelineControl` strategy to rebalance from its load counters
(``reprofile=False``: the layers' work changed, not what they compute) when one layer's tracked
number moved by more than ``shift_threshold`` from its value at the last request.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from ._pipeline_access import (all_reduce_over_pipeline, local_layers, pipeline_layers, pipeline_of, reduce_device)
from ..protocol import PipelineControl


class LayerLoadMonitor(Callback):
    """Base class; a subclass sets the class attributes and implements :meth:`monitored`,
    :meth:`layer_values` and :meth:`log_stats`.

    Args:
        shift_threshold: request a rebalance when a layer's tracked number moved by more than
            this from its value at the last request (before the first request:
            ``initial_baseline``, what a partition made without the dynamism assumes).
        check_interval: measure every this many steps (one all-reduce of
            ``(1 + len(fields)) x num_layers`` numbers over the pipeline group).
    """

    prefix = ""  # names the dynamism in the request's reason, e.g. "moe"
    fields: tuple[str, ...] = ()  # the numbers layer_values() returns, in order
    tracked = ""  # the field compared with the baseline
    tracked_name = ""  # how the reason calls it
    initial_baseline = 1.0

    def __init__(self, shift_threshold: float = 0.05, check_interval: int = 1) -> None:
        name = type(self).__name__
        if int(check_interval) != check_interval or int(check_interval) < 1:
            raise ValueError(f"{name} check_interval must be an integer >= 1, got {check_interval}")
        if not float(shift_threshold) > 0:
            raise ValueError(f"{name} shift_threshold must be > 0 (a change of {self.tracked_name}), "
                             f"got {shift_threshold}")
        self.shift_threshold = float(shift_threshold)
        self.check_interval = int(check_interval)
        self.baseline: dict[int, float] = {}  # layer -> tracked number at the last request
        self.last_stats: dict[int, dict[str, float]] = {}
        self.requests: list[dict] = []

    # ------------------------------------------------------------------ what subclasses define
    def monitored(self, pl_module) -> list[tuple[int, nn.Module]]:
        """``(global layer index, layer)`` of the monitored layers this rank holds."""
        raise NotImplementedError

    def layer_values(self, layer: nn.Module) -> Sequence[float] | None:
        """The layer's ``fields`` over the current window, or ``None`` if it ran no forward."""
        raise NotImplementedError

    def log_stats(self, pl_module, stats: dict[int, dict[str, float]]) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ shared
    def local_layers(self, pl_module, kind: type) -> list[tuple[int, nn.Module]]:
        return [(i, layer) for i, layer in local_layers(pl_module) if isinstance(layer, kind)]

    def measure(self, trainer, pl_module) -> dict[int, dict[str, float]]:
        """``{layer: {field: value}}`` of every monitored layer of the pipeline that ran in the
        current window. Collective under a pipeline strategy."""
        n = len(pipeline_layers(pl_module))
        rows = ("present", *self.fields)
        local = torch.zeros(len(rows), n, dtype=torch.float64)
        for i, layer in self.monitored(pl_module):
            values = self.layer_values(layer)
            if values is not None:
                local[:, i] = torch.tensor([1.0, *values], dtype=torch.float64)
        vec = all_reduce_over_pipeline(trainer, local.to(reduce_device(trainer, pl_module))).cpu()
        return {i: {f: float(vec[r, i]) for r, f in enumerate(rows) if r} for i in range(n) if vec[0, i] > 0}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if getattr(pipeline_of(trainer), "released", False):  # a released rank holds no layers and joins no pipeline
            return
        if (trainer.global_step - 1) % self.check_interval != 0:  # global_step already counts this step
            return
        stats = self.measure(trainer, pl_module)
        self.last_stats = stats
        if not stats:
            return
        self.log_stats(pl_module, stats)
        if isinstance(pipeline_of(trainer), PipelineControl):
            self._maybe_request(trainer, stats)

    def _maybe_request(self, trainer, stats: dict[int, dict[str, float]]) -> None:
        base = lambda i: self.baseline.get(i, self.initial_baseline)  # noqa: E731
        worst = max(stats, key=lambda i: abs(stats[i][self.tracked] - base(i)))
        before, after = base(worst), stats[worst][self.tracked]
        if abs(after - before) <= self.shift_threshold:
            return
        reason = f"{self.prefix}: {self.tracked_name} of layer {worst} moved {before:.2f} -> {after:.2f}"
        pipeline_of(trainer).request_rebalance(reason, reprofile=False)
        self.baseline = {i: s[self.tracked] for i, s in stats.items()}
        self.requests.append({"step": int(trainer.global_step), "reason": reason})

    def state_dict(self) -> dict[str, Any]:
        return {"baseline": dict(self.baseline), "requests": list(self.requests)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.baseline = {int(k): float(v) for k, v in state_dict.get("baseline", {}).items()}
        self.requests = list(state_dict.get("requests", []))
