"""No dynamism: a dense GPT whose layers never change, with DynMo's default options
(``rebalance="auto"``, ``partition_time``, threshold 0.1, cooldown 10, horizon 100, 1 %
overhead budget) against the static splits. DynMo cannot help here; the case measures what it
costs to have it on (``speedup_vs_static`` should be 1 within ``resolution``)."""
from __future__ import annotations

from .freezing import MODEL


def plan(quick: bool) -> dict:
    steps, window, rounds = (26, (12, 26), 2) if quick else (60, (24, 60), 3)
    return dict(steps=steps, window=window, rounds=rounds, event=0, batch=16, microbatches=4, model=MODEL)


def build(cfg, plan: dict):
    from lightning_dynmo.models import GPT

    return GPT(cfg, seed=0, warmup_steps=2, max_steps=plan["steps"]), []


def dynmo_strategy(plan: dict) -> dict:
    # the strategy's own defaults, read from PipelineOptions (where every option gets its default);
    # the benchmark's harness sets rebalance_cooldown=1 for the dynamic cases, here it is set back
    from dataclasses import fields

    from lightning_dynmo.strategy.options import PipelineOptions

    defaults = {f.name: f.default for f in fields(PipelineOptions)}
    return {k: getattr(defaults[k], "value", defaults[k])  # an enum default as its plain value
            for k in ("balancer", "rebalance", "imbalance_threshold", "rebalance_cooldown", "rebalance_horizon",
                      "overhead_budget")}
