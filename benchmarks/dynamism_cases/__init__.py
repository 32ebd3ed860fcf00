"""One module per dynamism case of ``benchmarks/dynamism.py``.

A case module defines:

* ``plan(quick) -> dict``: steps, measurement window, rounds, event step, batch, micro-batches,
  the GPT config (``model``) and anything the case needs;
* ``build(cfg, plan) -> (model, callbacks)``: a fresh model and the dynamism callbacks;
* ``dynmo_strategy(plan) -> dict``: the DynMoStrategy options of the dynamic run (the static
  runs use ``uniform`` / ``param`` with ``rebalance="never"``);
* optionally ``extra(model, callbacks, strategy) -> dict``: case-specific figures for the JSON
  record (rank 0's view; every rank calls it, so it may run collectives);
* optionally ``variants(plan) -> {name: (model overrides, strategy options)}``: runs of another
  model (GPTConfig fields replaced) in the same rounds; the summary adds ``speedup_vs_<name>``
  (dynmo over that run, e.g. the same model with dense attention);
* optionally ``launcher_extra(quick) -> dict``: figures from a job of the case's own (run by the
  launcher after the comparison, e.g. pruning's pp=2 x dp=2 gradient-exchange measurement).

``smoke(plan)`` cuts any case's plan to a few steps and one round: the benchmarks' ``--smoke``
form, which checks that the script still runs end to end (its figures mean nothing).
"""
from __future__ import annotations

import importlib

CASES = ("none", "freezing", "early_exit", "pruning", "mod", "moe", "moe_dropless", "sparse_attention")


SMOKE_STEPS = 8


def smoke(plan: dict) -> dict:
    """``plan`` (a case's quick plan) cut to ``SMOKE_STEPS`` steps, measured over the last three,
    one round, micro-batches of 2 samples; the case's event, model and callbacks stay as they
    are (an event past the last step simply does not happen)."""
    return dict(plan, steps=SMOKE_STEPS, window=(SMOKE_STEPS - 3, SMOKE_STEPS), rounds=1,
                batch=2 * plan["microbatches"])


def load(case: str):
    if case not in CASES:
        raise ValueError(f"unknown case {case!r}; valid: {', '.join(CASES)}")
    return importlib.import_module(f"{__name__}.{case}")
