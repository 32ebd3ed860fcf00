"""Pipeline simulator: torch's own schedule order replayed with per-stage times from the same
cost model and balancers as training, to answer "what would this do on 32 stages?".

``actions`` (torch's per-rank order) -> ``replay`` (timing of that order) -> ``simulate`` (one
step from per-layer costs and a partition). The paper-scale study built on it -- the measured
per-layer profile of the paper's GPT, the six dynamism cases over time as synthetic models,
static vs dynamic balancing, re-packing, the projection grid and its report -- is the
``scenarios`` sub-package (imported on demand, not here; run by ``recipes/paper_scale.py``).
Validated against real runs by ``benchmarks/simulator_validation.py``.
"""
from .actions import Op, schedule_ops
from .simulate import DataParallel, Link, SimResult, matching_cost_model, simulate

__all__ = ["DataParallel", "Link", "Op", "SimResult", "matching_cost_model", "schedule_ops", "simulate"]
