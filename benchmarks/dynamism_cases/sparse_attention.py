"""Dynamic sparse attention (Pagliardini et al. 2023; DynMo paper section 2, appendix F.5).

Scenario (documented, not tuned to the result): a long sequence (2048 tokens, width 64) so that
attention is most of a block's work, every block hash-sparse with a per-layer density schedule --
the number of hash buckets doubles every two blocks (1, 1, 2, 2, 4, 4, 8, 8: the first blocks
attend densely, deeper ones more and more sparsely) -- and rotations redrawn every step, so each
layer's block density differs from the others and drifts from step to step. The blocks report
their work every step (``ReportsLoad``), ``SparseAttentionMonitor`` logs it and asks for a
rebalance when it moves, and dynmo decides every iteration from the load counters.

``speedup_vs_static``: dynmo over the better static balancer, same sparse model.
``speedup_vs_dense_attention``: dynmo over the same model with dense causal attention (SDPA) in
every block, balanced by dynmo too -- the end-to-end gain of the sparse attention itself.
"""
from __future__ import annotations

MODEL = dict(vocab_size=256, block_size=2048, n_layer=8, n_head=4, n_embd=64, dropout=0.0,
             attention="hash_sparse", attention_block=64, nb_hash=(1, 1, 2, 2, 4, 4, 8, 8), hash_redraw=True)


def plan(quick: bool) -> dict:
    steps, window, rounds = (20, (8, 20), 2) if quick else (50, (20, 50), 3)
    return dict(steps=steps, window=window, rounds=rounds, event=1, batch=8, microbatches=4, model=MODEL,
                callback=dict(shift_threshold=0.02))


def build(cfg, plan: dict):
    from lightning_dynmo.callbacks import SparseAttentionMonitor
    from lightning_dynmo.models import GPT

    model = GPT(cfg, seed=0, warmup_steps=2, max_steps=plan["steps"])
    sparse = any(cfg.layer_attention(i) == "hash_sparse" for i in range(cfg.n_layer))
    return model, [SparseAttentionMonitor(**plan["callback"])] if sparse else []


def dynmo_strategy(plan: dict) -> dict:
    return dict(balancer="partition_time", rebalance="auto", imbalance_threshold=0.05, rebalance_cooldown=1,
                rebalance_horizon=50)


def variants(plan: dict) -> dict:
    return {"dense_attention": (dict(attention="dense"), dynmo_strategy(plan))}


def extra(model, callbacks, strategy) -> dict:
    monitor = callbacks[0] if callbacks else None
    density = [None] * len(strategy.pipeline.layer_load)
    for i, s in (monitor.last_stats if monitor else {}).items():
        density[i] = s["density"]
    return {"layer_load": [None if x is None else round(x, 3) for x in strategy.pipeline.layer_load],
            "block_density": density, "monitor_requests": len(monitor.requests) if monitor else None}
