"""Auxiliary losses that reach the optimizer without travelling through the pipeline.

A pipeline layer passes exactly one tensor to the next and the schedule only back-propagates the
last stage's loss, so a layer cannot return its auxiliary loss. Instead the loss is attached to
the layer's output (Megatron-Core's ``MoEAuxLossAutoScaler``): the forward is the identity on the
activation; the backward passes the activation's gradient through unchanged and also feeds
``coeff * scale * S`` as the gradient of the auxiliary loss, i.e. the parameters receive
``d(main + coeff * aux) / d(theta)`` (times the same factors as the main loss) whenever the
activation is back-propagated.

The aux gradient must be multiplied by exactly what the training loop multiplies the main loss by
before ``backward``, or it is silently mis-weighted against the main gradient:

* ``scale`` (:func:`set_aux_loss_scale`) is 1 when the loss is not divided
  (``torch.distributed.pipelining`` divides the accumulated gradients by the micro-batch count
  after the backward passes, so micro-batched auxiliary gradients are averaged exactly like the
  main ones) and ``1 / N`` under Lightning's ``accumulate_grad_batches=N``, which divides the loss.
* ``S`` is the current scale of the fp16 grad scaler (``precision="16-mixed"``), registered with
  :func:`set_aux_loss_grad_scaler` (1 when none is registered). Single-process Lightning computes
  ``scaler.scale(loss)`` before ``backward`` and the pipeline's last stage does the same
  (``runtime/precision.py``); ``scaler.unscale_`` then divides *every* gradient by ``S``. Without
  ``S`` here the auxiliary gradients would end up divided by it (~65536): they would vanish.
  ``S`` is read from the scaler's scale tensor at backward time (no host sync). A scaler that has
  not scaled anything yet on this rank (a non-last pipeline stage in the first step, before
  Lightning's ``pre_backward``) will start from its ``init_scale``, which is what the last stage
  scaled the loss by.

The models' ``on_train_start`` calls :func:`configure_aux_loss` with their trainer, which sets
both from ``accumulate_grad_batches`` and the precision plugin. Both settings are process-wide,
like Megatron-Core's ``MoEAuxLossAutoScaler.set_loss_scale``, and stay until set again.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..protocol.services import grad_scaler

__all__ = [
    "attach_aux_loss",
    "aux_loss_grad_scaler",
    "aux_loss_scale",
    "configure_aux_loss",
    "reset_aux_loss",
    "set_aux_loss_grad_scaler",
    "set_aux_loss_scale",
]


class _AuxLossAutoScaler(torch.autograd.Function):
    main_loss_backward_scale: float = 1.0
    grad_scaler: torch.amp.GradScaler | None = None

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
        return grad, _aux_grad(aux_loss, ctx.coeff * _AuxLossAutoScaler.main_loss_backward_scale), None


def _aux_grad(aux_loss: Tensor, factor: float) -> Tensor:
    """``factor * S`` shaped like ``aux_loss`` (``S``: the registered grad scaler's scale)."""
    scaler = _AuxLossAutoScaler.grad_scaler
    if scaler is None or not scaler.is_enabled():
        return torch.full_like(aux_loss, factor)
    scale = scaler._scale
    if scale is None:  # lazily created by its first ``scale()``, with ``init_scale``
        return torch.full_like(aux_loss, factor * scaler._init_scale)
    # S is a power of two: multiplying in (at least) fp32 is exact, and unscale_ undoes it exactly
    dtype = torch.promote_types(aux_loss.dtype, torch.float32)
    s = scale.to(device=aux_loss.device, dtype=dtype, non_blocking=True) * factor
    return s.expand(aux_loss.shape).to(aux_loss.dtype, copy=True)


def attach_aux_loss(activation: Tensor, aux_loss: Tensor, coeff: float) -> Tensor:
    """``activation`` (same values) whose backward also back-propagates ``coeff * aux_loss``
    (a scalar). Without grad mode this is a no-op."""
    if not (torch.is_grad_enabled() and aux_loss.requires_grad):
        return activation
    return _AuxLossAutoScaler.apply(activation, aux_loss, float(coeff))


def set_aux_loss_scale(scale: float) -> None:
    """The factor the training loop divides/multiplies the main loss by before ``backward``,
    other than a grad scaler's (see module docstring); process-wide."""
    _AuxLossAutoScaler.main_loss_backward_scale = float(scale)


def aux_loss_scale() -> float:
    return _AuxLossAutoScaler.main_loss_backward_scale


def set_aux_loss_grad_scaler(scaler: torch.amp.GradScaler | None) -> None:
    """The grad scaler whose current scale multiplies the main loss before ``backward`` (``None``:
    no scaler); process-wide. Its scale is read at each backward, so ``scaler.update()`` is
    followed automatically."""
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"set_aux_loss_grad_scaler needs a torch.amp.GradScaler or None, got {type(scaler).__name__}")
    _AuxLossAutoScaler.grad_scaler = scaler


def aux_loss_grad_scaler() -> torch.amp.GradScaler | None:
    return _AuxLossAutoScaler.grad_scaler


def configure_aux_loss(trainer) -> None:
    """Match the auxiliary gradients to how ``trainer`` scales the main loss: ``1 / N`` for
    ``accumulate_grad_batches=N`` and its precision plugin's enabled grad scaler, if any (the
    pipeline strategy divides its losses by the same ``N``, strategy/accumulation.py, and scales
    by the same plugin's scaler)."""
    set_aux_loss_scale(1.0 / trainer.accumulate_grad_batches)
    set_aux_loss_grad_scaler(grad_scaler(trainer.precision_plugin))


def reset_aux_loss() -> None:
    """Unscaled auxiliary gradients again (scale 1, no grad scaler). The models call it when
    ``fit`` ends, so plain autograd later in the same process is not scaled by a finished run's
    factors (the settings are process-wide)."""
    set_aux_loss_scale(1.0)
    set_aux_loss_grad_scaler(None)
