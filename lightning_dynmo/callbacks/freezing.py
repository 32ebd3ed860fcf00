"""``LayerFreezing``: freeze converged front layers (Egeria or gradient-norm criterion) or on a schedule."""
from __future__ import annotations

import logging
import math
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.nn.modules.module import register_module_forward_pre_hook

from ._pipeline_access import (all_reduce_over_pipeline, invalidate_pipeline, local_layers, pipeline_layers,
    pipeline_of, pipeline_reduce_group, reduce_device, request_rebalance)
from ..dynamic.freezing import freeze_layer, layer_grad_norm, plasticity, snapshot_layer

log = logging.getLogger(__name__)

_REFERENCE = "_dynmo_egeria_reference"


def reference_of(layer: torch.nn.Module) -> torch.nn.Module | None:
    """The Egeria reference copy riding on ``layer``. It is kept in the layer's ``__dict__`` inside
    a tuple: not a submodule (no parameters, no state-dict entries), but part of the layer object,
    so a migration (which ships a deep copy of the layer's structure) carries it to the layer's
    new rank and a freshly received layer is evaluated at once rather than an interval later."""
    held = layer.__dict__.get(_REFERENCE)
    return held[0] if held else None


def set_reference(layer: torch.nn.Module, reference: torch.nn.Module | None) -> None:
    if reference is None:
        layer.__dict__.pop(_REFERENCE, None)
    else:
        layer.__dict__[_REFERENCE] = (reference,)


def _units(pl_module) -> tuple[int, ...] | None:
    fn = getattr(pl_module, "pipeline_layer_units", None)
    return fn() if callable(fn) else None


def whole_units(pl_module, n: int, up: bool) -> int:
    """The prefix of ``n`` pipeline layers widened (``up``) or narrowed to whole units, so that a
    block split into sublayers (``pl_module.pipeline_layer_units()``) is never half frozen."""
    units = _units(pl_module)
    if not units:
        return n
    n = max(0, min(int(n), len(units)))
    while 0 < n < len(units) and units[n] == units[n - 1]:
        n += 1 if up else -1
    return n


class LayerFreezing(Callback):
    """Freeze a growing prefix of ``pl_module.pipeline_layers()`` while training.

    Criteria, combinable with a schedule (the frozen prefix is the larger of the two and never
    shrinks); freezing runs front to back: a layer is frozen only if every layer before it is.

    * ``criterion="reference"`` (Egeria, Wang et al. 2023, as DynMo's appendix F.4 runs it):
      every ``interval`` optimizer steps, each of the ``lookahead`` front-most trainable layers is
      compared with a **reference copy** of itself taken at the previous evaluation (held on
      ``reference_device``, CPU by default, as Egeria keeps it; under a pipeline each rank copies
      only its own layers, and a layer that migrates takes its reference along). Its *plasticity* is ``||f(x) -
      f_ref(x)|| / ||f_ref(x)||`` on a probe input ``x`` (the layer's input in the first micro-batch of the evaluation
      step, captured by a global forward pre-hook, so no hook ever sits on a layer that might migrate): how much
      the layer's function moved over the last interval. A layer is *converged* when its
      plasticity stops changing, ``|p_t - p_{t-1}| / p_{t-1} < threshold`` for ``patience``
      evaluations in a row, or drops below ``min_plasticity``. Up to ``max_per_event`` converged
      front layers freeze per evaluation (default 1: progressive freezing, one layer per
      ``interval`` once layers converge); then the references are refreshed. Plasticities are
      agreed by one all-reduce over the world (pipeline stages own different layers, data-parallel
      replicas probe different batches: the mean is used), so every rank decides the same.
    * ``criterion="grad_norm"`` (AutoFreeze-like, the default): every ``interval`` optimizer
      steps, each not-yet-frozen layer's gradient norm is averaged over the interval; a layer is
      converged when the relative change ``|g_now - g_prev| / g_prev`` of that average between two
      consecutive intervals is below ``threshold``. The per-layer sums are one fixed-size vector
      all-reduced over ``strategy.pipeline.pipeline_group`` and averaged over the data-parallel replicas
      (which differ where they hold different parts of a layer: expert shards, FSDP shards), so
      every rank decides the same.
    * **Schedule** (``schedule={step: n}``): from optimizer step ``step`` on, at least the first
      ``n`` layers are frozen. ``threshold=None`` with a schedule: schedule only.

    At most ``max_frozen`` layers are frozen (default: all but the last two, i.e. the final norm
    and the head of a GPT stay trainable). Counts are pipeline layers; for a model split into
    sublayers (``pipeline_layer_units()``, e.g. ``GPTConfig(pipeline_granularity="sublayer")``) the
    frozen prefix always ends at a whole block: freezing a block freezes all its pieces (a schedule's
    count is rounded up to whole blocks, a converged prefix and ``max_frozen`` down). Freezing sets
    ``requires_grad=False``, frees grads and optimizer state (see :func:`lightning_dynmo.dynamic.freeze_layer`): a
    frozen prefix builds no autograd graph, its stages run no backward, and its parameters (gradient ``None``) skip the
    data-parallel all-reduce. Each freeze calls ``strategy.pipeline.invalidate_pipeline()`` and
    ``strategy.pipeline.request_rebalance("freezing: ...")`` where the strategy has them. Logs
    ``freezing/frozen_layers``; ``history`` records each freeze (step, count, reason).
    """

    def __init__(
        self,
        schedule: dict[int, int] | None = None,
        threshold: float | None = None,
        interval: int = 50,
        max_frozen: int | None = None,
        eps: float = 1e-12,
        criterion: Literal["grad_norm", "reference"] = "grad_norm",
        patience: int = 1,
        min_plasticity: float | None = None,
        max_per_event: int | None = None,
        lookahead: int = 2,
        reference_device: str | torch.device | None = "cpu",
    ) -> None:
        if criterion not in ("grad_norm", "reference"):
            raise ValueError(f"criterion must be 'grad_norm' or 'reference', got {criterion!r}")
        if schedule is None and threshold is None:
            threshold = 0.05
        if threshold is not None and not threshold > 0:
            raise ValueError(f"threshold must be positive, got {threshold}")
        if int(interval) < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        if int(patience) < 1 or int(lookahead) < 1:
            raise ValueError(f"patience and lookahead must be >= 1, got {patience}, {lookahead}")
        if max_per_event is not None and int(max_per_event) < 1:
            raise ValueError(f"max_per_event must be >= 1 or None, got {max_per_event}")
        self.schedule = {int(k): int(v) for k, v in (schedule or {}).items()}
        self.threshold = threshold
        self.interval = int(interval)
        self.max_frozen = max_frozen
        self.eps = float(eps)
        self.criterion = criterion
        self.patience = int(patience)
        self.min_plasticity = None if min_plasticity is None else float(min_plasticity)
        self.max_per_event = None if max_per_event is None else int(max_per_event)
        self.lookahead = int(lookahead)
        self.reference_device = reference_device
        # state (saved in checkpoints)
        self.n_frozen = 0
        self._frozen_units = 0  # the frozen prefix in blocks (granularity-independent; in checkpoints)
        self.history: list[dict] = []
        self._prev: list[float] | None = None
        self._window: list[float] | None = None
        self._window_steps = 0
        self._last_step_seen = -1
        self.plasticity: dict[int, list[float]] = {}  # layer -> plasticity at each evaluation
        self._last_eval = -1
        # Egeria references ride on their layers (see reference_of); not saved: rebuilt at the
        # first evaluation after a resume
        self._probe: dict[int, torch.Tensor] = {}
        self._capture_ids: dict[int, int] | None = None
        self._hook = None

    # ------------------------------------------------------------------ helpers
    def _num_layers(self, pl_module) -> int:
        layers = pipeline_layers(pl_module)
        return len(layers) if layers is not None else 0

    def _limit(self, pl_module) -> int:
        L = self._num_layers(pl_module)
        limit = max(0, L - 2) if self.max_frozen is None else max(0, min(int(self.max_frozen), L))
        return whole_units(pl_module, limit, up=False)

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
        units = _units(pl_module)
        self._frozen_units = units[self.n_frozen - 1] + 1 if units and self.n_frozen else self.n_frozen
        if request:
            invalidate_pipeline(trainer)
            request_rebalance(trainer, f"freezing: {self.n_frozen} front layers frozen ({reason})")

    # ------------------------------------------------------------------ hooks
    def on_train_start(self, trainer, pl_module) -> None:
        units = _units(pl_module)
        if units and self._frozen_units:  # as many whole blocks as the saving run, at this run's granularity
            self.n_frozen = sum(1 for u in units if u < self._frozen_units)
        if self.n_frozen:  # resumed: re-apply (the checkpoint holds no optimizer state for them)
            self._apply(trainer, pl_module, self.n_frozen, "resumed")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        target = min(whole_units(pl_module, self.scheduled(trainer.global_step), up=True), self._limit(pl_module))
        if target > self.n_frozen:
            self._apply(trainer, pl_module, target, f"schedule at step {trainer.global_step}")
        pl_module.log("freezing/frozen_layers", float(self.n_frozen), on_step=True, on_epoch=False, batch_size=1)
        if self.threshold is not None and self.criterion == "reference" and self._evaluation_due(trainer):
            self._start_capture(pl_module)
            self._last_eval = trainer.global_step

    def on_train_end(self, trainer, pl_module) -> None:
        self._stop_capture()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._stop_capture()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.threshold is None or self.criterion != "grad_norm" or trainer.global_step == self._last_step_seen:
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
        if self.threshold is not None and self.criterion == "reference":
            self._reference_step_end(trainer, pl_module)
            return
        if self.threshold is None or self._window_steps < self.interval or self._window is None:
            return
        vec = torch.tensor(self._window, dtype=torch.float64, device=reduce_device(trainer, pl_module))
        vec = all_reduce_over_pipeline(trainer, vec)
        dp_group = getattr(pipeline_of(trainer), "data_parallel_group", None)
        if pipeline_reduce_group(trainer)[0] and dp_group is not None:
            # replicas hold the same averaged gradients, except where they hold different parts of a
            # layer (expert shards under expert_parallel, FSDP shards): their mean, so all decide alike
            dist.all_reduce(vec, group=dp_group)
            vec /= dist.get_world_size(dp_group)
        mean = (vec / self._window_steps).cpu().tolist()
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
        n = whole_units(pl_module, n, up=False)  # a block freezes when all its pieces converged
        if n > self.n_frozen:
            self._apply(trainer, pl_module, n, f"converged, relative grad-norm change {changes} < {self.threshold}")

    # ------------------------------------------------------------------ Egeria reference criterion
    def _evaluation_due(self, trainer) -> bool:
        return self._last_eval < 0 or trainer.global_step - self._last_eval >= self.interval

    def _window_indices(self, pl_module) -> range:
        return range(self.n_frozen, min(self.n_frozen + self.lookahead, self._limit(pl_module)))

    def _start_capture(self, pl_module) -> None:
        """Capture the input of each window layer in this step's first forward through it. A
        global forward pre-hook (removed at the end of the step) finds the layers by identity
        when it first fires, i.e. after any migration at the start of the step, and no hook is
        ever attached to a layer (layers that move between ranks must not carry one)."""
        self._stop_capture()
        self._probe, self._capture_ids = {}, None
        window = self._window_indices(pl_module)

        def capture(module, args):
            if self._capture_ids is None:
                self._capture_ids = {id(layer): i for i, layer in local_layers(pl_module) if i in window}
            i = self._capture_ids.get(id(module))
            if i is not None and i not in self._probe and args and torch.is_tensor(args[0]):
                self._probe[i] = args[0].detach().clone()

        self._hook = register_module_forward_pre_hook(capture)

    def _stop_capture(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._capture_ids = None

    def _agree(self, trainer, pl_module, values: dict[int, float]) -> list[float]:
        """Mean over every rank that measured a layer (NaN where none did); one all-reduce over
        the world when there are several processes."""
        L = self._num_layers(pl_module)
        vec = torch.zeros(2 * L, dtype=torch.float64, device=reduce_device(trainer, pl_module))
        for i, v in values.items():
            vec[i] += v
            vec[L + i] += 1.0
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            dist.all_reduce(vec)
        out = vec.cpu().tolist()
        return [out[i] / out[L + i] if out[L + i] > 0 else math.nan for i in range(L)]

    def _converged(self, i: int) -> bool:
        hist = [p for p in self.plasticity.get(i, []) if p == p]
        if self.min_plasticity is not None and hist and hist[-1] <= self.min_plasticity:
            return True
        if len(hist) < self.patience + 1:
            return False
        recent = hist[-(self.patience + 1):]
        return all(abs(b - a) <= self.threshold * max(a, self.eps) for a, b in zip(recent, recent[1:]))

    def _reference_step_end(self, trainer, pl_module) -> None:
        if self._hook is None:
            return
        self._stop_capture()
        local = dict(local_layers(pl_module))
        measured = {i: plasticity(local[i], reference_of(local[i]), x, self.eps)
                    for i, x in self._probe.items() if i in local and reference_of(local[i]) is not None}
        self._probe = {}
        agreed = self._agree(trainer, pl_module, measured)
        for i in self._window_indices(pl_module):
            if agreed[i] == agreed[i]:
                self.plasticity.setdefault(i, []).append(round(agreed[i], 8))
        n, limit = self.n_frozen, self._limit(pl_module)
        cap = n + (self.max_per_event if self.max_per_event is not None else limit)
        while n < min(limit, cap) and self._converged(n):
            n += 1
        n = max(self.n_frozen, whole_units(pl_module, n, up=False))
        if n > self.n_frozen:
            recent = {i: self.plasticity[i][-(self.patience + 1):] for i in range(self.n_frozen, n)}
            self._apply(trainer, pl_module, n, f"plasticity plateau {recent} (threshold {self.threshold})")
        # refresh the references of the (new) window's local layers; forget the rest
        window = set(self._window_indices(pl_module))
        for i, layer in local.items():
            set_reference(layer, None)
            if i in window:
                set_reference(layer, snapshot_layer(layer, self.reference_device))

    @staticmethod
    def references(pl_module) -> dict[int, torch.nn.Module]:
        """This rank's reference copies by layer index."""
        return {i: ref for i, layer in local_layers(pl_module) if (ref := reference_of(layer)) is not None}

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "n_frozen": self.n_frozen,
            "frozen_units": self._frozen_units,
            "history": list(self.history),
            "prev": self._prev,
            "window": self._window,
            "window_steps": self._window_steps,
            "plasticity": {str(k): list(v) for k, v in self.plasticity.items()},
            "last_eval": self._last_eval,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.n_frozen = int(state_dict.get("n_frozen", 0))
        self._frozen_units = int(state_dict.get("frozen_units", 0))
        self.history = list(state_dict.get("history", []))
        self._prev = state_dict.get("prev")
        self._window = state_dict.get("window")
        self._window_steps = int(state_dict.get("window_steps", 0))
        self.plasticity = {int(k): list(v) for k, v in state_dict.get("plasticity", {}).items()}
        self._last_eval = int(state_dict.get("last_eval", -1))
