"""2:4 pruning with ``sparse_kernels="auto"`` on data-parallel replicas whose local kernel
measurements are forced to disagree (``LDSPARSE_CROSSOVER`` set per rank from ``crossover``, a
list indexed by rank), under DynMoStrategy (``pp``) or Lightning's DDP (``ddp: true``).

Usage: torchrun --nproc-per-node 2 tests/support/workers/nm_worker.py SPEC.json
Rank 0 writes per run: every rank's local and agreed kernel per layer, the layers' CSR-kernel
flags, the losses (DDP: the replica's own), a per-parameter checksum and the final sparsity.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

torch.set_num_threads(1)

import lightning as L

import lightning_dynmo  # noqa: F401  (registers "dynmo")
from lightning_dynmo import DynMoStrategy
from lightning_dynmo.callbacks import GradualPruning
from lightning_dynmo.dynamic import PrunableLinear

from tests.support.workers.common import LossRecorder, make_loader, make_model, run_spec


def run_one(cfg: dict, out_dir: str, idx: int) -> dict:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.environ["LDSPARSE_CROSSOVER"] = str(cfg["crossover"][rank])  # this rank's "measurement"
    model = make_model(cfg)
    cb = GradualPruning(**cfg["pruning"])
    rec = LossRecorder()
    if cfg.get("ddp"):
        strategy = "ddp"
    else:
        strategy = DynMoStrategy(pipeline_parallel=cfg["pp"], microbatches=2, plot=False, timeout=120)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=cfg["steps"], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[rec, cb], default_root_dir=out_dir)
    trainer.fit(model, train_dataloaders=make_loader(cfg, cfg["batch"]))
    mine = {"rank": rank, "local": cb.local_kernels, "agreed": cb.kernels, "losses": rec.losses,
            "csr_flags": {n: m.sparse_kernel for n, m in model.named_modules() if isinstance(m, PrunableLinear)},
            "sparsity": cb.sparsity,
            "weights": [float(p.detach().double().sum()) for p in model.parameters()]}
    every = [None] * world
    dist.all_gather_object(every, mine)
    return {"ranks": every}


if __name__ == "__main__":
    run_spec(run_one)
