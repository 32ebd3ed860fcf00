"""Dynamic sparse attention: hash-bucketed block-sparse attention in the front half of the blocks
(fewer buckets in front, so densities differ per layer), dense attention behind it, a long
sequence so attention dominates; hash rotations re-drawn every forward make each layer's block
density change every step. Dynmo decides every iteration from the layers' reported work."""
from __future__ import annotations

MODEL = dict(vocab_size=256, block_size=512, n_layer=8, n_head=4, n_embd=128, dropout=0.0,
             attention=("hash_sparse",) * 4 + ("dense",) * 4, attention_block=64, nb_hash=8)


def plan(quick: bool) -> dict:
    steps, window, rounds = (20, (8, 20), 2) if quick else (50, (20, 50), 3)
    return dict(steps=steps, window=window, rounds=rounds, event=1, batch=8, microbatches=4, model=MODEL)


def build(cfg, plan: dict):
    from lightning_dynmo.models import GPT

    return GPT(cfg, seed=0, warmup_steps=2, max_steps=plan["steps"]), []


def dynmo_strategy(plan: dict) -> dict:
    return dict(balancer="partition_time", rebalance="auto", imbalance_threshold=0.1, rebalance_cooldown=1,
                rebalance_horizon=50)


def extra(model, callbacks, strategy) -> dict:
    return {"layer_load": [None if x is None else round(x, 3) for x in strategy.layer_load]}
