"""A GPT with a vocabulary-chunked head (``head_chunks`` 2-4: tuple activations carrying the
targets and the online-softmax statistics) equals single-process training under every schedule,
with a layer migration before every step; references as in ``test_equivalence.py``."""
from __future__ import annotations

import pytest

from lightning_dynmo import available_schedules
from tests.distributed.test_equivalence import base, check_against_reference, migrations
from tests.support.multiproc import run_worker

pytestmark = pytest.mark.slow
SCHEDULES = available_schedules()
RUNS = {f"chunks_{s}": base(schedule=s, rebalance="every_n", balancer="test_cycle",
                            gpt={"head_chunks": 2 + i % 3})  # 3 chunks of a 64-token vocabulary: 22, 21, 21
        for i, s in enumerate(SCHEDULES)}
RUNS["chunks_checkpointed"] = base(schedule="1f1b", rebalance="every_n", balancer="test_cycle",
                                   gpt={"head_chunks": 3}, activation_checkpointing=True)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    names = list(RUNS)
    out = run_worker(tmp_path_factory.mktemp("chunks"), 2, [RUNS[n] for n in names])
    return {n: (RUNS[n], r) for n, r in zip(names, out)}


@pytest.mark.parametrize("name", list(RUNS))
def test_chunked_head_rebalancing_every_step_matches_single_process(results, name):
    cfg, res = results[name]
    check_against_reference(res, cfg)
    assert migrations(res) == cfg["steps"] - 1, res["history"]
