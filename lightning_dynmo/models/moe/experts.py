"""The experts of an MoE layer: SwiGLU experts run as one grouped GEMM where possible."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...protocol.services import ExpertShard, expert_dispatch


@functools.cache
def _grouped_mm_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether this torch build has a ``torch._grouped_mm`` kernel for ``device_type`` and ``dtype``
    (probed once with a tiny aligned problem)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        a = torch.zeros(4, 8, device=device_type, dtype=dtype)
        b = torch.zeros(2, 8, 8, device=device_type, dtype=dtype)
        torch._grouped_mm(a, b, offs=torch.tensor([1, 4], dtype=torch.int32, device=device_type))
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)``: the Mixtral/LLaMA expert MLP; used as the shared expert."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts stored as stacked weights (torchtitan's layout, transposed so
    that ``x @ w`` needs no transpose): ``w1, w3 [E, C, H]``, ``w2 [E, H, C]``.

    ``forward(x, counts)`` takes tokens sorted by expert (``counts[e]`` rows for expert ``e``) and
    runs all experts as one grouped GEMM per weight (``torch._grouped_mm``) when this torch build
    has it for the device and dtype and every row stride is a multiple of 16 bytes; otherwise it
    loops over experts. Both compute the same function.

    Expert parallelism (:mod:`lightning_dynmo.runtime.expert_parallel`, reached through
    :func:`lightning_dynmo.protocol.expert_dispatch`): after
    ``shard_experts(shard)`` the module holds only its shard's experts (``w1 [E / ep, C, H]``...)
    while ``num_experts`` stays the layer's total; ``forward`` still takes tokens sorted by global
    expert with ``[num_experts]`` counts and exchanges them with the replicas owning the others,
    and also returns how many rows each shard received (the layer's load signal).
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, grouped_mm: bool | None = None):
        super().__init__()
        self.dim, self.hidden, self.num_experts = dim, hidden, num_experts
        self.grouped_mm = grouped_mm
        self.expert_shard: ExpertShard | None = None
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, dim))

    def uses_grouped_mm(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Which path ``forward`` takes for activations of ``dtype`` on ``device``."""
        if self.grouped_mm is False:
            return False
        size = torch.empty((), dtype=dtype).element_size()
        aligned = self.dim * size % 16 == 0 and self.hidden * size % 16 == 0
        runs = _grouped_mm_runs(device.type, dtype)
        if self.grouped_mm and not (runs and aligned):
            raise RuntimeError(
                f"grouped_mm=True, but torch._grouped_mm cannot run {dtype} on {device.type} with "
                f"n_embd={self.dim} and expert hidden={self.hidden} "
                f"({'strides must be multiples of 16 bytes' if runs else 'no kernel in this torch build'}); "
                "set grouped_mm=None to fall back to the expert loop automatically"
            )
        return runs and aligned

    def shard_experts(self, shard: ExpertShard) -> list[tuple[str, nn.Parameter, nn.Parameter]]:
        """Keep only ``shard``'s experts; returns ``[(name, old, new)]`` parameters ([] if already held)."""
        if self.expert_shard == shard:
            return []
        if self.expert_shard is not None:
            raise RuntimeError(f"experts already hold shard {self.expert_shard}, cannot re-shard to {shard}")
        if self.num_experts % shard.size:
            raise ValueError(f"num_experts={self.num_experts} cannot be split into expert_parallel={shard.size} shards")
        replaced = []
        for name in ("w1", "w3", "w2"):
            old = getattr(self, name)
            new = nn.Parameter(shard.take(old.detach()).clone(), requires_grad=old.requires_grad)
            setattr(self, name, new)
            replaced.append((name, old, new))
        self.expert_shard = shard
        return replaced

    def forward(self, x: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
        """Outputs of ``x``'s rows and the rows each expert shard of the layer received
        (``[expert_parallel]``, on the device; unsharded: one shard, ``counts.sum()``)."""
        if self.expert_shard is not None:
            return expert_dispatch().dispatch(self._local, x, counts)
        return self._local(x, counts), counts.sum().view(1)

    def _local(self, x: Tensor, counts: Tensor) -> Tensor:
        """The experts this module holds on tokens sorted by them (``counts[e]`` rows each)."""
        device_type = x.device.type
        # under autocast, compute in the autocast dtype like nn.Linear would
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
        if self.uses_grouped_mm(dtype, x.device):
            x = x.to(dtype)
            w1, w3, w2 = (w.to(dtype) for w in (self.w1, self.w3, self.w2))
            offsets = counts.cumsum(0).to(torch.int32)
            h = F.silu(torch._grouped_mm(x, w1, offs=offsets)) * torch._grouped_mm(x, w3, offs=offsets)
            return torch._grouped_mm(h, w2, offs=offsets)
        outputs = []
        for e, xe in enumerate(x.split(counts.tolist())):
            outputs.append((F.silu(xe @ self.w1[e]) * (xe @ self.w3[e])) @ self.w2[e])
        return torch.cat(outputs)
