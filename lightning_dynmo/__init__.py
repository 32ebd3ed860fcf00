"""lightning_dynmo: pipeline-parallel Lightning training that rebalances dynamic models live.

``import lightning_dynmo`` registers the Lightning strategy name ``"dynmo"``.
"""
from .balancers import available_balancers, get_balancer, register_balancer
from .partition import Partition
from .protocol import PipelineProtocolError, RemoteLayer
from .schedules import available_schedules
from .strategy import DynMoStrategy

__all__ = [
    "DynMoStrategy",
    "Partition",
    "PipelineProtocolError",
    "RemoteLayer",
    "available_balancers",
    "available_schedules",
    "get_balancer",
    "register_balancer",
]
__version__ = "0.1.0"
