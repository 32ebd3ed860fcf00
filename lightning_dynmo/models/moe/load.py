"""What an MoE layer counts and reports: routing windows (:class:`RoutingCounts`), their
summary for logging (:class:`RoutingStats`) and the load of a pipeline layer holding an MoE
layer (:class:`MoELoad`). Re-exported by :mod:`lightning_dynmo.models.moe`; see its docstring
("Load signal") for what the counts mean.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["MoELoad", "RoutingCounts", "RoutingStats", "routed_tokens"]


def _records_routing(module: nn.Module) -> bool:
    """Training forwards count towards the load signal; no-grad passes (validation, the
    strategy's shape discovery) do not."""
    return module.training and torch.is_grad_enabled()


@dataclass
class RoutingCounts:
    """What an MoE layer's recorded forwards did since a reset. Tensors stay on the device, so
    training needs no host sync for them; readers convert."""

    forwards: int = 0
    tokens: int = 0  # tokens routed: sum of B * T (with a ``valid`` mask: of the valid tokens)
    # (query, key) pairs under the causal mask: sum of B * T (T + 1) / 2; with a ``valid`` mask
    # sum over rows of n (n + 1) / 2, n the row's valid tokens (the attention of packed rows)
    causal_pairs: int = 0
    expert_tokens: Tensor | None = None  # [E] slots each expert processed (after capacity)
    balance_loss_sum: Tensor | None = None  # unscaled load-balancing loss, summed over forwards
    busiest_slots: Tensor | None = None  # slots the busiest expert shard received, summed over forwards

    def add(self, tokens: int, causal_pairs: int, expert_tokens: Tensor, busiest_slots: Tensor,
            balance_loss: Tensor) -> None:
        """One forward over ``tokens`` routed tokens with ``causal_pairs`` causal (query, key)
        pairs (see :func:`routed_tokens`)."""
        self.forwards += 1
        self.tokens += tokens
        self.causal_pairs += causal_pairs
        if self.expert_tokens is None:
            self.expert_tokens, self.balance_loss_sum = expert_tokens.clone(), balance_loss.detach().clone()
            self.busiest_slots = busiest_slots.clone()
        else:
            self.expert_tokens += expert_tokens
            self.balance_loss_sum += balance_loss.detach()
            self.busiest_slots += busiest_slots


def routed_tokens(b: int, t: int, valid: Tensor | None) -> tuple[int, int]:
    """``(tokens, causal pairs)`` of a forward over ``[B, T]`` tokens, only the ``valid`` ones if
    given: a row with ``n`` valid tokens (a packed MoD row) attends over ``n (n + 1) / 2`` pairs."""
    if valid is None:
        return b * t, b * t * (t + 1) // 2
    per_row = valid.sum(dim=1).tolist()  # host sync, only while recording
    return sum(per_row), sum(n * (n + 1) // 2 for n in per_row)


@dataclass(frozen=True)
class RoutingStats:
    """A window of an :class:`~lightning_dynmo.models.moe.MoEBlock`'s routing, for logging: ``relative_work`` (as
    ``load_factor``), tokens each expert processed ``[E]`` (CPU int64; this replica's routed
    tokens, also under expert parallelism), the share of routed slots dropped for capacity, and
    the mean unscaled load-balancing loss (1.0 = uniform)."""

    relative_work: float
    expert_counts: Tensor
    dropped_fraction: float
    balance_loss: float


class MoELoad:
    """What a pipeline layer holding an :class:`~lightning_dynmo.models.moe.MoELayer` as ``mlp`` reports: its load
    (``ReportsLoad``, the strategy's window) and its routing statistics (the monitoring window).
    Mixed in before the layer's class (:class:`~lightning_dynmo.models.moe.MoEBlock`, and its MoE half at sublayer
    granularity)."""

    def load_factor(self) -> float | None:
        window = self.mlp.load_window
        if window.forwards == 0:
            return None
        return self.mlp.window_work(window)

    def reset_load(self) -> None:
        self.mlp.load_window = RoutingCounts()

    def routing_stats(self) -> RoutingStats | None:
        """The monitoring window since :meth:`reset_routing_stats` (``None``: no forward)."""
        return self.mlp.routing_stats()

    def reset_routing_stats(self) -> None:
        self.mlp.reset_routing_stats()

    def expert_counts(self) -> Tensor:
        """Tokens each expert processed (after capacity) in the monitoring window, ``[E]`` int64."""
        stats = self.routing_stats()
        return torch.zeros(self.mlp.num_experts, dtype=torch.int64) if stats is None else stats.expert_counts
