"""Layer freezing mechanics: freezing a layer for real, and the two convergence signals the
``LayerFreezing`` callback uses (per-layer gradient norms; Egeria's plasticity against a
reference copy of the layer).

A frozen layer has ``requires_grad=False`` on every parameter, its ``.grad`` freed and its
optimizer state removed (``opt.state.pop(p)``). The parameters may stay in the optimizer's
param groups: torch optimizers skip parameters whose ``grad`` is ``None``, so a frozen parameter
gets no update (no weight decay either) and holds no optimizer memory.
"""
from __future__ import annotations

import copy

import torch
from torch import nn
from torch.optim import Optimizer

__all__ = ["freeze_layer", "layer_grad_norm", "is_frozen", "snapshot_layer", "plasticity"]


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


# ---------------------------------------------------------------------------------- Egeria-style reference
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called",
               "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks")


@torch.no_grad()
def snapshot_layer(layer: nn.Module, device: torch.device | str | None = None) -> nn.Module:
    """A frozen copy of ``layer`` for reference: parameters and buffers cloned (no gradients, no
    ``requires_grad``), on ``device`` (default: where the layer is), with no hooks (a profiler's
    or a capture hook must not fire on the copy)."""
    memo: dict[int, object] = {}
    for p in layer.parameters():
        memo[id(p)] = nn.Parameter(p.detach().to(device or p.device, copy=True), requires_grad=False)
    for b in layer.buffers():
        memo[id(b)] = b.detach().to(device or b.device, copy=True)
    saved = []  # hooks stay with the original (a bound-method hook would drag its owner along)
    for m in layer.modules():
        for name in _HOOK_DICTS:
            d = getattr(m, name, None)
            if d:
                saved.append((m, name, d))
                setattr(m, name, type(d)())
    try:
        ref = copy.deepcopy(layer, memo)
    finally:
        for m, name, d in saved:
            setattr(m, name, d)
    return ref.train(False)


@torch.no_grad()
def plasticity(layer: nn.Module, reference: nn.Module, x: torch.Tensor, eps: float = 1e-12) -> float:
    """Egeria's plasticity of ``layer``: how far its output on the probe input ``x`` moved from
    its reference copy's, ``||f(x) - f_ref(x)|| / ||f_ref(x)||`` (both in eval mode, no autograd,
    the layer's own hooks bypassed so profilers do not count the probe). The reference runs where
    it lives (e.g. on the CPU, as Egeria keeps it); the difference is taken there."""
    was_training = layer.training
    layer.train(False)
    try:
        y = layer.forward(x)
    finally:
        layer.train(was_training)
    ref_device = next((t.device for t in list(reference.parameters()) + list(reference.buffers())), y.device)
    y_ref = reference.forward(x.to(ref_device))
    diff = (y.to(y_ref.device).float() - y_ref.float()).norm()
    return float(diff / (y_ref.float().norm() + eps))
