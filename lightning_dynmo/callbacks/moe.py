"""``MoELoadMonitor``: logs expert load per MoE layer and asks a pipeline to rebalance when it shifts."""
from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from ..dynamic._dist import (
    all_reduce_over_pipeline,
    local_layers,
    pipeline_layers,
    reduce_device,
)
from ..models.moe import MoEBlock
from ..protocol import PipelineControl, RemoteLayer

# per-layer numbers summed over the pipeline group (each layer lives on exactly one of its ranks)
_FIELDS = ("present", "load", "max_over_mean", "dropped", "balance_loss")


class MoELoadMonitor(Callback):
    """Logs how each :class:`~lightning_dynmo.models.MoEBlock` spreads tokens over its experts and
    requests a rebalance from a :class:`~lightning_dynmo.protocol.PipelineControl` strategy when
    the blocks' relative work shifts.

    The measurement window is one training step: the callback restarts the blocks' monitoring
    window (``reset_routing_stats``, separate from the strategy's ``reset_load``) when a step
    starts and reads it when the step ends. Only training forwards count (see ``MoEBlock``).

    Args:
        shift_threshold: request a rebalance when a block's relative work (as ``load_factor()``,
            1.0 = dropless) moved by more than this from its value at the last request; before the
            first request the baseline is 1.0, what the initial partition assumes.
        check_interval: measure every this many steps (one all-reduce of ``5 x num_layers``
            numbers over the pipeline group).

    Logs, per MoE layer ``i``, ``moe/max_over_mean_load_L{i}`` (tokens of the busiest expert over
    the mean) and ``moe/dropped_fraction_L{i}``; over all MoE layers ``moe/max_over_mean_load``
    (max), ``moe/dropped_fraction`` and ``moe/aux_loss`` (means; the unscaled load-balancing loss,
    1.0 = uniform routing).
    """

    def __init__(self, shift_threshold: float = 0.05, check_interval: int = 1) -> None:
        if int(check_interval) < 1:
            raise ValueError(f"check_interval must be >= 1, got {check_interval}")
        if not float(shift_threshold) > 0:
            raise ValueError(f"shift_threshold must be > 0 (a change in relative work), got {shift_threshold}")
        self.shift_threshold = float(shift_threshold)
        self.check_interval = int(check_interval)
        self.baseline: dict[int, float] = {}  # layer -> relative work at the last request
        self.last_stats: dict[int, dict[str, float]] = {}
        self.requests: list[dict] = []

    @staticmethod
    def _blocks(pl_module) -> list[tuple[int, MoEBlock]]:
        return [(i, layer) for i, layer in local_layers(pl_module) if isinstance(layer, MoEBlock)]

    def setup(self, trainer, pl_module, stage: str) -> None:
        layers = pipeline_layers(pl_module) or []
        if not any(isinstance(layer, (MoEBlock, RemoteLayer)) for layer in layers):
            raise TypeError(
                f"MoELoadMonitor needs a model whose pipeline layers include MoEBlock layers "
                f"(e.g. lightning_dynmo.models.MoEGPT), got {type(pl_module).__name__}"
            )

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        for _, block in self._blocks(pl_module):
            block.reset_routing_stats()

    def measure(self, trainer, pl_module) -> dict[int, dict[str, float]]:
        """Per-layer load of the current window, ``{layer: {load, max_over_mean, dropped,
        balance_loss}}`` for every MoE layer of the pipeline. Collective under a pipeline strategy."""
        n = len(pipeline_layers(pl_module))
        local = [0.0] * (len(_FIELDS) * n)
        for i, block in self._blocks(pl_module):
            stats = block.routing_stats()
            if stats is None:
                continue
            counts = stats.expert_counts.double()
            values = (1.0, stats.relative_work, float(counts.max() / counts.mean()), stats.dropped_fraction,
                      stats.balance_loss)
            for f, v in enumerate(values):
                local[f * n + i] = v
        vec = torch.tensor(local, dtype=torch.float64, device=reduce_device(trainer, pl_module))
        vec = all_reduce_over_pipeline(trainer, vec).cpu().tolist()
        return {
            i: {name: vec[f * n + i] for f, name in enumerate(_FIELDS) if name != "present"}
            for i in range(n) if vec[i] > 0
        }

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if getattr(trainer.strategy, "released", False):  # a released rank holds no layers and joins no pipeline
            return
        if (trainer.global_step - 1) % self.check_interval != 0:  # global_step already counts this step
            return
        stats = self.measure(trainer, pl_module)
        self.last_stats = stats
        if not stats:
            return
        log = dict(on_step=True, on_epoch=False, batch_size=1)
        for i, s in stats.items():
            pl_module.log(f"moe/max_over_mean_load_L{i}", s["max_over_mean"], **log)
            pl_module.log(f"moe/dropped_fraction_L{i}", s["dropped"], **log)
        pl_module.log("moe/max_over_mean_load", max(s["max_over_mean"] for s in stats.values()), **log)
        pl_module.log("moe/dropped_fraction", sum(s["dropped"] for s in stats.values()) / len(stats), **log)
        pl_module.log("moe/aux_loss", sum(s["balance_loss"] for s in stats.values()) / len(stats), **log)
        if isinstance(trainer.strategy, PipelineControl):
            self._maybe_request(trainer, stats)

    def _maybe_request(self, trainer, stats: dict[int, dict[str, float]]) -> None:
        shift = {i: abs(s["load"] - self.baseline.get(i, 1.0)) for i, s in stats.items()}
        worst = max(shift, key=shift.get)
        if shift[worst] <= self.shift_threshold:
            return
        before, after = self.baseline.get(worst, 1.0), stats[worst]["load"]
        reason = f"moe: relative work of layer {worst} moved {before:.2f} -> {after:.2f}"
        trainer.strategy.request_rebalance(reason, reprofile=False)  # routing changed, not structure
        self.baseline = {i: s["load"] for i, s in stats.items()}
        self.requests.append({"step": int(trainer.global_step), "reason": reason})

    def state_dict(self) -> dict[str, Any]:
        return {"baseline": dict(self.baseline), "requests": list(self.requests)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.baseline = {int(k): float(v) for k, v in state_dict.get("baseline", {}).items()}
        self.requests = list(state_dict.get("requests", []))
