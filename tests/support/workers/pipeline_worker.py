"""Runs a list of DynMo training configs in one torchrun launch and records what tests compare.

Usage: torchrun --nproc-per-node N tests/workers/pipeline_worker.py SPEC.json
SPEC: {"out": path, "runs": [config, ...]}; each config is a dict (see ``run_one``). Rank 0
writes {"runs": [{"losses": [...], "state": path, "optim": path, "history": [...]}, ...]}.
"""
from __future__ import annotations

import os

import torch

torch.set_num_threads(1)

import lightning as L

import lightning_dynmo  # noqa: F401  (registers "dynmo")
from lightning_dynmo import DynMoStrategy

from tests.support.workers.common import LossRecorder, make_loader, make_model, run_spec


class RepackRequest(L.Callback):
    """Calls ``strategy.request_repack(target)`` at the end of a given step (on every rank)."""

    def __init__(self, step: int, target):
        self.step, self.target = step, target

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.strategy.request_repack(self.target)


class ReleaseListener(L.Callback):
    """What a launcher would do: listen for released workers."""

    def __init__(self):
        self.ranks = []

    def on_workers_released(self, ranks):
        self.ranks = list(ranks)


def run_one(cfg: dict, out_dir: str, idx: int) -> dict:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    nnodes = int(cfg.get("nnodes", 1))
    model = make_model(cfg)
    pp = cfg["pp"]
    dp = world // pp
    strategy = DynMoStrategy(
        pipeline_parallel=pp,
        schedule=cfg.get("schedule", "1f1b"),
        microbatches=cfg.get("microbatches", 4),
        balancer=cfg.get("balancer", "uniform"),
        partition=cfg.get("partition"),
        rebalance=cfg.get("rebalance", "never"),
        rebalance_interval=cfg.get("rebalance_interval", 1),
        imbalance_threshold=cfg.get("imbalance_threshold", 0.1),
        repack=cfg.get("repack", "off"),
        memory_capacity=cfg.get("memory_capacity"),
        rebalance_cooldown=cfg.get("rebalance_cooldown", 10),
        plot=False,
        timeout=120,
    )
    rec = LossRecorder()
    released_hook = ReleaseListener()
    ckpt_dir = os.path.join(out_dir, f"ckpt{idx}")
    callbacks = [rec, released_hook]
    if cfg.get("freeze"):
        from lightning_dynmo import LayerFreezing

        callbacks.append(LayerFreezing(schedule={int(k): int(v) for k, v in cfg["freeze"].items()}))
    if cfg.get("request_repack"):
        step, target = cfg["request_repack"]
        callbacks.append(RepackRequest(int(step), target))
    if cfg.get("save_ckpt"):
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_train_steps=cfg["steps"]))
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=world // nnodes,
        num_nodes=nnodes,
        max_steps=cfg["steps"],
        logger=False,
        enable_checkpointing=bool(cfg.get("save_ckpt")),
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        gradient_clip_val=cfg.get("clip"),
        callbacks=callbacks,
        default_root_dir=out_dir,
    )
    trainer.fit(model, train_dataloaders=make_loader(cfg, cfg["batch"]), ckpt_path=cfg.get("resume"))
    events = trainer.strategy.last_step_events()  # the last step's chunk timeline on this rank
    chunk_seconds = {k: sum(e["end"] - e["start"] for e in events if e["kind"] == k) for k in "FBW"}
    grads = sum(1 for p in trainer.lightning_module.parameters() if p.grad is not None)
    local = (sum(p.numel() for p in trainer.lightning_module.parameters()), bool(getattr(trainer.strategy, "released", False)),
             chunk_seconds, grads)
    per_rank = [None] * world
    torch.distributed.all_gather_object(per_rank, local)
    state = trainer.strategy.lightning_module_state_dict()
    optim = trainer.strategy.optimizer_state(trainer.optimizers[0])
    result = {"losses": rec.losses, "step_seconds": rec.step_seconds, "imbalance": rec.imbalance, "history": trainer.strategy.rebalance_history, "partition": str(trainer.strategy.partition), "dp": dp,
              "params_per_rank": [x[0] for x in per_rank], "released_per_rank": [x[1] for x in per_rank],
              "chunk_seconds_per_rank": [x[2] for x in per_rank], "grads_per_rank": [x[3] for x in per_rank],
              "released_hook": released_hook.ranks}
    if trainer.global_rank == 0:
        result["state"] = os.path.join(out_dir, f"state{idx}.pt")
        result["optim"] = os.path.join(out_dir, f"optim{idx}.pt")
        torch.save(state, result["state"])
        torch.save(optim, result["optim"])
        if cfg.get("save_ckpt"):
            result["ckpt"] = os.path.join(ckpt_dir, "last.ckpt")
    return result


if __name__ == "__main__":
    run_spec(run_one)
