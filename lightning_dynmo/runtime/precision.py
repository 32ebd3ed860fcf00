"""Lightning's precision plugins under the pipeline.

The pipeline runs forward *and* backward inside ``training_step`` (in the plugin's
``train_step_context``, so autocast covers every stage's forward and the loss, as it covers a
single-process ``training_step``), which changes two things for a plugin with a grad scaler
(``"16-mixed"``):

* **Loss scaling happens in the schedule.** Lightning scales the loss in ``pre_backward``, after
  the pipeline has already run backward. The last stage therefore computes
  ``scaler.scale(pipeline_loss(...))`` itself (:func:`pipeline_loss_fn`) and the scaled gradient
  flows back through every stage, exactly the gradients of a single-process scaled backward. The
  losses the schedule returns are divided by the same scale (:func:`unscale_losses`; the scale is
  a power of two, so this is exact) before they are reported.
* **Every rank must make the same step/skip decision.** ``scaler.unscale_(optimizer)`` checks for
  inf/NaN in the gradients *this rank* holds. If one stage overflowed and another did not, one
  rank would skip its step and the other would not, and their scales would drift apart.
  :func:`install_found_inf_agreement` makes ``unscale_`` all-reduce (MAX) the found-inf flag over
  the pipeline group and then over the stage's data-parallel group, so every rank skips together
  and ``scaler.update()`` backs off the same scale everywhere. The second all-reduce is needed
  wherever replicas hold different gradients: an expert shard lives on some replicas only
  (``expert_parallel > 1``), and under ``dp_sharding="fsdp"`` each replica holds a different
  shard of every gradient; without it, an overflow in one replica's shard made that replica skip
  while the others stepped, and the replicas' weights silently drifted apart. A rank released by
  re-packing holds no gradients; it records "no inf" so that the scaler's bookkeeping stays valid
  without joining the collectives.

Supported: ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"``, ``"16-true"`` and
``"64-true"`` (Lightning's ``Precision``, ``MixedPrecision``, ``HalfPrecision`` and
``DoublePrecision`` plugins). Anything else (FSDP/DeepSpeed/XLA precision, Transformer Engine,
bitsandbytes, a custom plugin) changes how modules, gradients or optimizer steps work in ways the
pipeline does not know, and is refused at setup with :class:`UnsupportedPrecisionError`.
"""
from __future__ import annotations

import functools
import types
from typing import Callable

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch.distributed.tensor import DTensor

from ..protocol.services import grad_scaler

__all__ = [
    "SUPPORTED_PRECISIONS",
    "UnsupportedPrecisionError",
    "check_precision",
    "install_found_inf_agreement",
    "pipeline_loss_fn",
    "unscale_losses",
]

SUPPORTED_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true")


class UnsupportedPrecisionError(ValueError):
    """The precision plugin cannot run under the pipeline."""


def _supported_plugin(plugin) -> bool:
    return type(plugin) is Precision or isinstance(plugin, (MixedPrecision, HalfPrecision, DoublePrecision))


def check_precision(plugin, optimizers=()) -> None:
    """Raise :class:`UnsupportedPrecisionError` (naming what is supported) for a plugin, scaler or
    optimizer the pipeline cannot run."""
    name = getattr(plugin, "precision", None)
    if not _supported_plugin(plugin) or name not in SUPPORTED_PRECISIONS:
        raise UnsupportedPrecisionError(
            f"DynMoStrategy cannot train with precision={name!r} ({type(plugin).__name__}): the pipeline supports "
            f"{', '.join(repr(p) for p in SUPPORTED_PRECISIONS)} (Lightning's Precision, MixedPrecision, HalfPrecision "
            "and DoublePrecision plugins). Pass one of these as Trainer(precision=...)"
        )
    scaler = getattr(plugin, "scaler", None)
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise UnsupportedPrecisionError(
            f"DynMoStrategy needs a torch.amp.GradScaler for precision={name!r}, got {type(scaler).__name__}"
        )
    if scaler is not None:
        for opt in optimizers:
            opt = getattr(opt, "_optimizer", opt)
            if getattr(opt, "_step_supports_amp_scaling", False):
                raise UnsupportedPrecisionError(
                    f"{type(opt).__name__} unscales gradients inside its step (a fused optimizer), so the pipeline "
                    f"cannot make its ranks agree on skipping a step with precision={name!r}; use a non-fused "
                    "optimizer (e.g. fused=False) or precision='bf16-mixed', which needs no grad scaler"
                )


def pipeline_loss_fn(plugin, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    """``loss_fn`` for the schedule's last stage: scaled by the plugin's grad scaler (its current
    scale at every call), or ``loss_fn`` itself without a scaler."""
    scaler = grad_scaler(plugin)
    if scaler is None:
        return loss_fn

    @functools.wraps(loss_fn)
    def scaled(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return scaler.scale(loss_fn(output, target))

    return scaled


def unscale_losses(plugin, losses: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
    """The schedule's per-micro-batch losses divided by the scale they were multiplied by."""
    scaler = grad_scaler(plugin)
    if scaler is None or not losses:
        return losses
    scale = scaler.get_scale()
    return [loss.detach() / scale for loss in losses]


class _LocalGrads:
    """What ``GradScaler._unscale_grads_`` reads of an optimizer, every gradient as this rank's
    local tensor. Under ``dp_sharding="fsdp"`` with expert parallelism a stage holds DTensor
    shards beside plain expert shards, and torch's unscale kernel (one call per device and dtype)
    refuses the mix. The local tensors share storage with the gradients, so unscaling is in place;
    found-inf is then agreed over the replicas (:func:`install_found_inf_agreement`), as the
    DTensor kernel would have done over the mesh."""

    def __init__(self, optimizer) -> None:
        params = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                    view = grad.detach()
                    view.grad = grad
                    params.append(view)
        self.param_groups = [{"params": params}]


def install_found_inf_agreement(plugin, group: Callable[[], object], active: Callable[[], bool],
                                device: Callable[[], torch.device],
                                replica_group: Callable[[], object] = lambda: None) -> None:
    """Make ``plugin.scaler.unscale_`` agree on found-inf over the pipeline group ``group()``
    (``None``: the world), then over the data-parallel group ``replica_group()`` (``None``: no
    replicas) (see the module docstring). Only this scaler instance is changed; a plugin without a
    scaler is left alone. Idempotent."""
    scaler = getattr(plugin, "scaler", None)
    if scaler is None or getattr(scaler, "_dynmo_found_inf_agreement", False):
        return
    original, unscale_grads = scaler.unscale_, scaler._unscale_grads_

    def _unscale_grads_(self, optimizer, *args, **kwargs):
        kinds = {isinstance(p.grad, DTensor) for g in optimizer.param_groups for p in g["params"] if p.grad is not None}
        return unscale_grads(_LocalGrads(optimizer) if len(kinds) > 1 else optimizer, *args, **kwargs)

    def unscale_(self, optimizer) -> None:
        original(optimizer)
        if not self.is_enabled():
            return
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        dev = device()
        flag = torch.zeros(1, dtype=torch.float32, device=dev)
        for value in found.values():
            flag = torch.maximum(flag, value.to(dev, torch.float32))
        if active() and dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group())
            replicas = replica_group()
            if replicas is not None:  # expert shards and FSDP shards differ between replicas
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=replicas)
        if not found:  # this rank holds no gradients of this optimizer
            found[dev] = flag
        for key in list(found):
            found[key] = flag.to(key)

    scaler.unscale_ = types.MethodType(unscale_, scaler)
    scaler._unscale_grads_ = types.MethodType(_unscale_grads_, scaler)
    scaler._dynmo_found_inf_agreement = True
