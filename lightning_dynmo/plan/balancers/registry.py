"""Name -> balancer registry, open to user balancers (``@register_balancer("mine")``).

:func:`get_balancer` hands out the balancer wrapped in a check of its result, so a user balancer
that returns the wrong thing fails where it is called, naming itself, at setup and at every
decision, instead of deep inside placement or the schedule.
"""
from __future__ import annotations

import functools
from typing import Callable

from ..partition import Partition
from .base import BalanceProblem, BalanceResult

Balancer = Callable[[BalanceProblem], BalanceResult]
_REGISTRY: dict[str, Balancer] = {}


def register_balancer(name: str, *, override: bool = False) -> Callable[[Balancer], Balancer]:
    """Decorator registering ``fn`` under ``name``; re-registering needs ``override=True``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"balancer name must be a non-empty string, got {name!r}")

    def deco(fn: Balancer) -> Balancer:
        if not callable(fn):
            raise TypeError(f"balancer {name!r} must be callable, got {fn!r}")
        if name in _REGISTRY and not override:
            raise ValueError(f"balancer {name!r} is already registered (pass override=True to replace it)")
        _REGISTRY[name] = fn
        return fn

    return deco


def unregister_balancer(name: str) -> None:
    """Remove a (user) balancer; unknown names are an error."""
    get_balancer(name)
    del _REGISTRY[name]


class BalancerResultError(ValueError):
    """A balancer returned something that is not a valid result for its problem."""


def check_result(name: str, problem: BalanceProblem, result: object) -> BalanceResult:
    """``result`` if it is a :class:`BalanceResult` whose partition splits the problem's layers
    into its stages; otherwise a :class:`BalancerResultError` naming the balancer and the fix."""
    if not isinstance(result, BalanceResult):
        fix = ("wrap it: BalanceResult(partition=p, rounds=1, predicted_step_time="
               "problem.model.predicted_step_time(problem.costs, p), max_load=..., name=...)"
               if isinstance(result, Partition) else "return a BalanceResult")
        raise BalancerResultError(f"balancer {name!r} returned {type(result).__name__}, not a BalanceResult; {fix}")
    part = result.partition
    if not isinstance(part, Partition):
        raise BalancerResultError(f"balancer {name!r} returned BalanceResult.partition of type "
                                  f"{type(part).__name__}; it must be a Partition")
    if (part.num_layers, part.num_stages) != (problem.num_layers, problem.num_stages):
        raise BalancerResultError(
            f"balancer {name!r} returned partition {part.boundaries} ({part.num_layers} layers in "
            f"{part.num_stages} stages) for a problem of {problem.num_layers} layers in {problem.num_stages} "
            "stages; a balancer must split exactly problem.num_layers layers into problem.num_stages stages"
        )
    return result


def get_balancer(name: str) -> Balancer:
    """The balancer registered as ``name``, its result checked by :func:`check_result`."""
    try:
        fn = _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown balancer {name!r}; valid: {', '.join(available_balancers())}"
        ) from None

    @functools.wraps(fn)
    def checked(problem: BalanceProblem) -> BalanceResult:
        return check_result(name, problem, fn(problem))

    return checked


def available_balancers() -> list[str]:
    return sorted(_REGISTRY)
