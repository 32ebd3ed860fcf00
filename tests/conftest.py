"""Suite layout: ``tests/unit`` is pure and fast; ``tests/distributed`` launches real torchrun
jobs and is marked ``slow`` as a whole, so ``pytest -m "not slow"`` is the fast loop.

Hypothesis runs derandomised (the same examples on every run, no deadline), so a CI failure
reproduces locally; ``HYPOTHESIS_PROFILE=explore`` draws fresh random examples instead."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

_DISTRIBUTED = Path(__file__).parent / "distributed"

pytest_plugins = ["tests.support.worlds"]  # fixtures shared by test files (world_of_one)

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("explore", deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _DISTRIBUTED in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.slow)
