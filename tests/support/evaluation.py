"""Held-out data and a test step, shared by the pipeline worker and the single-process references
that its evaluation (``trainer.validate``/``trainer.test`` through the pipeline) is compared with."""
from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_dynmo.models import GPT


class GPTWithTest(GPT):
    """The test GPT plus a ``test_step`` (Lightning only runs ``trainer.test`` on modules that
    define one; under the pipeline the strategy evaluates through the stages instead)."""

    def test_step(self, batch, batch_idx):
        x, y = batch
        output = self(x)
        loss = self.pipeline_loss(output, y)
        self.log("test_loss", loss, batch_size=x.size(0))
        self.pipeline_eval_step(output, batch, batch_idx, "test")  # test_acc, as the pipeline logs it
        return loss


def eval_loader(cfg: dict, batch: int, n: int = 32) -> DataLoader:
    """``n`` held-out sequences in a fixed order (Lightning's evaluation sampler does not shuffle:
    with ``dp`` replicas, replica r gets every dp-th sample, so a single process with ``dp`` times
    the batch sees the union of the replicas' batches)."""
    g = torch.Generator().manual_seed(321)
    data = torch.randint(0, 64, (n, cfg.get("block", 16) + 1), generator=g)
    targets = data[:, 1:].clone()
    if cfg.get("padded"):  # each sample keeps 1..block targets, the rest ignored (-100)
        keep = torch.randint(1, targets.shape[1] + 1, (n,), generator=g)
        targets[torch.arange(targets.shape[1])[None, :] >= keep[:, None]] = -100
    return DataLoader(TensorDataset(data[:, :-1].contiguous(), targets), batch_size=batch)
