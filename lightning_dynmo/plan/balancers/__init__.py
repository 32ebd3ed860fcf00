"""Balancers: pure functions ``BalanceProblem -> BalanceResult`` looked up by name.

Built in: ``uniform``, ``param`` (static baselines), ``partition_time`` / ``partition_param``
(exact min-max), ``diffusion_time`` / ``diffusion_param`` (neighbour diffusion). Register your
own with ``@register_balancer("name")``.
"""
from .base import BalanceProblem, BalanceResult, InfeasiblePartitionError, Objective, objective
from .registry import BalancerResultError, available_balancers, get_balancer, register_balancer, unregister_balancer
from . import static, exact, diffusion  # noqa: E402,F401  (register the built-ins)
from .static import megatron_layout, param, uniform
from .exact import partition_param, partition_time
from .diffusion import diffuse, diffusion_param, diffusion_time


__all__ = [
    "BalanceProblem",
    "BalanceResult",
    "BalancerResultError",
    "InfeasiblePartitionError",
    "Objective",
    "available_balancers",
    "diffuse",
    "diffusion_param",
    "diffusion_time",
    "get_balancer",
    "megatron_layout",
    "objective",
    "param",
    "partition_param",
    "partition_time",
    "register_balancer",
    "uniform",
    "unregister_balancer",
]
