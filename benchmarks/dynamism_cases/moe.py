"""Mixture of Experts: top-2 of 8 experts with Switch-style capacity (factor 1.0), aux loss on.
Without expert parallelism a layer's expert work changes only through dropped tokens, so
per-layer cost moves a little every step; dynmo decides every iteration from the layers' load
counters. With ``--expert-parallel N`` each stage's experts are split over N data-parallel
replicas and tokens travel to their owners by all_to_all, so a stage also waits for its busiest
shard: the load counters then report the busiest shard's received tokens (the same on every
replica of a group). With capacity factor 1.0 no shard can receive more than at balance, so
these load factors stay <= 1 (the busiest shard is at most its balanced share; imbalance
drops tokens instead); with dropless routing shard imbalance pushes them above 1."""
from __future__ import annotations

EXPERT_PARALLEL = True  # benchmarks/dynamism.py --expert-parallel N applies

MODEL = dict(vocab_size=256, block_size=64, n_layer=6, n_head=4, n_embd=96, dropout=0.0)


def plan(quick: bool) -> dict:
    steps, window, rounds = (26, (12, 26), 2) if quick else (60, (24, 60), 3)
    return dict(steps=steps, window=window, rounds=rounds, event=1, batch=16, microbatches=4, model=MODEL,
                moe=dict(num_experts=8, top_k=2, capacity_factor=1.0, aux_loss_coeff=0.01, expert_ratio=2.0),
                callback=dict(shift_threshold=0.02))


def build(cfg, plan: dict):
    from lightning_dynmo.callbacks import MoELoadMonitor
    from lightning_dynmo.models import MoEGPT

    model = MoEGPT(cfg, moe=plan["moe"], seed=0, warmup_steps=2, max_steps=plan["steps"])
    return model, [MoELoadMonitor(**plan["callback"])]


def dynmo_strategy(plan: dict) -> dict:
    return dict(balancer="partition_time", rebalance="auto", imbalance_threshold=0.05, rebalance_cooldown=1,
                rebalance_horizon=50)
