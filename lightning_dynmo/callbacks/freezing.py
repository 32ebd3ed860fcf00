"""``LayerFreezing``: freeze converged front layers (Egeria/AutoFreeze style) or on a schedule."""
from __future__ import annotations

import logging
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from ..dynamic._dist import all_reduce_over_pipeline, invalidate_pipeline, local_layers, pipeline_layers, \
    reduce_device, request_rebalance
from ..dynamic.freezing import freeze_layer, layer_grad_norm

log = logging.getLogger(__name__)


class LayerFreezing(Callback):
    """Freeze a growing prefix of ``pl_module.pipeline_layers()`` while training.

    Two criteria, combinable (the frozen prefix is the larger of the two and never shrinks):

    * **Convergence** (``threshold`` not ``None``): every ``interval`` optimizer steps, each
      not-yet-frozen layer's gradient norm is averaged over the interval; a layer is *converged*
      when the relative change ``|g_now - g_prev| / g_prev`` of that average between two
      consecutive intervals is below ``threshold``. The front-most run of converged layers is
      frozen (front to back: a layer is frozen only if every layer before it is frozen or
      converged). Under a pipeline strategy the per-layer sums are one fixed-size vector (length
      = number of layers, zeros for remote layers) all-reduced over ``strategy.pipeline_group``,
      so every rank decides the same.
    * **Schedule** (``schedule={step: n}``): from optimizer step ``step`` on, at least the first
      ``n`` layers are frozen.

    At most ``max_frozen`` layers are frozen (default: all but the last two, i.e. the final norm
    and the head of a GPT stay trainable). Freezing sets ``requires_grad=False``, frees grads and
    optimizer state (see :func:`lightning_dynmo.dynamic.freeze_layer`), then calls
    ``strategy.invalidate_pipeline()`` and ``strategy.request_rebalance("freezing: ...")`` where
    the strategy has them. Logs ``freezing/frozen_layers``.
    """

    def __init__(
        self,
        schedule: dict[int, int] | None = None,
        threshold: float | None = None,
        interval: int = 50,
        max_frozen: int | None = None,
        eps: float = 1e-12,
    ) -> None:
        if schedule is None and threshold is None:
            threshold = 0.05
        if threshold is not None and not threshold > 0:
            raise ValueError(f"threshold must be positive, got {threshold}")
        if int(interval) < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        self.schedule = {int(k): int(v) for k, v in (schedule or {}).items()}
        self.threshold = threshold
        self.interval = int(interval)
        self.max_frozen = max_frozen
        self.eps = float(eps)
        # state (saved in checkpoints)
        self.n_frozen = 0
        self.history: list[dict] = []
        self._prev: list[float] | None = None
        self._window: list[float] | None = None
        self._window_steps = 0
        self._last_step_seen = -1

    # ------------------------------------------------------------------ helpers
    def _num_layers(self, pl_module) -> int:
        layers = pipeline_layers(pl_module)
        return len(layers) if layers is not None else 0

    def _limit(self, pl_module) -> int:
        L = self._num_layers(pl_module)
        return max(0, L - 2) if self.max_frozen is None else max(0, min(int(self.max_frozen), L))

    def scheduled(self, step: int) -> int:
        due = [n for s, n in self.schedule.items() if s <= step]
        return max(due) if due else 0

    def _apply(self, trainer, pl_module, n: int, reason: str, request: bool = True) -> None:
        freed = 0
        for i, layer in local_layers(pl_module):
            if i < n:
                freed += freeze_layer(layer, trainer.optimizers)
        grew = n > self.n_frozen
        if grew:
            self.history.append({"step": int(trainer.global_step), "n_frozen": int(n), "reason": reason})
            log.info("freezing: %d layers frozen at step %d (%s); %d bytes of optimizer state freed",
                     n, trainer.global_step, reason, freed)
        self.n_frozen = max(self.n_frozen, n)
        if request:
            invalidate_pipeline(trainer)
            request_rebalance(trainer, f"freezing: {self.n_frozen} front layers frozen ({reason})")

    # ------------------------------------------------------------------ hooks
    def on_train_start(self, trainer, pl_module) -> None:
        if self.n_frozen:  # resumed: re-apply (the checkpoint holds no optimizer state for them)
            self._apply(trainer, pl_module, self.n_frozen, "resumed")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        target = min(self.scheduled(trainer.global_step), self._limit(pl_module))
        if target > self.n_frozen:
            self._apply(trainer, pl_module, target, f"schedule at step {trainer.global_step}")
        pl_module.log("freezing/frozen_layers", float(self.n_frozen), on_step=True, on_epoch=False, batch_size=1)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.threshold is None or trainer.global_step == self._last_step_seen:
            return  # one sample per step, whatever the number of optimizers
        self._last_step_seen = trainer.global_step
        L = self._num_layers(pl_module)
        if self._window is None or len(self._window) != L:
            self._window = [0.0] * L
        for i, layer in local_layers(pl_module):
            if i >= self.n_frozen:
                self._window[i] += layer_grad_norm(layer)
        self._window_steps += 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.threshold is None or self._window_steps < self.interval or self._window is None:
            return
        vec = torch.tensor(self._window, dtype=torch.float64, device=reduce_device(trainer, pl_module))
        mean = (all_reduce_over_pipeline(trainer, vec) / self._window_steps).cpu().tolist()
        self._window, self._window_steps = [0.0] * len(mean), 0
        prev, self._prev = self._prev, mean
        if prev is None or len(prev) != len(mean):
            return
        layers = pipeline_layers(pl_module)
        n = self.n_frozen
        limit = self._limit(pl_module)
        changes = []
        while n < limit:
            if prev[n] <= self.eps and mean[n] <= self.eps:
                rel = 0.0  # no gradient at all (e.g. parameter-free layer): nothing left to learn
            else:
                rel = abs(mean[n] - prev[n]) / max(prev[n], self.eps)
            if rel >= self.threshold:
                break
            changes.append(round(rel, 4))
            n += 1
        del layers
        if n > self.n_frozen:
            self._apply(trainer, pl_module, n, f"converged, relative grad-norm change {changes} < {self.threshold}")

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "n_frozen": self.n_frozen,
            "history": list(self.history),
            "prev": self._prev,
            "window": self._window,
            "window_steps": self._window_steps,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.n_frozen = int(state_dict.get("n_frozen", 0))
        self.history = list(state_dict.get("history", []))
        self._prev = state_dict.get("prev")
        self._window = state_dict.get("window")
        self._window_steps = int(state_dict.get("window_steps", 0))
