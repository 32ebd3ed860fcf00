"""Parameter gradients as a dict, the form single-process comparisons take."""
from __future__ import annotations

import torch
from torch import nn


def param_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every parameter gradient by name; parameters without one are left out (so a
    comparison of the keys sees a gradient that one side has and the other lacks)."""
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
