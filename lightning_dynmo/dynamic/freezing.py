"""Layer freezing mechanics: per-layer gradient norms and freezing a layer for real.

A frozen layer has ``requires_grad=False`` on every parameter, its ``.grad`` freed and its
optimizer state removed (``opt.state.pop(p)``). The parameters may stay in the optimizer's
param groups: torch optimizers skip parameters whose ``grad`` is ``None``, so a frozen parameter
gets no update (no weight decay either) and holds no optimizer memory.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.optim import Optimizer

__all__ = ["freeze_layer", "layer_grad_norm", "is_frozen"]


def _unwrap(opt) -> Optimizer:
    return getattr(opt, "_optimizer", opt)  # Lightning may wrap optimizers


def freeze_layer(layer: nn.Module, optimizers: list | tuple = ()) -> int:
    """Freeze ``layer``: no grad, no optimizer state. Returns bytes of optimizer state freed."""
    freed = 0
    for p in layer.parameters():
        p.requires_grad_(False)
        p.grad = None
        for opt in optimizers:
            state = _unwrap(opt).state.pop(p, None)
            if state:
                freed += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
    return freed


def is_frozen(layer: nn.Module) -> bool:
    params = list(layer.parameters())
    return bool(params) and not any(p.requires_grad for p in params)


@torch.no_grad()
def layer_grad_norm(layer: nn.Module) -> float:
    """L2 norm of all gradients of ``layer`` (0.0 when it has none)."""
    sq = [p.grad.detach().float().pow(2).sum() for p in layer.parameters() if p.grad is not None]
    return float(torch.stack(sq).sum().sqrt()) if sq else 0.0
