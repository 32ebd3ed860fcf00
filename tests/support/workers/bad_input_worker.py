"""Failure cases that must end every rank with a clear error (never a hang).

Usage: torchrun --nproc-per-node 2 bad_input_worker.py CASE
"""
from __future__ import annotations

import os
import sys
import time

import torch
from torch import nn

torch.set_num_threads(1)

import lightning as L

from lightning_dynmo import DynMoStrategy
from tests.support.workers.common import make_loader, make_model


class NoProtocol(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        return self.net(batch[0].float()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class DiesOrStalls(L.Callback):
    def __init__(self, how: str):
        self.how = how

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 2 and trainer.global_rank == 1:
            if self.how == "die":
                os._exit(3)
            time.sleep(600)  # a stuck rank: the others must time out


def main(case: str) -> None:
    cfg = {"steps": 4, "n_layer": 2}
    model = make_model(cfg)
    kwargs = dict(pipeline_parallel=2, microbatches=4, timeout=8)
    batch = 8
    callbacks = []
    if case == "too_many_stages":
        kwargs.update(schedule="interleaved_1f1b", virtual_stages=3)  # 6 stages > 5 layers
    elif case == "batch_not_divisible":
        batch = 6
    elif case == "no_protocol":
        model = NoProtocol()
    elif case in ("die", "stall"):
        callbacks.append(DiesOrStalls(case))
    trainer = L.Trainer(
        strategy=DynMoStrategy(**kwargs), accelerator="cpu", devices=2, max_steps=cfg["steps"], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )
    trainer.fit(model, train_dataloaders=make_loader(cfg, batch))


if __name__ == "__main__":
    main(sys.argv[1])
