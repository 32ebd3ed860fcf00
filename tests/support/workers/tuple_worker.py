"""Trains the two-stream toy (tests/support/two_stream.py) on a 2-rank pipeline and reports rank
0's losses and the gathered final weights. Usage: torchrun --nproc-per-node 2 tuple_worker.py SPEC"""
from __future__ import annotations

import os

import lightning as L
import torch

torch.set_num_threads(1)

from lightning_dynmo import DynMoStrategy
from tests.support.two_stream import TwoStreamLM
from tests.support.workers.common import LossRecorder, run_spec, two_stream_loader


def run_one(cfg: dict, out_dir: str, idx: int) -> dict:
    strategy = DynMoStrategy(pipeline_parallel=2, schedule=cfg["schedule"], microbatches=cfg.get("microbatches", 4),
                             balancer="test_cycle", rebalance="every_n", rebalance_interval=1, timeout=120,
                             activation_checkpointing=cfg.get("activation_checkpointing", False))
    rec = LossRecorder()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=cfg["steps"], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[rec], default_root_dir=os.path.join(out_dir, f"run{idx}"))
    # counting layers change a buffer in forward, which activation checkpointing refuses
    model = TwoStreamLM(count_rows=not cfg.get("activation_checkpointing", False))
    trainer.fit(model, train_dataloaders=two_stream_loader(cfg["batch"]))
    state = trainer.strategy.lightning_module_state_dict()
    result = {"losses": rec.losses, "history": trainer.strategy.pipeline.rebalance_history}
    if trainer.global_rank == 0:
        result["state"] = os.path.join(out_dir, f"state{idx}.pt")
        torch.save(state, result["state"])
    return result


if __name__ == "__main__":
    run_spec(run_one)
