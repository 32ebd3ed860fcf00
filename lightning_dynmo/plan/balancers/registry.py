"""Name -> balancer registry, open to user balancers (``@register_balancer("mine")``)."""
from __future__ import annotations

from typing import Callable

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


def get_balancer(name: str) -> Balancer:
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown balancer {name!r}; valid: {', '.join(available_balancers())}"
        ) from None


def available_balancers() -> list[str]:
    return sorted(_REGISTRY)
