"""A toy LM whose pipeline layers pass two tensors (a hidden state and a gate), and layers that
break the activation protocol (for the bad-input tests)."""
from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from lightning_dynmo.protocol.activations import run_layers

VOCAB, WIDTH = 32, 16


class Embed(nn.Module):
    """``idx -> (x, gate)``: both require grad."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.gate = nn.Linear(WIDTH, WIDTH)

    def forward(self, idx):
        x = self.wte(idx)
        return x, torch.sigmoid(self.gate(x))


class GatedMix(nn.Module):
    """``(x, gate) -> (x + gate * f(x), gate')``: the gate is read and rewritten by every layer."""

    def __init__(self, count_rows: bool = False) -> None:
        super().__init__()
        self.f = nn.Linear(WIDTH, WIDTH)
        self.g = nn.Linear(WIDTH, WIDTH)
        self.count_rows = count_rows
        # a buffer its training forward changes, as BatchNorm's running statistics: the rows it saw,
        # a sum over micro-batches that equals one process's only if no forward is added or lost
        self.register_buffer("rows_seen", torch.zeros((), dtype=torch.long))

    def forward(self, x, gate):
        if self.training and self.count_rows:
            self.rows_seen += x.shape[0]
        x = x + gate * torch.tanh(self.f(x))
        return x, torch.sigmoid(self.g(x) + gate)


class Out(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x, gate):
        return self.head(x * gate)


class TwoStreamLM(L.LightningModule):
    def __init__(self, n_mix: int = 4, seed: int = 0, lr: float = 0.1, count_rows: bool = False) -> None:
        super().__init__()
        self.lr = lr
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.layers = nn.ModuleList([Embed(), *[GatedMix(count_rows) for _ in range(n_mix)], Out()])

    def pipeline_layers(self) -> nn.ModuleList:
        return self.layers

    def pipeline_loss(self, output, target):
        return F.cross_entropy(output.flatten(0, 1), target.flatten())

    def forward(self, idx):
        return run_layers(self.layers, idx)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.pipeline_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class Misbehaving(nn.Module):
    """Wraps a one-tensor layer and breaks the protocol the way ``how`` says: ``dict`` and
    ``non_tensor`` from the first call; ``arity`` and ``shape`` only once gradients are on (after
    the no-grad shape discovery): one tensor more, or a shorter sequence."""

    def __init__(self, layer: nn.Module, how: str) -> None:
        super().__init__()
        self.layer, self.how = layer, how

    def forward(self, x):
        y = self.layer(x)
        if self.how == "dict":
            return {"hidden": y}
        if self.how == "non_tensor":
            return y, 3
        if torch.is_grad_enabled() and self.how == "arity":
            return y, y.detach()
        if torch.is_grad_enabled() and self.how == "shape":
            keep = int((y[0, :, 0] > float("-inf")).sum()) - 1  # a length computed from the data
            return y[:, :keep]
        return y
