"""Progressive layer freezing as DynMo runs it (appendix F.4, on Egeria's criterion).

Every ``interval`` steps each of the two front-most trainable layers is compared with a
reference copy of itself (taken at the previous evaluation, held on the CPU; under the pipeline
each rank copies only its own layers); when a front layer's plasticity (how far its output on a
probe micro-batch moved from the reference's) stops changing, it freezes -- one layer per
evaluation, front to back, until 10 of the 15 layers (the embedding and 9 of 12 blocks) are
frozen. Frozen layers build no autograd graph, hold no gradients or optimizer state, and every
freeze requests a rebalance (the profiled step and the migration are inside the measurement).

The measurement window is the whole dynamic phase: from the step the first layer freezes to the
end of training. The timeline compresses Egeria's thousands of iterations into ~100 steps
(evaluation every 4 steps, plateau tolerance 0.45 on a run whose plasticity falls 30-40 % per
evaluation), so the freeze steps follow the criterion rather than a hand-set schedule; the JSON
reports them and each layer's plasticity trace.
"""
from __future__ import annotations

# The shared MODEL (early exit, pruning) is 8 blocks; freezing uses 12, as a layer-granular
# pipeline needs enough layers for the frozen prefix to move a boundary by less than a stage.
MODEL = dict(vocab_size=256, block_size=64, n_layer=8, n_head=4, n_embd=128, dropout=0.0)
FREEZING_MODEL = dict(MODEL, n_layer=12)


def plan(quick: bool) -> dict:
    # the first layer freezes at step 9 (second evaluation: references at 0, plasticity at 4 and 8)
    steps, window, rounds = (48, (8, 48), 1) if quick else (100, (8, 100), 3)
    return dict(steps=steps, window=window, rounds=rounds, event=8, batch=16, microbatches=4,
                model=FREEZING_MODEL,
                callback=dict(criterion="reference", threshold=0.45, interval=4, patience=1, lookahead=2,
                              max_per_event=1, max_frozen=10))


def build(cfg, plan: dict):
    from lightning_dynmo.callbacks import LayerFreezing
    from lightning_dynmo.models import GPT

    return GPT(cfg, seed=0, warmup_steps=2, max_steps=plan["steps"]), [LayerFreezing(**plan["callback"])]


def dynmo_strategy(plan: dict) -> dict:
    # DynMo's Algorithm 1: each freeze requests a profiled rebalance
    # each decision on per-layer means over 3 profiled steps (one step's times are noise on shared cores)
    return dict(balancer="partition_time", rebalance="on_event", profile_steps=3)


def extra(model, callbacks, strategy) -> dict:
    cb = callbacks[0]
    return {"frozen_layers": cb.n_frozen,
            "freeze_steps": {str(h["step"]): h["n_frozen"] for h in cb.history},  # step -> frozen layers
            "plasticity": {str(k): [round(x, 4) for x in v] for k, v in sorted(cb.plasticity.items())}}
