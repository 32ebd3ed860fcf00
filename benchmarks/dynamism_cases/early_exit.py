"""Early exit: the saturation threshold drops at the event step, deep blocks see fewer tokens."""
from __future__ import annotations

from .freezing import MODEL


def plan(quick: bool) -> dict:
    steps, window, rounds = (26, (12, 26), 2) if quick else (60, (24, 60), 3)
    return dict(steps=steps, window=window, rounds=rounds, event=4, batch=16, microbatches=4, model=MODEL,
                callback=dict(schedule={4: 0.93}, check_interval=2))


def build(cfg, plan: dict):
    from lightning_dynmo.callbacks import EarlyExit
    from lightning_dynmo.models import EarlyExitGPT

    return EarlyExitGPT(cfg, seed=0, warmup_steps=2, max_steps=plan["steps"]), [EarlyExit(**plan["callback"])]


def dynmo_strategy(plan: dict) -> dict:
    return dict(balancer="partition_time", rebalance="on_event")


def extra(model, callbacks, strategy) -> dict:
    return {"active_fraction_per_layer": callbacks[0].last_fractions}
