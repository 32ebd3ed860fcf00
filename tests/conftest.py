"""Suite layout: ``tests/unit`` is pure and fast; ``tests/distributed`` launches real torchrun
jobs and is marked ``slow`` as a whole, so ``pytest -m "not slow"`` is the fast loop."""
from __future__ import annotations

from pathlib import Path

import pytest

_DISTRIBUTED = Path(__file__).parent / "distributed"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _DISTRIBUTED in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.slow)
