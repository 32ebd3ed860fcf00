"""Model and data shared by the multi-process workers and the single-process references."""
from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_dynmo.models import GPT, GPTConfig


def make_model(cfg: dict) -> GPT:
    n_layer = cfg.get("n_layer", 6)
    config = GPTConfig(
        vocab_size=64,
        block_size=cfg.get("block", 16),
        n_layer=n_layer,
        n_head=2,
        n_embd=cfg.get("n_embd", 32),
        dropout=0.0,
        bias=False,  # the key bias has an exactly-zero gradient; Adam would amplify rounding noise there
        mlp_ratios=tuple(cfg.get("mlp_ratios", [1, 4, 2, 8, 1, 3][:n_layer])),  # heterogeneous layers
    )
    return GPT(config, lr=cfg.get("lr", 3e-3), warmup_steps=2, max_steps=20, seed=cfg.get("seed", 0))


class EpochPermutation(torch.utils.data.Sampler):
    """The order DistributedSampler(shuffle=True, seed=0) gives one replica: a new permutation
    per epoch (Lightning calls ``set_epoch``)."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch)).tolist())

    def __len__(self) -> int:
        return self.n


def make_loader(cfg: dict, batch: int, reference: bool = False) -> DataLoader:
    """The pipeline gets a plain loader; Lightning injects DistributedSampler(shuffle=True, seed=0)
    (it always shuffles training data in distributed runs). ``reference=True`` gives a single
    process the same permutation, so step k sees the union of the replicas' batches k, and
    ``batch[r::dp]`` is exactly replica r's batch."""
    g = torch.Generator().manual_seed(123)
    n = cfg.get("n_samples", 512)
    data = torch.randint(0, 64, (n, cfg.get("block", 16) + 1), generator=g)
    ds = TensorDataset(data[:, :-1].contiguous(), data[:, 1:].contiguous())
    if reference:
        return DataLoader(ds, batch_size=batch, sampler=EpochPermutation(n), drop_last=True)
    return DataLoader(ds, batch_size=batch, shuffle=False, drop_last=True)
