"""Data-parallel replicas agree on the pruned layers' kernel (dense, 2:4 or CSR) with one
collective, even when their local measurements disagree: 2 gloo ranks whose crossover
"measurements" are forced apart per rank (LDSPARSE_CROSSOVER), under DynMoStrategy (dp=2) and
Lightning's DDP; every rank ends with rank 0's choice and the layers compute with it."""
from __future__ import annotations

import pytest

from lightning_dynmo.sparse import extension_available
from tests.support.multiproc import ROOT, run_worker

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not extension_available(), reason="the CSR kernel is one of the choices")]
WORKER = ROOT / "tests" / "support" / "workers" / "nm_worker.py"
PRUNE = {"pattern": "2:4", "final_sparsity": 0.5, "start_step": 1, "n_steps": 1, "frequency": 1,
         "sparse_kernels": "auto", "kernel_tokens": 64}
BASE = dict(steps=3, batch=4, n_layer=2, pruning=PRUNE)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_worker(tmp_path_factory.mktemp("agree"), 2, [
        dict(BASE, pp=1, crossover=[1.0, 0.0]),  # rank 0 measures CSR faster, rank 1 dense
        dict(BASE, pp=1, crossover=[0.0, 1.0]),  # and the other way round
        dict(BASE, ddp=True, crossover=[1.0, 0.0]),
    ], worker=WORKER, timeout=240)


@pytest.mark.parametrize("run, expected", [(0, "csr"), (1, "dense"), (2, "csr")])
def test_replicas_adopt_rank_zeros_kernel(runs, run, expected):
    r0, r1 = runs[run]["ranks"]
    assert r0["sparsity"] == r1["sparsity"] == 0.5
    names = sorted(r0["local"])
    assert len(names) == 8 and sorted(r1["local"]) == names
    other = "dense" if expected == "csr" else "csr"
    assert set(r0["local"].values()) == {expected} and set(r1["local"].values()) == {other}  # they disagreed
    assert r0["agreed"] == r1["agreed"] == {n: expected for n in names}  # and adopted rank 0's choice
    for r in (r0, r1):  # the layers compute with the agreed kernel
        assert r["csr_flags"] == {n: expected == "csr" for n in names}
    assert r0["weights"] == r1["weights"]  # replicas step alike
