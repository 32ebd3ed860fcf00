"""Models and data for ``trainer.predict`` through the pipeline, shared by the predict worker and
the single-process references it is compared with."""
from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_dynmo.models import GPT


class GPTPredict(GPT):
    """The test GPT whose prediction is a dict built from the logits (``pipeline_predict``, which
    the pipeline calls on the last stage's output; its ``predict_step`` does the same in one
    process)."""

    def pipeline_predict(self, output, batch, batch_idx):
        return {"logprobs": output.log_softmax(-1), "tokens": output.argmax(-1), "batch_idx": batch_idx}

    def predict_step(self, batch, batch_idx):
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self.pipeline_predict(self(x), batch, batch_idx)


class GPTLogits(GPT):
    """The test GPT without ``pipeline_predict``: under the pipeline a prediction is the last
    layer's output (the logits), which is what this ``predict_step`` returns in one process."""

    def predict_step(self, batch, batch_idx):
        return self(batch[0] if isinstance(batch, (tuple, list)) else batch)


def predict_loader(cfg: dict, batch: int, n: int, with_targets: bool = True) -> DataLoader:
    """``n`` held-out sequences in a fixed order; batches ``(inputs, targets)`` or ``[inputs]``."""
    g = torch.Generator().manual_seed(777)
    data = torch.randint(0, 64, (n, cfg.get("block", 16) + 1), generator=g)
    tensors = (data[:, :-1].contiguous(), data[:, 1:].contiguous()) if with_targets else (data[:, :-1].contiguous(),)
    return DataLoader(TensorDataset(*tensors), batch_size=batch)
