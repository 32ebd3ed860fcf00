"""Random token ids for the small models' unit tests (vocabulary 64)."""
from __future__ import annotations

import torch


def tokens(rows: int, seed: int = 0, t: int = 16) -> torch.Tensor:
    return torch.randint(0, 64, (rows, t), generator=torch.Generator().manual_seed(seed))
