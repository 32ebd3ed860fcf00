"""lightning_dynmo: pipeline-parallel Lightning training that rebalances dynamic models live.

``import lightning_dynmo`` registers the Lightning strategy names ``"dynmo"`` and ``"dynmo_spawn"``,
and the Hydra structured config ``dynmo_options`` (made from ``PipelineOptions``).
"""
from .plan.balancers import (
    BalanceProblem,
    BalanceResult,
    BalancerResultError,
    InfeasiblePartitionError,
    available_balancers,
    get_balancer,
    register_balancer,
)
from .callbacks import EarlyExit, GradualPruning, LayerFreezing, MixtureOfDepths, MoELoadMonitor, \
    SparseAttentionMonitor
from .plan.cost_model import CostModel, LayerCosts
from .plan.partition import Partition
from .plan.decision import Decision
from .protocol import PipelineControl, PipelineProtocolError, RemoteLayer, ReportsLoad, run_layers
from .plan.schedules import available_schedules
from .strategy import DynMoStrategy
from .strategy.hydra_config import register_strategy_config
from .runtime.fault import CollectiveMismatchError, RankFailedError
from .strategy.checkpoint import CheckpointError
from .strategy.dcp_checkpoint import consolidate_checkpoint
from .strategy.partial_batch import PartialBatchError
from .strategy.step_guard import OptimizerGroupsChangedError, PipelineBatchMismatchError

register_strategy_config()

__all__ = [
    "BalanceProblem",
    "BalanceResult",
    "BalancerResultError",
    "CheckpointError",
    "CollectiveMismatchError",
    "CostModel",
    "Decision",
    "DynMoStrategy",
    "EarlyExit",
    "GradualPruning",
    "InfeasiblePartitionError",
    "LayerCosts",
    "LayerFreezing",
    "MixtureOfDepths",
    "MoELoadMonitor",
    "OptimizerGroupsChangedError",
    "PartialBatchError",
    "Partition",
    "PipelineBatchMismatchError",
    "PipelineControl",
    "PipelineProtocolError",
    "RankFailedError",
    "RemoteLayer",
    "ReportsLoad",
    "SparseAttentionMonitor",
    "run_layers",
    "available_balancers",
    "available_schedules",
    "consolidate_checkpoint",
    "get_balancer",
    "register_balancer",
]
__version__ = "0.1.0"
