"""Mixture-of-Depths settings: :class:`MoDConfig` and the checks of its values.

Kept apart from the blocks (:mod:`lightning_dynmo.models.mod`) so that configuration, callbacks
and validation need no model code; ``lightning_dynmo.models.mod`` re-exports every name here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from .._config import ModelConfig

__all__ = ["GATES", "ROUTING_MODES", "MoDConfig", "check_capacity", "check_predictor_threshold"]

ROUTING_MODES = ("expert_choice", "predictor", "threshold")
GATES = ("sigmoid", "raw")


@dataclass
class MoDConfig(ModelConfig):
    """Mixture-of-Depths settings (see :mod:`lightning_dynmo.models.mod`).

    Args:
        capacity: fraction of each row's tokens a block takes under ``expert_choice``, and the
            top-k target the predictor learns; in ``(0, 1]``.
        every: blocks ``every-1, 2*every-1, ...`` (0-based) are MoD blocks (2: every other block,
            starting with the second, as in the paper; 1: every block).
        routing: ``"expert_choice"`` | ``"predictor"`` | ``"threshold"``.
        threshold: router-logit threshold of ``routing="threshold"``.
        gate: ``"sigmoid"`` (``2 sigmoid(r)``) | ``"raw"`` (``r``, the paper's).
        predictor_hidden: hidden width of the predictor MLP.
        predictor_loss_coeff: weight of the predictor's BCE in the gradients.
        predictor_threshold: ``"calibrated"`` (a per-block logit threshold that keeps the picked
            fraction at the capacity, see the module docstring) or a float, a fixed logit
            threshold (``0.0``: the paper's ``p > 0.5``, which picks nothing at low capacity
            until the predictor has learned). Predictor routing only.
        predictor_threshold_rate: step of the calibrated threshold per batch, in logits per
            unit of relative error ``(fraction - capacity) / capacity`` (0.1: -0.1 when a
            block picks nothing, +0.7 when it picks everything at capacity 0.125).
        predictor_lr: peak learning rate of the predictors' own optimizer groups in
            ``MoDGPT.configure_optimizers`` (the schedule scales it like the model's); ``None``:
            the model's ``lr``. Why its own: Adam moves a weight by about the rate per step
            whatever the loss's scale, and at a model's rate (6e-4) the predictor's logits stay
            within 0.01 of each other for hundreds of steps, so every token lands on one side of
            the threshold (all or none picked).
    """

    argument: ClassVar[str] = "mod"

    capacity: float = 0.125
    every: int = 2
    routing: str = "expert_choice"
    threshold: float = 0.0
    gate: str = "sigmoid"
    predictor_hidden: int = 64
    predictor_loss_coeff: float = 0.01
    predictor_threshold: str | float = "calibrated"
    predictor_threshold_rate: float = 0.1
    predictor_lr: float | None = 0.05

    def __post_init__(self) -> None:
        check_capacity(self.capacity)
        if isinstance(self.every, bool) or int(self.every) != self.every or self.every < 1:
            raise ValueError(f"MoD every must be an integer >= 1 (1: every block is MoD), got {self.every!r}")
        self.every = int(self.every)
        if self.routing not in ROUTING_MODES:
            raise ValueError(f"unknown MoD routing {self.routing!r}; use one of {', '.join(ROUTING_MODES)}")
        if self.gate not in GATES:
            raise ValueError(f"unknown MoD gate {self.gate!r}; use one of {', '.join(GATES)}")
        if not math.isfinite(self.threshold):
            raise ValueError(f"MoD threshold must be a finite router logit, got {self.threshold!r}")
        if int(self.predictor_hidden) < 1:
            raise ValueError(f"MoD predictor_hidden must be >= 1, got {self.predictor_hidden!r}")
        self.predictor_hidden = int(self.predictor_hidden)
        if not (math.isfinite(self.predictor_loss_coeff) and self.predictor_loss_coeff >= 0):
            raise ValueError(f"MoD predictor_loss_coeff must be finite and >= 0, got {self.predictor_loss_coeff!r}")
        self.predictor_threshold = check_predictor_threshold(self.predictor_threshold)
        rate = self.predictor_threshold_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"MoD predictor_threshold_rate must be a finite number > 0 (default 0.1), got {rate!r}")
        self.predictor_threshold_rate = float(rate)
        lr = self.predictor_lr
        if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float))
                               or not (math.isfinite(lr) and lr > 0)):
            raise ValueError(f"MoD predictor_lr must be a finite number > 0 (default 0.05) or None (the model's lr), "
                             f"got {lr!r}")
        self.predictor_lr = None if lr is None else float(lr)

    def is_mod_block(self, i: int) -> bool:
        return (i + 1) % self.every == 0


def check_predictor_threshold(value: str | float) -> str | float:
    if isinstance(value, str):
        if value != "calibrated":
            raise ValueError(f"unknown MoD predictor_threshold {value!r}; use 'calibrated' or a float logit threshold "
                             "(0.0: the paper's p > 0.5)")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"MoD predictor_threshold must be 'calibrated' or a float logit threshold, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"MoD predictor_threshold must be a finite logit (0.0: the paper's p > 0.5) or "
                         f"'calibrated', got {value!r}")
    return float(value)


def check_capacity(capacity: float) -> float:
    if not (isinstance(capacity, (int, float)) and 0.0 < capacity <= 1.0):
        raise ValueError(f"MoD capacity is the fraction of tokens a block takes and must be in (0, 1], "
                         f"got {capacity!r}")
    return float(capacity)
