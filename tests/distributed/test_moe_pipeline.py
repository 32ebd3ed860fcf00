"""An MoE GPT (aux + z loss, capacity dropping) trained on a 2-rank 1F1B pipeline with a layer
migration before every step equals single-process Lightning training: the auxiliary losses reach
the routers in backward on whichever rank holds each layer, and per-sequence statistics make
micro-batching exact."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.multiproc import ROOT, run_worker

WORKER = ROOT / "tests" / "support" / "workers" / "moe_worker.py"
STEPS = 5
MOE = dict(num_experts=4, top_k=2, capacity_factor=1.0, drop_policy="probs", aux_loss_coeff=0.1,
           z_loss_coeff=0.01, shared_expert=True)
RUN = dict(steps=STEPS, batch=8, n_layer=4, moe=MOE, clip=1.0)
PIPELINE = dict(pp=2, schedule="1f1b", microbatches=4, balancer="test_shift", rebalance="every_n",
                rebalance_interval=1)
RTOL = 1e-5


def _launch(tmp: Path, runs: list[dict], nproc: int | None) -> list[dict]:
    return run_worker(tmp, nproc, runs, timeout=300, worker=WORKER)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe")
    (pipe,) = _launch(tmp / "pp2", [dict(RUN, **PIPELINE)], nproc=2)
    no_aux = dict(RUN, moe=dict(MOE, aux_loss_coeff=0.0, z_loss_coeff=0.0))
    ref, ref_no_aux = _launch(tmp / "ref", [RUN, no_aux], nproc=None)
    return pipe, ref, ref_no_aux


def test_moe_pp2_rebalancing_every_step_matches_single_process(results):
    pipe, ref, ref_no_aux = results
    assert len(pipe["history"]) >= STEPS - 1 and all(h["applied"] for h in pipe["history"])
    torch.testing.assert_close(torch.tensor(pipe["losses"]), torch.tensor(ref["losses"]), rtol=RTOL, atol=0)
    # the comparison can see the auxiliary gradients: without them training takes another path
    drift = max(abs(a - b) / abs(b) for a, b in zip(ref_no_aux["losses"], ref["losses"]))
    assert drift > 10 * RTOL, drift
    # weights after 5 Adam steps: Adam amplifies fp32 rounding in near-zero gradients, so they get
    # the tolerance of the other dynamism tests; the aux terms move routers ~200x further
    sp, sr = torch.load(pipe["state"]), torch.load(ref["state"])
    assert sp.keys() == sr.keys()
    for k in sr:
        torch.testing.assert_close(sp[k], sr[k], rtol=1e-4, atol=1e-4, msg=k)


def test_moe_load_signal_is_the_same_under_the_pipeline(results):
    pipe, ref, _ = results
    assert set(pipe["load"]) == set(ref["load"]) == {str(i) for i in range(1, 5)}  # every block, on any rank
    for layer, stats in ref["load"].items():
        assert stats["dropped"] > 0  # capacity drops tokens
        for name, value in stats.items():
            assert pipe["load"][layer][name] == pytest.approx(value, rel=1e-6), (layer, name)
