"""Trains an MoEGPT under DynMoStrategy (torchrun) or single-process Lightning; records what
tests compare.

Usage: torchrun --nproc-per-node N tests/support/workers/moe_worker.py SPEC.json
       python tests/support/workers/moe_worker.py SPEC.json          (single process, no strategy)
SPEC: {"out": path, "runs": [config, ...]}. A config: steps, batch, moe (MoEConfig fields),
pp (absent: single process), schedule, microbatches, balancer, rebalance, rebalance_interval.
Rank 0 writes {"runs": [...]} with the losses, the state dict path, the rebalance history and the
MoELoadMonitor's last per-layer statistics.
"""
from __future__ import annotations

import os

import torch

torch.set_num_threads(1)

import lightning as L

import lightning_dynmo  # noqa: F401  (registers "dynmo")
from lightning_dynmo import DynMoStrategy
from lightning_dynmo.callbacks.moe import MoELoadMonitor
from lightning_dynmo.models import MoEGPT
from tests.support.workers.common import LossRecorder, make_loader, make_model, run_spec


def build_model(cfg: dict) -> MoEGPT:
    dense = make_model(cfg)  # the shared test GPT's sizes and heterogeneous widths
    return MoEGPT(dense.config, moe=cfg["moe"], lr=cfg.get("lr", 3e-3), warmup_steps=2, max_steps=20,
                  seed=cfg.get("seed", 0))


def run_one(cfg: dict, out_dir: str, idx: int) -> dict:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    pipeline = "pp" in cfg
    if pipeline:
        strategy = DynMoStrategy(
            pipeline_parallel=cfg["pp"],
            schedule=cfg.get("schedule", "1f1b"),
            microbatches=cfg.get("microbatches", 4),
            balancer=cfg.get("balancer", "uniform"),
            rebalance=cfg.get("rebalance", "never"),
            rebalance_interval=cfg.get("rebalance_interval", 1),
            plot=False,
            timeout=120,
        )
        kw = dict(strategy=strategy, devices=world)
    else:
        kw = dict(devices=1)
    rec, monitor = LossRecorder(), MoELoadMonitor()
    model = build_model(cfg)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=cfg["steps"], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        gradient_clip_val=cfg.get("clip"), callbacks=[rec, monitor], default_root_dir=out_dir, **kw,
    )
    trainer.fit(model, train_dataloaders=make_loader(cfg, cfg["batch"], reference=not pipeline))
    if pipeline:
        state = trainer.strategy.lightning_module_state_dict()
        history = trainer.strategy.rebalance_history
    else:
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        history = []
    result = {"losses": rec.losses, "history": history, "load": monitor.last_stats}
    if trainer.global_rank == 0:
        result["state"] = os.path.join(out_dir, f"moe_state{idx}.pt")
        torch.save(state, result["state"])
    return result


if __name__ == "__main__":
    run_spec(run_one)
