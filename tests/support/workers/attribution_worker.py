"""A GPT whose loss sleeps ``loss_delay`` seconds in its forward and again in its backward, on a
pipeline that profiles layers; records, per rank and per profiled step, the profiler's per-layer
times and its busy / attributed seconds (the loss's time must belong to a layer).

Usage: torchrun --nproc-per-node 2 attribution_worker.py SPEC.json (see common.run_spec).
"""
from __future__ import annotations

import time

import torch

torch.set_num_threads(1)

import lightning as L

from lightning_dynmo import DynMoStrategy

from tests.support.workers.common import make_loader, make_model, run_spec
from lightning_dynmo.models import GPT


class _Sleep(torch.autograd.Function):
    """Identity that takes ``seconds`` in its forward and in its backward."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class SlowLossGPT(GPT):
    loss_delay = 0.0

    def pipeline_loss(self, output, target):
        return _Sleep.apply(super().pipeline_loss(output, target), self.loss_delay)


class ProfiledSteps(L.Callback):
    """At the end of every step that profiled layers: this rank's layer times and attribution."""

    def __init__(self):
        self.steps: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        prof = trainer.strategy.pipeline.profiler
        if prof.layer_profiling:
            busy, attributed = prof.attribution()
            self.steps.append({"step": trainer.global_step, "busy": busy, "attributed": attributed,
                               "layers": {str(k): list(v) for k, v in prof.layer_times().items()},
                               "events": prof.event_dicts(trainer.global_rank)})


def run_one(cfg: dict, out_dir: str, idx: int) -> dict:
    model = make_model(cfg, cls=SlowLossGPT)
    model.loss_delay = cfg["loss_delay"]
    probe = ProfiledSteps()
    strategy = DynMoStrategy(pipeline_parallel=2, schedule=cfg["schedule"], microbatches=cfg["microbatches"],
                             virtual_stages=cfg.get("virtual_stages"), balancer="uniform", rebalance="every_n",
                             rebalance_interval=2, timeout=120)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=cfg["steps"], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[probe], default_root_dir=f"{out_dir}/run{idx}")
    trainer.fit(model, train_dataloaders=make_loader(cfg, cfg["batch"]))
    per_rank = [None] * trainer.world_size
    torch.distributed.all_gather_object(per_rank, probe.steps)
    return {"per_rank": per_rank, "head": len(model.pipeline_layers()) - 1}


if __name__ == "__main__":
    run_spec(run_one)
