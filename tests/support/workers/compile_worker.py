"""Eager vs ``DynMoStrategy(compile=True)`` runs with a migration after step 1 (see
tests/distributed/test_compile.py). Rank 0 writes per run: losses, and per step and rank which
local layers are compiled and the identity of each one's compiled entry point."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

torch.set_num_threads(1)

import lightning as L

from lightning_dynmo import DynMoStrategy
from lightning_dynmo.runtime.compile import is_compiled

from tests.support.workers.common import LossRecorder, make_loader, make_model, run_spec


class MoveAfter(L.Callback):
    """After step ``step``, move to ``partition`` (every rank calls it); records the compiled
    layers of this rank after every step (gathered: {rank: {layer: id or None}})."""

    def __init__(self, step: int, partition):
        self.step, self.partition, self.compiled = step, partition, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        s = trainer.strategy.pipeline
        mine = {i: (id(s.layers[i]._compiled_call_impl) if is_compiled(s.layers[i]) else None)
                for i in s.local_layer_indices()}
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        self.compiled.append(every)
        if trainer.global_step == self.step:
            s.rebalance_to(self.partition)


def run_one(cfg: dict, out_dir: str, idx: int) -> dict:
    torch.manual_seed(0)
    model = make_model(cfg)
    strategy = DynMoStrategy(pipeline_parallel=2, microbatches=2, balancer="uniform", rebalance="never",
                             partition=cfg["partition"], compile=cfg["compile"],
                             activation_checkpointing=cfg.get("checkpointing", False), plot=False, timeout=600)
    rec, move = LossRecorder(), MoveAfter(cfg["move_after"], cfg["move_to"])
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=cfg["steps"], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[rec, move], default_root_dir=os.path.join(out_dir, f"run{idx}"))
    trainer.fit(model, train_dataloaders=make_loader(cfg, cfg["batch"]))
    keys = sorted(trainer.strategy.lightning_module_state_dict())  # rank 0: the single-process keys
    return {"losses": rec.losses, "compiled": move.compiled, "state_keys": keys}


if __name__ == "__main__":
    run_spec(run_one)
