"""The token-choice top-k router of an MoE layer and its auxiliary losses (per sequence).

See :mod:`lightning_dynmo.models.moe` for why every statistic here is per sequence (row).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from .config import MoEConfig


@dataclass
class Routing:
    """One forward's routing decisions for ``x [B, T, C]``.

    ``weights`` / ``experts``: ``[B, T, k]`` combine weights (fp32) and expert ids per slot;
    ``keep``: ``[B, T, k]`` slots within capacity (``None``: dropless); ``probs``: ``[B, T, E]``
    per-token expert probabilities the load-balancing loss uses; ``logits``: ``[B, T, E]`` fp32.
    """

    weights: Tensor
    experts: Tensor
    keep: Tensor | None
    probs: Tensor
    logits: Tensor


def load_balancing_loss(probs: Tensor, experts: Tensor, num_experts: int, valid: Tensor | None = None) -> Tensor:
    """Sequence-wise Switch/GShard loss (DeepSeek-V2): per row ``sum_i f_i P_i`` with
    ``f_i = E / (T k) * #(slots routed to i)`` (before capacity) and ``P_i = mean_t probs[:, i]``,
    then the mean over rows. Equals 1 for perfectly uniform routing.

    ``probs [B, T, E]``, ``experts [B, T, k]``. ``valid [B, T]`` bool (packed rows): ``T`` and the
    means run over each row's valid tokens only; a row without one contributes 0 and still counts
    in the mean over rows (so a micro-batch's loss is the mean of its rows' losses).
    """
    b, t, k = experts.shape
    routed = torch.zeros(b, t, num_experts, dtype=probs.dtype, device=probs.device)
    routed.scatter_(2, experts, 1.0)
    if valid is None:
        f = routed.sum(dim=1) * (num_experts / (t * k))
        return (f * probs.mean(dim=1)).sum(dim=-1).mean()
    mask = valid[..., None].to(probs.dtype)
    n = valid.sum(dim=1, keepdim=True).clamp(min=1).to(probs.dtype)  # [B, 1]
    f = (routed * mask).sum(dim=1) * num_experts / (n * k)
    p = (probs * mask).sum(dim=1) / n
    return (f * p).sum(dim=-1).mean()


def router_z_loss(logits: Tensor, valid: Tensor | None = None) -> Tensor:
    """ST-MoE router z-loss ``logsumexp(logits)^2``: mean over each row's tokens (only the
    ``valid [B, T]`` ones if given; a row without one gives 0), then rows."""
    z = torch.logsumexp(logits, dim=-1).square()
    if valid is None:
        return z.mean(dim=1).mean()
    n = valid.sum(dim=1).clamp(min=1).to(z.dtype)
    return (torch.where(valid, z, 0.0).sum(dim=1) / n).mean()


class TopKRouter(nn.Module):
    """Token-choice top-k router with per-sequence expert capacity."""

    def __init__(self, dim: int, config: MoEConfig):
        super().__init__()
        self.num_experts = int(config.num_experts)
        self.top_k = int(config.top_k)
        self.score_func = config.score_func
        self.renormalize = bool(config.renormalize)
        self.capacity_factor = None if config.capacity_factor is None else float(config.capacity_factor)
        self.drop_policy = config.drop_policy
        self.gate = nn.Linear(dim, self.num_experts, bias=False)

    def capacity(self, tokens_per_row: int) -> int:
        """Slots per expert and sequence (``None`` capacity factor: every slot fits)."""
        if self.capacity_factor is None:
            return tokens_per_row
        cap = math.ceil(self.capacity_factor * tokens_per_row * self.top_k / self.num_experts)
        return min(cap, tokens_per_row)  # an expert gets each token at most once

    def forward(self, x: Tensor) -> Routing:
        logits = self.gate(x).float()  # routing decisions in fp32 whatever the activation dtype
        if self.score_func == "softmax":
            scores = logits.softmax(dim=-1)
            probs = scores
        else:
            scores = logits.sigmoid()
            probs = scores / scores.sum(dim=-1, keepdim=True)
        weights, experts = scores.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        keep = None if self.capacity_factor is None else self._within_capacity(weights, experts)
        return Routing(weights=weights, experts=experts, keep=keep, probs=probs, logits=logits)

    @torch.no_grad()
    def _within_capacity(self, weights: Tensor, experts: Tensor) -> Tensor:
        """``[B, T, k]`` mask of the slots each expert accepts, per sequence."""
        b, t, _ = experts.shape
        cap = self.capacity(t)
        if self.drop_policy == "position":
            routed = torch.zeros(b, t, self.num_experts, dtype=torch.int32, device=experts.device)
            routed.scatter_(2, experts, 1)
            accepted = routed.cumsum(dim=1) <= cap  # the first `cap` tokens of the row that chose e
        else:
            priority = torch.full((b, t, self.num_experts), -math.inf, dtype=weights.dtype, device=weights.device)
            priority.scatter_(2, experts, weights)
            best = priority.topk(cap, dim=1).indices  # the `cap` highest weights per (row, expert)
            accepted = torch.zeros(b, t, self.num_experts, dtype=torch.bool, device=experts.device)
            accepted.scatter_(1, best, True)
        return accepted.gather(2, experts)
