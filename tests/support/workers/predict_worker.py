"""``trainer.predict`` through the pipeline, optionally after a fit that migrated layers and an
explicit ``strategy.pipeline.rebalance_to``; then ``trainer.validate`` on the same trainer.

Usage: torchrun --nproc-per-node N predict_worker.py SPEC.json (see ``run_worker``). Rank 0 writes,
per run, the final weights (single-process keys), every rank's predictions and what it logged.
"""
from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

torch.set_num_threads(1)

import lightning as L

import lightning_dynmo  # noqa: F401  (registers "dynmo")
from lightning_dynmo import DynMoStrategy

from tests.support.evaluation import eval_loader
from tests.support.prediction import GPTLogits, GPTPredict, predict_loader
from tests.support.workers.common import make_loader, make_model, run_spec


def run_one(cfg: dict, out_dir: str, idx: int) -> dict:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cls = GPTPredict if cfg.get("hook", True) else GPTLogits
    model = cls(**make_model(cfg).hparams)
    strategy = DynMoStrategy(pipeline_parallel=cfg["pp"], schedule=cfg.get("schedule", "1f1b"),
                             microbatches=cfg.get("microbatches", 4), partition=cfg.get("partition"),
                             rebalance=cfg.get("rebalance", "never"), rebalance_interval=1,
                             balancer=cfg.get("balancer", "uniform"), plot=False, timeout=120)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=world, max_steps=cfg.get("steps", 1),
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False,
                        default_root_dir=os.path.join(out_dir, f"run{idx}"))
    result: dict = {"dp": world // cfg["pp"]}
    if cfg.get("steps"):
        trainer.fit(model, train_dataloaders=make_loader(cfg, cfg["batch"]))
        result["history"] = trainer.strategy.pipeline.rebalance_history
    if cfg.get("rebalance_to"):
        trainer.strategy.pipeline.rebalance_to(cfg["rebalance_to"])  # a migration outside fit (collective)
    loader = predict_loader(cfg, cfg["batch"], cfg["n"], with_targets=cfg.get("targets", True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        predictions = trainer.predict(model, dataloaders=loader)
    result["warned"] = any("predict_step is not called" in str(w.message) for w in caught)
    result["partition"] = str(trainer.strategy.pipeline.partition)
    per_rank: list = [None] * world
    dist.all_gather_object(per_rank, predictions)
    state = trainer.strategy.lightning_module_state_dict()
    if cfg.get("validate"):
        out = trainer.validate(model, dataloaders=eval_loader(cfg, cfg["batch"]), verbose=False)
        result["val_loss"] = float(out[0]["val_loss"])
        # a later stage restoring a checkpoint into the module fit left with placeholders for the
        # other ranks' layers: the weights are disturbed first, so only the load gives val_loss back
        ckpt = trainer.strategy.broadcast(os.path.join(out_dir, f"run{idx}.ckpt"))
        trainer.save_checkpoint(ckpt)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p))
        disturbed = trainer.validate(model, dataloaders=eval_loader(cfg, cfg["batch"]), verbose=False)
        restored = trainer.validate(model, dataloaders=eval_loader(cfg, cfg["batch"]), ckpt_path=ckpt, verbose=False)
        result["val_loss_disturbed"] = float(disturbed[0]["val_loss"])
        result["val_loss_from_checkpoint"] = float(restored[0]["val_loss"])
    if trainer.global_rank == 0:
        result["state"] = os.path.join(out_dir, f"state{idx}.pt")
        result["predictions"] = os.path.join(out_dir, f"predictions{idx}.pt")
        torch.save(state, result["state"])
        torch.save(per_rank, result["predictions"])
    return result


if __name__ == "__main__":
    run_spec(run_one)
