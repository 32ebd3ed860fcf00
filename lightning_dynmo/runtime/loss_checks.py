"""The contract of a model's ``pipeline_loss(output, target)``: a scalar floating-point tensor
that needs a gradient when the output does. Checked once at spec discovery (on the last stage's
real output) and on every call inside the schedule, each failure naming the fix."""
from __future__ import annotations

import inspect
from typing import Callable

import torch

from ..protocol import PipelineProtocolError
from ..protocol.activations import unpack

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def loss_name(loss_fn: LossFn) -> str:
    owner = getattr(inspect.unwrap(loss_fn), "__self__", None)
    if owner is not None:
        return f"{type(owner).__name__}.pipeline_loss"
    return getattr(loss_fn, "__qualname__", "pipeline_loss")


def check_loss_value(loss, loss_fn: LossFn) -> str | None:
    """Why ``loss`` cannot drive a backward (None: it can)."""
    if not isinstance(loss, torch.Tensor):
        return (f"{loss_name(loss_fn)}(output, target) must return a scalar tensor (the micro-batch's mean loss), "
                f"it returned {type(loss).__name__}")
    if loss.numel() != 1:
        return (f"{loss_name(loss_fn)}(output, target) must return a scalar (0-dim) tensor, the micro-batch's mean "
                f"loss; it returned shape {list(loss.shape)}. Reduce it, e.g. `return loss.mean()` or "
                "F.cross_entropy(..., reduction='mean')")
    if not loss.is_floating_point():
        return f"{loss_name(loss_fn)}(output, target) must return a floating-point loss, it returned {loss.dtype}"
    return None


def check_loss_grad(loss_fn: LossFn, acts: tuple, needs_grad: tuple, target: torch.Tensor) -> str | None:
    """:func:`check_loss_value` on the last layer's output (``acts``, one tensor or several, each
    with whether it needs a gradient), plus: a loss of an output that needs a gradient must need
    one too (``out.detach()`` in the loss would train nothing, where one process raises)."""
    with torch.enable_grad():
        output = unpack(tuple(t.detach().requires_grad_(bool(g)) for t, g in zip(acts, needs_grad)))
        loss = loss_fn(output, target)
    problem = check_loss_value(loss, loss_fn)
    if problem is None and any(needs_grad) and not loss.requires_grad:
        problem = (f"{loss_name(loss_fn)}(output, target) returned a loss that does not require grad, so no "
                   "gradient would reach any layer (single-process Lightning raises here too). Compute the loss "
                   "from `output` without `.detach()`, `.item()` or `torch.no_grad()`")
    return problem


def checked_loss(loss_fn: LossFn) -> LossFn:
    """``loss_fn`` with a check that names the fix (the schedule calls it on the last stage)."""

    def fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(output, target)
        problem = check_loss_value(loss, loss_fn)
        if problem:
            raise PipelineProtocolError(problem)
        return loss

    return fn
