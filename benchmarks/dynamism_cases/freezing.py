"""Layer freezing: a front prefix (embedding + 3 blocks) freezes at the event step."""
from __future__ import annotations

MODEL = dict(vocab_size=256, block_size=64, n_layer=8, n_head=4, n_embd=128, dropout=0.0)


def plan(quick: bool) -> dict:
    steps, window, rounds = (26, (12, 26), 2) if quick else (60, (24, 60), 3)
    return dict(steps=steps, window=window, rounds=rounds, event=4, batch=16, microbatches=4, model=MODEL,
                callback=dict(schedule={4: 4}))


def build(cfg, plan: dict):
    from lightning_dynmo.callbacks import LayerFreezing
    from lightning_dynmo.models import GPT

    return GPT(cfg, seed=0, warmup_steps=2, max_steps=plan["steps"]), [LayerFreezing(**plan["callback"])]


def dynmo_strategy(plan: dict) -> dict:
    return dict(balancer="partition_time", rebalance="on_event")


def extra(model, callbacks, strategy) -> dict:
    return {"frozen_layers": callbacks[0].n_frozen}
