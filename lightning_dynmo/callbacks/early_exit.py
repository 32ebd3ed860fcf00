"""``EarlyExit``: controls the exit threshold of an ``EarlyExitGPT`` and rebalances as tokens drift."""
from __future__ import annotations

import math
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from ._pipeline_access import all_reduce_over_pipeline, local_layers, pipeline_layers, reduce_device, \
    request_rebalance
from ..models.early_exit import ExitBlock


class EarlyExit(Callback):
    """Sets the saturation threshold of every :class:`~lightning_dynmo.dynamic.ExitBlock`, logs
    the fraction of active tokens entering each block, and requests a rebalance when the token
    counts drift.

    Args:
        threshold: exit threshold used outside the schedule (``None``: nobody exits).
        schedule: ``{step: threshold}``, piecewise constant from each step on (``None`` values
            disable exiting). Overrides ``threshold`` once the first key is reached.
        drift: request a rebalance when any block's active fraction differs by more than this
            (absolute fraction, default 0.1) from its value at the last request; the baseline
            before the first request is "every token active", the assumption of the initial
            partition.
        check_interval: measure (one all-reduce of ``2 x num_layers`` numbers over the pipeline
            group) every this many steps.

    Logs ``early_exit/active_fraction_L{i}`` per block, ``early_exit/active_fraction`` (mean over
    blocks, i.e. the fraction of block compute that still runs) and ``early_exit/threshold``.
    """

    def __init__(self, threshold: float | None = None, schedule: dict[int, float | None] | None = None,
                 drift: float = 0.1, check_interval: int = 10) -> None:
        if int(check_interval) < 1:
            raise ValueError(f"check_interval must be >= 1, got {check_interval}")
        self.threshold = None if threshold is None else float(threshold)
        self.schedule = {int(k): (None if v is None else float(v)) for k, v in (schedule or {}).items()}
        self.drift = float(drift)
        self.check_interval = int(check_interval)
        self.baseline: list[float] | None = None  # fractions at the last request
        self.last_fractions: list[float] | None = None
        self.requests: list[dict] = []
        self._saved_counters: dict[int, tuple] = {}

    def threshold_at(self, step: int) -> float | None:
        due = [s for s in self.schedule if s <= step]
        return self.schedule[max(due)] if due else self.threshold

    @staticmethod
    def _blocks(pl_module) -> list[tuple[int, ExitBlock]]:
        return [(i, l) for i, l in local_layers(pl_module) if isinstance(l, ExitBlock)]

    def _set_threshold(self, pl_module, step: int) -> float | None:
        thr = self.threshold_at(step)
        for _, block in self._blocks(pl_module):
            block.exit_threshold = thr
        return thr

    def setup(self, trainer, pl_module, stage: str) -> None:
        if not self._blocks(pl_module):
            raise TypeError(
                f"EarlyExit needs a model whose pipeline layers include ExitBlock layers "
                f"(e.g. lightning_dynmo.dynamic.EarlyExitGPT), got {type(pl_module).__name__}"
            )

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        thr = self._set_threshold(pl_module, trainer.global_step)
        pl_module.log("early_exit/threshold", math.nan if thr is None else thr, on_step=True, on_epoch=False,
                      batch_size=1)

    def measure(self, trainer, pl_module) -> list[float]:
        """Fraction of active tokens entering each layer since the last measurement (NaN for
        non-block layers); resets the counters. Collective under a pipeline strategy."""
        L = len(pipeline_layers(pl_module))
        vec = torch.zeros(2 * L, dtype=torch.float64, device=reduce_device(trainer, pl_module))
        for i, block in self._blocks(pl_module):
            vec[i] = block.tokens_active
            vec[L + i] = block.tokens_seen
            block.reset_counters()
        vec = all_reduce_over_pipeline(trainer, vec).cpu().tolist()
        return [vec[i] / vec[L + i] if vec[L + i] > 0 else math.nan for i in range(L)]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (trainer.global_step % self.check_interval) != 0:
            return
        fr = self.measure(trainer, pl_module)
        self.last_fractions = fr
        blocks = [i for i, f in enumerate(fr) if not math.isnan(f)]
        for i in blocks:
            pl_module.log(f"early_exit/active_fraction_L{i}", fr[i], on_step=True, on_epoch=False, batch_size=1)
        if blocks:
            pl_module.log("early_exit/active_fraction", sum(fr[i] for i in blocks) / len(blocks), on_step=True,
                          on_epoch=False, batch_size=1)
        base = self.baseline or [1.0] * len(fr)
        if len(base) != len(fr):
            base = [1.0] * len(fr)
        deltas = [abs(fr[i] - base[i]) for i in blocks]
        if deltas and max(deltas) > self.drift:
            worst = max(blocks, key=lambda i: abs(fr[i] - base[i]))
            reason = (f"early exit: active fraction of layer {worst} moved {base[worst]:.2f} -> {fr[worst]:.2f}")
            request_rebalance(trainer, reason, reprofile=False)  # fewer tokens, same computation
            self.baseline = [1.0 if math.isnan(f) else f for f in fr]
            self.requests.append({"step": int(trainer.global_step), "reason": reason})

    # validation tokens do not count towards the training-time token drift
    def on_validation_start(self, trainer, pl_module) -> None:
        self._saved_counters = {
            i: (b.tokens_seen, b.tokens_active, b.tokens_computed, b.tokens_exited) for i, b in self._blocks(pl_module)
        }

    def on_validation_end(self, trainer, pl_module) -> None:
        for i, b in self._blocks(pl_module):
            b.tokens_seen, b.tokens_active, b.tokens_computed, b.tokens_exited = self._saved_counters.get(i,
                                                                                                          (0, 0, 0, 0))
        self._saved_counters = {}

    def state_dict(self) -> dict[str, Any]:
        # threshold/schedule are configuration (the threshold in force follows the restored step)
        return {"baseline": self.baseline, "last_fractions": self.last_fractions, "requests": list(self.requests)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.baseline = state_dict.get("baseline")
        self.last_fractions = state_dict.get("last_fractions")
        self.requests = list(state_dict.get("requests", []))
