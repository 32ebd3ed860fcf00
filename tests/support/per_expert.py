"""An MoE GPT whose experts can go without any gradient, for tests only.

:class:`~lightning_dynmo.models.moe.GroupedExperts` stacks the experts into one parameter per
weight, so an expert no token reached is a zero slice of a gradient that exists. Many MoE
implementations (Megatron's SequentialMLP, DeepSeek's reference model, HF transformers before v5)
give each expert weights of its own and skip an expert without tokens: its weights then get no
gradient at all. :func:`use_per_expert_weights` makes the test model do that, and
:class:`BlockExpert` keeps chosen experts empty on chosen batches (the router never picks them),
deterministically and the same way in a pipeline and in one process.
"""
from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

#: experts the routers may not choose for the current batch (set by :class:`BlockExpert`)
BLOCKED: set[int] = set()


class PerExpertWeights(nn.Module):
    """The experts of a ``GroupedExperts`` (same values), each with its own ``w1.e, w3.e, w2.e``;
    an expert with no rows is skipped, so its weights take no part in the graph."""

    def __init__(self, dim: int, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.dim, self.hidden, self.num_experts = dim, hidden, num_experts
        self.w1 = nn.ParameterList([nn.Parameter(torch.empty(dim, hidden)) for _ in range(num_experts)])
        self.w3 = nn.ParameterList([nn.Parameter(torch.empty(dim, hidden)) for _ in range(num_experts)])
        self.w2 = nn.ParameterList([nn.Parameter(torch.empty(hidden, dim)) for _ in range(num_experts)])

    @classmethod
    def of(cls, grouped) -> "PerExpertWeights":
        out = cls(grouped.dim, grouped.hidden, grouped.num_experts)
        with torch.no_grad():
            for name in ("w1", "w3", "w2"):
                for mine, stacked in zip(getattr(out, name), getattr(grouped, name)):
                    mine.copy_(stacked)
        return out

    def forward(self, x: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
        outputs = []
        for e, xe in enumerate(x.split(counts.tolist())):
            if xe.shape[0]:  # (an empty matmul would still give the weights a zero gradient)
                outputs.append((F.silu(xe @ self.w1[e]) * (xe @ self.w3[e])) @ self.w2[e])
        y = torch.cat(outputs) if outputs else x.new_zeros(0, self.dim)
        return y, counts.sum().view(1)


def _block_logits(gate: nn.Module, args, logits: Tensor) -> Tensor:
    """Forward hook of a router's gate: the blocked experts' logits become -inf (never chosen)."""
    if not BLOCKED:
        return logits
    mask = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
    mask[sorted(BLOCKED)] = True
    return logits.masked_fill(mask, float("-inf"))


def use_per_expert_weights(model) -> None:
    """Every MoE layer of ``model`` (built whole) gets :class:`PerExpertWeights` with the same
    values and a router that honours :data:`BLOCKED`."""
    for _, block in model.moe_blocks():
        moe = block.mlp
        moe.experts = PerExpertWeights.of(moe.experts)
        moe.router.gate.register_forward_hook(_block_logits)


class BlockExpert(L.Callback):
    """Before each training batch whose index is in ``batches``: the routers may not choose
    ``expert`` (on every rank, and in one process alike)."""

    def __init__(self, expert: int, batches) -> None:
        self.expert, self.batches = int(expert), {int(b) for b in batches}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        BLOCKED.clear()
        if batch_idx in self.batches:
            BLOCKED.add(self.expert)

    def on_train_end(self, trainer, pl_module) -> None:
        BLOCKED.clear()
