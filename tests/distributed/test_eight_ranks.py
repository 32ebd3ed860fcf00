"""Depth in CI (issue 31 item 4): eight real ranks on the CI's two cores, 8 pipeline stages and
4 stages x 2 replicas, each with live migrations and one re-pack, against single-process training.

One torchrun launch of 8 ranks runs both configurations (one thread per rank)."""
from __future__ import annotations

import pytest

from tests.distributed.test_equivalence import base, check_against_reference, migrations
from tests.support.multiproc import run_named

pytestmark = [pytest.mark.slow, pytest.mark.compat]  # compat: also on the lowest torch (CI)
LAYERS = {"n_layer": 8, "mlp_ratios": [1, 4, 2, 8, 1, 3, 2, 4]}  # heterogeneous blocks: 11 pipeline layers
RUNS = {
    # 8 stages: boundaries shift every 2 steps, then 8 -> 4 ranks after step 3
    "pp8": base(pp=8, steps=6, microbatches=8, **LAYERS, rebalance="every_n", rebalance_interval=2,
                balancer="test_shift", request_repack=[3, 4]),
    # 4 stages x 2 replicas: the same on each replica, then 4 -> 2 pipeline ranks per replica
    "pp4_dp2": base(pp=4, steps=6, **LAYERS, rebalance="every_n", rebalance_interval=2, balancer="test_shift",
                    request_repack=[3, 2]),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_named(tmp_path_factory.mktemp("eight"), 8, RUNS, timeout=900)


@pytest.mark.parametrize("name", list(RUNS))
def test_eight_ranks_migrate_repack_and_train_like_one_process(results, name):
    res, cfg = results[name], RUNS[name]
    assert res["dp"] == (1 if name == "pp8" else 2)
    assert migrations(res) >= 2, res["history"]  # boundaries moved live, and the re-pack moved layers
    packs = [h for h in res["history"] if h.get("kind") == "repack"]
    assert len(packs) == 1 and packs[0].get("applied"), res["history"]
    assert sum(res["released_per_rank"]) == 4  # half the ranks were released for real
    check_against_reference(res, cfg)
