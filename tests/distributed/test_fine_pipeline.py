"""A GPT cut into five pieces per block (``pipeline_granularity="fine"``: cuts inside attention and
MLP, so stage boundaries carry a tuple of the intermediate and the residual stream) trains on the
pipeline exactly as the single-process *block* GPT does: every schedule with a migration before
every step, with a chunked head (targets ride behind the pair), and a checkpoint saved at fine
granularity resumes at block granularity, with losses, weights and Adam state compared with the
block model's references."""
from __future__ import annotations

import pytest

from tests.distributed.test_checkpoint import BASE as CKPT
from tests.distributed.test_equivalence import SCHEDULES, STEPS, base, check_against_reference, migrations
from tests.distributed.test_sublayer_pipeline import _resumed_equals_uninterrupted, block_model
from tests.support.multiproc import run_worker, run_named_pairs

pytestmark = pytest.mark.slow
FINE = {"pipeline_granularity": "fine"}
RUNS = {
    **{f"cycle_{s}": base(schedule=s, rebalance="every_n", balancer="test_cycle", gpt=FINE) for s in SCHEDULES},
    "chunked": base(schedule="1f1b", rebalance="every_n", balancer="test_cycle", gpt={**FINE, "head_chunks": 3}),
    "full_block": dict(CKPT, pp=2),
    "save_fine": dict(CKPT, pp=2, steps=3, save_ckpt=True, gpt=FINE),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_named_pairs(tmp_path_factory.mktemp("fine"), 2, RUNS)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_fine_pipeline_migrating_every_step_equals_single_process_block_gpt(results, schedule):
    cfg, res = results[f"cycle_{schedule}"]
    check_against_reference(res, block_model(cfg))
    assert migrations(res) == STEPS - 1, res["history"]
    # layers: embedding, 6 x 5 pieces (5i+1 .. 5i+5), final norm, head: some stage started inside a
    # block, i.e. received a (intermediate, residual stream) pair
    starts = [int(stage.split("-")[0]) for h in res["history"] if h.get("applied")
              for stage in h["after"].split("|")[1:]]
    assert any((c - 1) % 5 in (1, 2, 4) and 1 <= c <= 30 for c in starts), starts


def test_fine_pipeline_with_a_chunked_head_equals_single_process_block_gpt(results):
    cfg, res = results["chunked"]
    check_against_reference(res, block_model(cfg))
    assert migrations(res) == STEPS - 1, res["history"]


def test_fine_checkpoint_resumes_at_block_granularity(results, tmp_path):
    (res,) = run_worker(tmp_path, 2, [dict(CKPT, pp=2, resume=results["save_fine"][1]["ckpt"])])
    _resumed_equals_uninterrupted(res, results["full_block"][1])
