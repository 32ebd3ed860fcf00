"""Multi-node launch through Lightning's cluster environments: two torchrun agents
(``--nnodes 2``, one process each) on this machine form one 2-stage pipeline across "nodes"."""
from __future__ import annotations

import pytest

from tests.support.multiproc import run_two_agents
from tests.distributed.test_equivalence import base, check_against_reference

pytestmark = pytest.mark.slow


def test_two_torchrun_agents_train_one_pipeline(tmp_path):
    cfg = base(schedule="1f1b", nnodes=2, rebalance="every_n", balancer="test_cycle")
    res = run_two_agents(tmp_path, [cfg])[0]
    check_against_reference(res, cfg)  # includes: clipping by the global norm triggered on every step
    assert sum(1 for r in res["history"] if r.get("applied")) == cfg["steps"] - 1
