"""Trains Mixture-of-Depths GPTs under DynMoStrategy (torchrun) or single-process Lightning.

Usage: torchrun --nproc-per-node N tests/support/workers/mod_worker.py SPEC.json
       python tests/support/workers/mod_worker.py SPEC.json       (single process, no strategy)
SPEC: {"out": path, "runs": [config, ...]}. A config: steps, batch, mod (MoDConfig fields),
moe (MoEConfig fields: MoE MLPs, also in MoD blocks; or absent), callback (MixtureOfDepths kwargs
or absent), moe_monitor (MoELoadMonitor kwargs or absent), precision, and for a pipeline pp, schedule,
microbatches, balancer, partition, rebalance, rebalance_interval, expert_parallel, dp_sharding. Rank 0 writes
{"runs": [...]} with the losses, the strategy's rebalance history, the callback state and the paths
of the final full state dict and optimizer state (single-process format).
"""
from __future__ import annotations

import os

import torch

torch.set_num_threads(1)

import lightning as L

import lightning_dynmo  # noqa: F401  (registers "dynmo")
from lightning_dynmo import DynMoStrategy
from lightning_dynmo.callbacks.mod import MixtureOfDepths
from lightning_dynmo.callbacks.moe import MoELoadMonitor
from lightning_dynmo.models.mod import MoDGPT

from lightning_dynmo.strategy.checkpointer import checkpointer_for
from lightning_dynmo.strategy.options import CheckpointFormat
from tests.support.workers.common import LossRecorder, make_loader, make_model, run_spec
from tests.support.workers.real_models_worker import precision_kwargs


def build_model(cfg: dict) -> MoDGPT:
    """The shared test GPT (heterogeneous MLP widths) with MoD blocks."""
    return MoDGPT(make_model(cfg).config, mod=cfg["mod"], moe=cfg.get("moe"), lr=cfg.get("lr", 3e-3), warmup_steps=2,
                  max_steps=20,
                  seed=cfg.get("seed", 0))


def build_callbacks(cfg: dict) -> list[L.Callback]:
    cbs: list[L.Callback] = [MixtureOfDepths(**cfg["callback"])] if cfg.get("callback") is not None else []
    if cfg.get("moe_monitor") is not None:
        cbs.append(MoELoadMonitor(**cfg["moe_monitor"]))
    return cbs


def run_one(cfg: dict, out_dir: str, idx: int) -> dict:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    pipeline = "pp" in cfg
    kw: dict = dict(devices=1)
    if pipeline:
        strategy = DynMoStrategy(
            pipeline_parallel=cfg["pp"],
            schedule=cfg.get("schedule", "1f1b"),
            microbatches=cfg.get("microbatches", 4),
            balancer=cfg.get("balancer", "uniform"),
            partition=cfg.get("partition"),
            rebalance=cfg.get("rebalance", "never"),
            rebalance_interval=cfg.get("rebalance_interval", 1),
            expert_parallel=cfg.get("expert_parallel", 1),
            dp_sharding=cfg.get("dp_sharding", "replicate"),
            plot=False,
            timeout=120,
        )
        kw = dict(strategy=strategy, devices=world)
    if cfg.get("precision"):
        kw.update(precision_kwargs(cfg))
    rec = LossRecorder()
    cbs = build_callbacks(cfg)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=cfg["steps"], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        gradient_clip_val=cfg.get("clip"), callbacks=[rec, *cbs], default_root_dir=out_dir, **kw,
    )
    model = build_model(cfg)
    dp = 1 if pipeline else cfg.get("dp", 1)  # a reference trains on the global batch of dp replicas
    trainer.fit(model, train_dataloaders=make_loader(cfg, cfg["batch"] * dp, reference=not pipeline, dp=dp))
    if pipeline:  # the full state, gathered onto rank 0 whatever format the checkpoints have
        trainer.strategy.checkpointer = checkpointer_for(CheckpointFormat.SINGLE)  # the format, switched
        state = trainer.strategy.lightning_module_state_dict()
        optim = trainer.strategy.optimizer_state(trainer.optimizers[0])
    else:
        state, optim = model.state_dict(), trainer.optimizers[0].state_dict()
    result = {
        "losses": rec.losses,
        "history": trainer.strategy.pipeline.rebalance_history if pipeline else [],
        "callback": cbs[0].state_dict() if cbs else None,
    }
    monitors = [cb for cb in cbs if isinstance(cb, MoELoadMonitor)]
    if monitors:
        result["moe_monitor"] = {"last_stats": monitors[0].last_stats, "requests": monitors[0].requests}
    # per rank: the expert rows each local MoE layer holds (half of them under expert_parallel=2)
    rows = {i: int(block.mlp.experts.w1.shape[0]) for i, block in model.moe_blocks()}
    if pipeline:
        per_rank = [None] * world
        torch.distributed.all_gather_object(per_rank, rows)
        result["expert_rows_per_rank"] = per_rank
    else:
        result["expert_rows_per_rank"] = [rows]
    if trainer.global_rank == 0:
        result["state"] = os.path.join(out_dir, f"mod_state{idx}.pt")
        result["optim"] = os.path.join(out_dir, f"mod_optim{idx}.pt")
        torch.save(state, result["state"])
        torch.save(optim, result["optim"])
    return result


if __name__ == "__main__":
    run_spec(run_one)
