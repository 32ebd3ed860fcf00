"""Runs dynamism callbacks under DynMoStrategy (torchrun) or single-process Lightning.

Usage: torchrun --nproc-per-node N tests/workers/dynamism_worker.py SPEC.json
       python tests/workers/dynamism_worker.py SPEC.json          (single process, no strategy)
SPEC: {"out": path, "runs": [config, ...]}. A config: steps, batch, pp (absent: single process),
model ("gpt" | "early_exit"), pruning / freezing / early_exit (callback kwargs or absent),
balancer, rebalance, rebalance_interval, partition. Rank 0 writes {"runs": [...]} with the losses,
the full state dict and optimizer state (single-process format) paths, callback states, the
strategy's rebalance history and, per rank, how many pruned linears run the sparse kernel.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

torch.set_num_threads(1)

import lightning as L

import lightning_dynmo  # noqa: F401  (registers "dynmo")
from lightning_dynmo import DynMoStrategy
from lightning_dynmo.callbacks import EarlyExit, GradualPruning, LayerFreezing
from lightning_dynmo.dynamic import EarlyExitGPT, PrunableLinear

from tests.support.workers.common import LossRecorder, make_loader, make_model, run_spec


def build_model(cfg: dict):
    model = make_model(cfg)
    if cfg.get("model", "gpt") == "early_exit":
        ee = EarlyExitGPT(model.config, lr=cfg.get("lr", 3e-3), warmup_steps=2, max_steps=cfg["steps"] + 5)
        ee.load_state_dict(model.state_dict())
        model = ee
    return model


def build_callbacks(cfg: dict) -> dict:
    cbs = {}
    if cfg.get("pruning") is not None:
        cbs["pruning"] = GradualPruning(**cfg["pruning"])
    if cfg.get("freezing") is not None:
        kw = dict(cfg["freezing"])
        if "schedule" in kw:
            kw["schedule"] = {int(k): v for k, v in kw["schedule"].items()}
        cbs["freezing"] = LayerFreezing(**kw)
    if cfg.get("early_exit") is not None:
        kw = dict(cfg["early_exit"])
        if "schedule" in kw:
            kw["schedule"] = {int(k): v for k, v in kw["schedule"].items()}
        cbs["early_exit"] = EarlyExit(**kw)
    return cbs


def run_one(cfg: dict, out_dir: str, idx: int) -> dict:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model = build_model(cfg)
    cbs = build_callbacks(cfg)
    rec = LossRecorder()
    pipeline = "pp" in cfg
    if pipeline:
        strategy = DynMoStrategy(
            pipeline_parallel=cfg["pp"],
            microbatches=cfg.get("microbatches", 4),
            balancer=cfg.get("balancer", "uniform"),
            partition=cfg.get("partition"),
            rebalance=cfg.get("rebalance", "never"),
            rebalance_interval=cfg.get("rebalance_interval", 1),
            plot=False,
            timeout=120,
        )
        kw = dict(strategy=strategy, devices=world)
    else:
        kw = dict(devices=1)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=cfg["steps"], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        callbacks=[rec, *cbs.values()], default_root_dir=out_dir, **kw,
    )
    trainer.fit(model, train_dataloaders=make_loader(cfg, cfg["batch"], reference=not pipeline))
    sparse_kernels = sum(1 for m in model.modules() if isinstance(m, PrunableLinear) and m.sparse_kernel)
    if pipeline:
        state = trainer.strategy.lightning_module_state_dict()
        optim = trainer.strategy.optimizer_state(trainer.optimizers[0])
        history, partition = trainer.strategy.pipeline.rebalance_history, str(trainer.strategy.pipeline.partition)
        per_rank = [None] * world
        dist.all_gather_object(per_rank, sparse_kernels)
    else:
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        optim = trainer.optimizers[0].state_dict()
        history, partition, per_rank = [], None, [sparse_kernels]
    result = {
        "losses": rec.losses,
        "history": history,
        "partition": partition,
        "callbacks": {name: cb.state_dict() for name, cb in cbs.items()},
        "sparse_kernels_per_rank": per_rank,
    }
    if trainer.global_rank == 0:
        result["state"] = os.path.join(out_dir, f"dyn_state{idx}.pt")
        result["optim"] = os.path.join(out_dir, f"dyn_optim{idx}.pt")
        torch.save(state, result["state"])
        torch.save(optim, result["optim"])
    return result


if __name__ == "__main__":
    run_spec(run_one)
