"""Auxiliary losses that reach the optimizer without travelling through the pipeline.

A pipeline layer passes exactly one tensor to the next and the schedule only back-propagates the
last stage's loss, so a layer cannot return its auxiliary loss. Instead the loss is attached to
the layer's output (Megatron-Core's ``MoEAuxLossAutoScaler``): the forward is the identity on the
activation; the backward passes the activation's gradient through unchanged and also feeds
``coeff * scale`` as the gradient of the auxiliary loss, i.e. the parameters receive
``d(main + coeff * aux) / d(theta)`` whenever the activation is back-propagated.

``scale`` stands for how the training loop scales the main loss before ``backward``: it is 1 when
the loss is not scaled (``torch.distributed.pipelining`` divides the accumulated gradients by the
micro-batch count after the backward passes, so micro-batched auxiliary gradients are averaged
exactly like the main ones) and ``1 / N`` under Lightning's ``accumulate_grad_batches=N``, which
divides the loss instead. Set it with :func:`set_aux_loss_scale`.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["attach_aux_loss", "set_aux_loss_scale", "aux_loss_scale"]


class _AuxLossAutoScaler(torch.autograd.Function):
    main_loss_backward_scale: float = 1.0

    @staticmethod
    def forward(ctx, activation: Tensor, aux_loss: Tensor, coeff: float) -> Tensor:
        ctx.save_for_backward(aux_loss)
        ctx.coeff = coeff
        # not ``activation`` itself, which autograd would turn into a view: torch.distributed.pipelining's
        # split backward (zero-bubble schedules) detaches stage outputs in place, which views forbid
        return activation.detach()

    @staticmethod
    def backward(ctx, grad: Tensor):
        (aux_loss,) = ctx.saved_tensors
        scale = ctx.coeff * _AuxLossAutoScaler.main_loss_backward_scale
        return grad, torch.full_like(aux_loss, scale), None


def attach_aux_loss(activation: Tensor, aux_loss: Tensor, coeff: float) -> Tensor:
    """``activation`` (same values) whose backward also back-propagates ``coeff * aux_loss``
    (a scalar). Without grad mode this is a no-op."""
    if not (torch.is_grad_enabled() and aux_loss.requires_grad):
        return activation
    return _AuxLossAutoScaler.apply(activation, aux_loss, float(coeff))


def set_aux_loss_scale(scale: float) -> None:
    """The factor the training loop applies to the main loss before ``backward`` (see module
    docstring); process-wide, like Megatron-Core's ``MoEAuxLossAutoScaler.set_loss_scale``."""
    _AuxLossAutoScaler.main_loss_backward_scale = float(scale)


def aux_loss_scale() -> float:
    return _AuxLossAutoScaler.main_loss_backward_scale
