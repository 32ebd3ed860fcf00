"""Plan objects built the way the strategy builds them: from ``PipelineOptions``, the one place
the option defaults live, so tests only name what they change."""
from __future__ import annotations

from lightning_dynmo.plan import RebalancePolicy
from lightning_dynmo.plan.budget import OverheadBudget
from lightning_dynmo.plan.controller import RebalanceController
from lightning_dynmo.strategy.options import PipelineOptions


def make_policy(**options) -> RebalancePolicy:
    """A fresh rebalance policy under these options (the others at their defaults)."""
    return PipelineOptions(**options).policy()


def make_budget(window: int | None = None, **settings) -> OverheadBudget:
    """The budget of ``PipelineOptions(overhead_budget=...)``, with the non-option settings
    (``window``, ``payback_steps``, ``max_backoff``) replaced where given."""
    options = {"overhead_budget": settings.pop("overhead_budget")} if "overhead_budget" in settings else {}
    base = PipelineOptions(**options).budget()
    return OverheadBudget(overhead_budget=base.overhead_budget, window=base.window if window is None else window,
                          **settings)


def make_controller(policy: RebalancePolicy, budget: OverheadBudget | None = None, repack="off") -> RebalanceController:
    """A controller as the rebalancer builds it; the budget defaults to the options' own."""
    return RebalanceController(policy, budget or PipelineOptions().budget(), repack)
