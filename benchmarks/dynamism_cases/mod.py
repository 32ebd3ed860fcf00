"""Mixture of Depths: every other block takes a learned share of the tokens (predictor routing,
counts vary per block and step) while the capacity anneals from 1.0 to 0.125; dynmo decides
every iteration from the blocks' token counters (no profiling) and migrates when the predicted
saving over the horizon beats the measured migration cost."""
from __future__ import annotations

MODEL = dict(vocab_size=256, block_size=128, n_layer=8, n_head=4, n_embd=128, dropout=0.0)


def plan(quick: bool) -> dict:
    steps, window, rounds = (30, (14, 30), 2) if quick else (70, (28, 70), 3)
    return dict(steps=steps, window=window, rounds=rounds, event=2, batch=16, microbatches=4, model=MODEL,
                mod=dict(capacity=0.125, every=2, routing="predictor", predictor_loss_coeff=0.1),
                callback=dict(capacity=1.0, final_capacity=0.125, anneal_steps=10, drift=0.05))


def build(cfg, plan: dict):
    from lightning_dynmo.callbacks import MixtureOfDepths
    from lightning_dynmo.models import MoDGPT

    model = MoDGPT(cfg, mod=plan["mod"], seed=0, warmup_steps=2, max_steps=plan["steps"])
    return model, [MixtureOfDepths(**plan["callback"])]


def dynmo_strategy(plan: dict) -> dict:
    return dict(balancer="partition_time", rebalance="auto", imbalance_threshold=0.1, rebalance_cooldown=1,
                rebalance_horizon=50)


def extra(model, callbacks, strategy) -> dict:
    return {"token_fraction_per_layer": callbacks[0].last_fractions}
