"""Pruning with CSR storage and freezing under DynMoStrategy (torchrun) or single-process Lightning,
counting the bytes each step hands to the data-parallel all-reduce.

Usage: torchrun --nproc-per-node N tests/support/workers/sparse_worker.py SPEC.json
       python tests/support/workers/sparse_worker.py SPEC.json          (single process)
SPEC: {"out": path, "runs": [config, ...]}. A config: steps, batch (per replica), pp (absent:
single process; data-parallel replicas = world / pp), pruning / freezing (callback kwargs),
balancer, rebalance, rebalance_interval, save (checkpoint path written at the end), resume
(checkpoint path to resume from). Rank 0 writes per run: losses, per-step bytes into the
data-parallel all-reduce and gradient bytes (both summed over replica 0's pipeline ranks), the
pruned layers' memory ratio, the rebalance history and the partition.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

torch.set_num_threads(1)

import lightning as L

import lightning_dynmo  # noqa: F401  (registers "dynmo")
from lightning_dynmo import DynMoStrategy
from lightning_dynmo.callbacks import GradualPruning, LayerFreezing
from lightning_dynmo.dynamic import PrunableLinear

from tests.support.workers.common import LossRecorder, make_loader, make_model, run_spec

_real_all_reduce = dist.all_reduce


class ExchangeMeter(L.Callback):
    """Bytes handed to the data-parallel all-reduce per step, and the bytes of the gradients
    (what the exchange has to carry: trainable parameters only, CSR-stored ones nnz-long)."""

    def __init__(self, strategy) -> None:
        self.strategy = strategy
        self.sent: list[int] = []
        self.grads: list[int] = []
        self.frozen_with_grad: list[int] = []

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        replicas = getattr(getattr(self.strategy, "pipeline", None), "data_parallel_group", None)
        if self.sent and group is not None and group is replicas:
            self.sent[-1] += tensor.numel() * tensor.element_size()
        return _real_all_reduce(tensor, op=op, group=group, async_op=async_op)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.sent.append(0)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        ps = list(pl_module.parameters())
        self.grads.append(sum(p.grad.numel() * p.grad.element_size() for p in ps if p.grad is not None))
        self.frozen_with_grad.append(sum(1 for p in ps if not p.requires_grad and p.grad is not None))


def run_one(cfg: dict, out_dir: str, idx: int) -> dict:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model = make_model(cfg)
    cbs = {}
    if cfg.get("pruning") is not None:
        cbs["pruning"] = GradualPruning(**cfg["pruning"])
    if cfg.get("freezing") is not None:
        kw = dict(cfg["freezing"])
        kw["schedule"] = {int(k): v for k, v in kw.get("schedule", {}).items()}
        cbs["freezing"] = LayerFreezing(**kw)
    rec = LossRecorder()
    pipeline = "pp" in cfg
    dp = world // cfg["pp"] if pipeline else 1
    strategy = None
    if pipeline:
        strategy = DynMoStrategy(pipeline_parallel=cfg["pp"], microbatches=cfg.get("microbatches", 4),
                                 balancer=cfg.get("balancer", "uniform"), rebalance=cfg.get("rebalance", "never"),
                                 rebalance_interval=cfg.get("rebalance_interval", 1), plot=False, timeout=120,
                                 dp_sharding=cfg.get("dp_sharding", "replicate"))
        kw = dict(strategy=strategy, devices=world)
    else:
        kw = dict(devices=1)
    meter = ExchangeMeter(strategy)
    dist.all_reduce = meter.all_reduce
    trainer = L.Trainer(
        accelerator="cpu", max_steps=cfg["steps"], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        callbacks=[rec, meter, *cbs.values()], default_root_dir=out_dir, **kw,
    )
    ref_batch = cfg["batch"] * cfg.get("ref_dp", 1)
    loader = make_loader(cfg, cfg["batch"]) if pipeline else make_loader(cfg, ref_batch, reference=True,
                                                                         dp=cfg.get("ref_dp", 1))
    try:
        trainer.fit(model, train_dataloaders=loader, ckpt_path=cfg.get("resume"))
    finally:
        dist.all_reduce = _real_all_reduce
    if cfg.get("save"):
        trainer.save_checkpoint(cfg["save"])
    result = {"losses": rec.losses, "dp": dp}
    if "freezing" in cbs:
        result["freezing"] = [(h["step"], h["n_frozen"]) for h in cbs["freezing"].history]
    if "pruning" in cbs:
        result["memory"] = cbs["pruning"].state_bytes(trainer, model)
        result["sparsity"] = cbs["pruning"].sparsity
    if pipeline:
        row = torch.tensor([meter.sent, meter.grads, meter.frozen_with_grad], dtype=torch.float64)
        if strategy.pipeline.layout.dp_rank != 0:
            row.zero_()
        dist.all_reduce(row)  # summed over replica 0's pipeline ranks
        result.update(sent=row[0].tolist(), grads=row[1].tolist(), frozen_with_grad=row[2].tolist(),
                      history=strategy.pipeline.rebalance_history, partition=str(strategy.pipeline.partition))
        csr = [m for m in model.modules() if isinstance(m, PrunableLinear) and m.compressed]
        compressed = sum(1 for m in csr if m.sparse_kernel or not cfg.get("count_kernels"))
        per_rank = [None] * world
        dist.all_gather_object(per_rank, compressed)
        result["compressed_per_rank"] = per_rank
    return result


if __name__ == "__main__":
    run_spec(run_one)
