"""Gradient clipping by the norm of the *whole* model when its layers live on several ranks.

Lightning clips through the precision plugin; each rank only sees its own stage's gradients, so
the norm must be summed across the pipeline group first. We give the plugin in use this one
method instead of replacing the plugin, so any precision a user picks keeps working.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class PipelineGradClipMixin:
    _dynmo_pipeline_group: dist.ProcessGroup | None = None

    def clip_grad_by_norm(self, optimizer, clip_val) -> None:  # type: ignore[override]
        grads = [p.grad for p in self.main_params(optimizer) if p.grad is not None]  # type: ignore[attr-defined]
        device = grads[0].device if grads else torch.device("cpu")
        if dist.is_initialized() and dist.get_backend(self._dynmo_pipeline_group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        sq = torch.zeros((), dtype=torch.float32, device=device)
        for g in grads:
            sq += torch.linalg.vector_norm(g.detach(), 2, dtype=torch.float32).to(device) ** 2
        if dist.is_initialized():
            dist.all_reduce(sq, group=self._dynmo_pipeline_group)
        total = sq.sqrt()
        coef = torch.clamp(float(clip_val) / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.device, g.dtype))


def add_pipeline_clipping(plugin, group: dist.ProcessGroup | None) -> None:
    """Make ``plugin`` (any Lightning precision plugin) clip by the global norm over ``group``."""
    cls = type(plugin)
    if not issubclass(cls, PipelineGradClipMixin):
        plugin.__class__ = type(f"Pipeline{cls.__name__}", (PipelineGradClipMixin, cls), {})
    plugin._dynmo_pipeline_group = group
