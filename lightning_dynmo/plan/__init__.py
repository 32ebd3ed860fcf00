"""Pure decisions on plain numbers: no torch.distributed, no Lightning.

partition -> cost model -> balancers -> policy/decide -> migration plan / repack plan; the
runtime (:mod:`lightning_dynmo.runtime`) carries the decisions out.
"""
from .balancers import (
    BalanceProblem,
    BalanceResult,
    InfeasiblePartitionError,
    available_balancers,
    get_balancer,
    register_balancer,
)
from .budget import OverheadBudget
from .controller import RebalanceController, StepActions
from .cost_model import CostModel, LayerCosts, imbalance
from .measurements import merge_layer_costs
from .migration_plan import LayerMove, MigrationPlan
from .partition import Partition
from .decision import Decision
from .policy import RebalancePolicy, decide
from .repack import RepackPlan, RepackRefused, plan_repack
from .schedules import ScheduleSpec, available_schedules, get_schedule
from .speed import estimate_speeds, rank_work, slowest_replicas, speeds_from_busy, work_costs
from .straggler import SpeedWatch
from .topology import Topology

__all__ = [
    "BalanceProblem", "BalanceResult", "CostModel", "Decision", "InfeasiblePartitionError", "LayerCosts",
    "LayerMove", "MigrationPlan", "OverheadBudget", "Partition", "RebalanceController", "RebalancePolicy",
    "RepackPlan", "RepackRefused", "ScheduleSpec", "SpeedWatch", "StepActions", "Topology", "available_balancers",
    "available_schedules", "decide", "estimate_speeds", "get_balancer", "get_schedule", "imbalance",
    "merge_layer_costs", "plan_repack", "rank_work", "register_balancer", "slowest_replicas", "speeds_from_busy",
    "work_costs",
]
