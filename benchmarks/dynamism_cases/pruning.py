"""Gradual global magnitude pruning to 90 % with the CSR kernels where they pay."""
from __future__ import annotations

from .freezing import MODEL


def plan(quick: bool) -> dict:
    steps, window, rounds = (26, (12, 26), 2) if quick else (60, (24, 60), 3)
    batch, microbatches = 16, 4
    return dict(steps=steps, window=window, rounds=rounds, event=4, batch=batch, microbatches=microbatches,
                model=MODEL, callback=dict(final_sparsity=0.9, start_step=2, n_steps=3, frequency=2,
                                           sparse_kernels="auto", kernel_tokens=batch // microbatches * 64))


def build(cfg, plan: dict):
    from lightning_dynmo.callbacks import GradualPruning
    from lightning_dynmo.models import GPT

    return GPT(cfg, seed=0, warmup_steps=2, max_steps=plan["steps"]), [GradualPruning(**plan["callback"])]


def dynmo_strategy(plan: dict) -> dict:
    return dict(balancer="partition_time", rebalance="on_event")


def extra(model, callbacks, strategy) -> dict:
    return {"sparsity": callbacks[0].sparsity,
            "sparse_kernel_layers": sum(1 for m in model.modules() if getattr(m, "sparse_kernel", False))}
