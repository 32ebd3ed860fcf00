"""Multi-node launch through Lightning's cluster environments: two torchrun agents
(``--nnodes 2``, one process each) on 127.0.0.1 form one 2-stage pipeline across "nodes"."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.multiproc import ROOT, WORKER, free_port, worker_env
from tests.distributed.test_equivalence import base, check_against_reference

pytestmark = pytest.mark.slow


def test_two_torchrun_agents_train_one_pipeline(tmp_path):
    cfg = base(schedule="1f1b", nnodes=2, rebalance="every_n", balancer="test_cycle")
    spec = tmp_path / "spec.json"
    out = tmp_path / "result.json"
    spec.write_text(json.dumps({"out": str(out), "runs": [cfg]}))
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
             "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port), str(WORKER), str(spec)],
            cwd=ROOT, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for node in (0, 1)
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-4000:] for log in logs)
    res = json.loads(out.read_text())["runs"][0]
    check_against_reference(res, cfg)
    assert sum(1 for r in res["history"] if r.get("applied")) == cfg["steps"] - 1
