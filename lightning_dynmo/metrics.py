"""Metrics computed from losses that every rank already agrees on."""
from __future__ import annotations

import torch
from torchmetrics.aggregation import MeanMetric


class PerplexityFromLoss(MeanMetric):
    """exp(token-weighted mean cross-entropy). Each update gets the batch loss, already identical
    on every rank, so no cross-process sync is needed at compute time."""

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("sync_on_compute", False)
        super().__init__(**kwargs)

    def compute(self) -> torch.Tensor:
        return torch.exp(super().compute())
