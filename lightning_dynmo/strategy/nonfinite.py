"""The step's non-finite-loss policy (``on_nonfinite``): decided from the shared loss, so every
rank reaches the same verdict and none waits alone."""
from __future__ import annotations

import math
import warnings
from enum import StrEnum

import torch


class OnNonfinite(StrEnum):
    """What a step whose training loss is NaN/Inf does: the ``on_nonfinite`` option."""

    ERROR = "error"
    SKIP = "skip"
    IGNORE = "ignore"


class NonFiniteLossError(FloatingPointError):
    """A training step's loss was NaN or Inf (``on_nonfinite="error"``)."""


def check_loss(loss: torch.Tensor, step: int, on_nonfinite: OnNonfinite) -> bool:
    """Whether the step's optimizer update should be applied. ``loss`` is the step's shared loss
    (identical on every rank), so every rank reaches the same verdict and none waits alone."""
    value = float(loss)
    if math.isfinite(value) or on_nonfinite == OnNonfinite.IGNORE:
        return True
    if on_nonfinite == OnNonfinite.SKIP:
        warnings.warn(f"dynmo: training loss is {value} at step {step}; skipping this step's update "
                      "(on_nonfinite='skip')", UserWarning, stacklevel=2)
        return False
    raise NonFiniteLossError(
        f"training loss is {value} (non-finite) at step {step}; stopping instead of training on with NaN weights. "
        "Lower the learning rate, clip gradients (gradient_clip_val) or check the data; pass "
        "DynMoStrategy(on_nonfinite='skip') to skip such steps (e.g. with fp16 loss scaling) or 'ignore' to keep going"
    )
