"""Gradient clipping by the norm of the *whole* model when its layers live on several ranks.

Lightning clips through the precision plugin; each rank only sees its own stage's gradients.
We compute exactly what ``torch.nn.utils.clip_grad_norm_`` computes in a single process: the
per-tensor norms (``_foreach_norm``, bitwise the same on any rank) are placed at each parameter's
single-process position, summed over the pipeline group (every slot has one owner, so the sum is
exact), and the norm of that vector is taken in single-process order. Clipping therefore gives
bitwise the same coefficient as single-process training. The plugin in use gets this one method
instead of being replaced, so any precision a user picks keeps working.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist


class PipelineGradClipMixin:
    _dynmo_pipeline_group: dist.ProcessGroup | None = None
    _dynmo_positions: Callable | None = None  # optimizer -> (list[(position, param)], total)
    _dynmo_active: Callable[[], bool] = staticmethod(lambda: True)  # False on a released rank

    def clip_grad_by_norm(self, optimizer, clip_val) -> None:  # type: ignore[override]
        if not self._dynmo_active():
            return  # a released rank holds no gradients and is not in the pipeline group
        opt = getattr(optimizer, "_optimizer", optimizer)
        slots, total = self._dynmo_positions(opt)
        slots = [(i, p) for i, p in slots if p.grad is not None]
        grads = [p.grad for _, p in slots]
        device = grads[0].device if grads else torch.device("cpu")
        if dist.is_initialized() and dist.get_backend(self._dynmo_pipeline_group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        norms = torch.zeros(total, dtype=torch.float32, device=device)
        present = torch.zeros(total, dtype=torch.float32, device=device)
        if grads:
            local = torch._foreach_norm(grads, 2.0)
            idx = torch.tensor([i for i, _ in slots], device=device)
            norms[idx] = torch.stack([n.to(device, torch.float32) for n in local])
            present[idx] = 1.0
        if dist.is_initialized():
            both = torch.cat([norms, present])
            dist.all_reduce(both, group=self._dynmo_pipeline_group)
            norms, present = both[:total], both[total:]
        total_norm = torch.linalg.vector_norm(norms[present > 0], 2.0)
        coef = torch.clamp(float(clip_val) / (total_norm + 1e-6), max=1.0)
        if grads:
            torch._foreach_mul_(grads, coef.to(grads[0].device))


def add_pipeline_clipping(
    plugin, group: dist.ProcessGroup | None, positions: Callable, active: Callable[[], bool] = lambda: True
) -> None:
    """Make ``plugin`` (any Lightning precision plugin) clip by the global norm over ``group``.

    ``positions(optimizer)`` returns this rank's ``(single-process position, parameter)`` pairs
    and the optimizer's total parameter count."""
    cls = type(plugin)
    if not issubclass(cls, PipelineGradClipMixin):
        plugin.__class__ = type(f"Pipeline{cls.__name__}", (PipelineGradClipMixin, cls), {})
    plugin._dynmo_pipeline_group = group
    plugin._dynmo_positions = positions
    plugin._dynmo_active = active
