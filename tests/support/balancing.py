"""Checks on a balancer's answer shared by the balancer tests."""
from __future__ import annotations


def fits(problem, part) -> bool:
    """Every stage of ``part`` within the problem's memory capacity (always, without one)."""
    cap = problem.model.capacity
    return cap is None or max(problem.model.stage_memory(problem.costs, part)) <= cap
