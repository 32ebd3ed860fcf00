"""``DynMoStrategy(compile=True)``: each local pipeline layer compiled in place (CPU inductor),
losses equal to the eager run, state-dict keys unchanged, and after a migration only the layer
that arrived is compiled again (the others keep their compiled entry point). Slow: inductor
compiles each layer's forward and backward on every rank."""
from __future__ import annotations

import pytest

from tests.support.multiproc import run_worker
from tests.support.multiproc import ROOT

pytestmark = pytest.mark.slow
WORKER = ROOT / "tests" / "support" / "workers" / "compile_worker.py"
BASE = dict(n_layer=2, n_embd=16, block=8, batch=4, steps=3, partition=[0, 2, 5], move_after=1, move_to=[0, 3, 5])


def test_compiled_pipeline_matches_eager_and_recompiles_only_arrivals(tmp_path):
    runs = [dict(BASE, compile=False), dict(BASE, compile=True), dict(BASE, compile=True, checkpointing=True)]
    eager, compiled, checkpointed = run_worker(tmp_path, 2, runs, timeout=1500, worker=WORKER)
    for run in (compiled, checkpointed):
        assert len(run["losses"]) == len(eager["losses"]) == BASE["steps"]
        for a, b in zip(eager["losses"], run["losses"]):
            assert abs(a - b) <= 1e-4, (eager["losses"], run["losses"])
        assert run["state_keys"] == eager["state_keys"]  # compiled in place: no _orig_mod prefix
        before, after = run["compiled"][0], run["compiled"][-1]  # {rank: {layer: id}} after step 0 / last
        assert all(v is not None for rank in after for v in rank.values())  # every local layer compiled
        assert sorted(map(int, after[0])) == [0, 1, 2] and sorted(map(int, after[1])) == [3, 4]
        # layers that stayed keep their compiled entry point; layer 2 (rank 1 -> 0) was compiled on arrival
        for rank in (0, 1):
            for layer, ident in before[rank].items():
                if layer in after[rank]:
                    assert after[rank][layer] == ident, (rank, layer)
        assert "2" in before[1] and "2" not in before[0]
    assert eager["compiled"][-1][0] == {"0": None, "1": None, "2": None}
