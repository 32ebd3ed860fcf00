"""A tied parameter (GPT-2's embedding / LM head, held by the first and the last stage) under
pp=2 x dp=2 (4 gloo ranks): its gradient crosses the data-parallel group once, from one owner,
not once per owner, and training still equals single-process training on the global batch."""
from __future__ import annotations

import pytest
import torch

from tests.support.multiproc import ROOT, run_worker

pytestmark = pytest.mark.slow
WORKER = ROOT / "tests" / "support" / "workers" / "sparse_worker.py"  # counts the data-parallel bytes
BASE = dict(steps=4, batch=8, n_layer=4, tied=True, pruning=None)
MIGRATE = {"balancer": "test_shift", "rebalance": "every_n", "rebalance_interval": 1}
TIED_BYTES = 64 * 32 * 4  # the tied [vocab, n_embd] float32 gradient of make_model's GPT


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tied_exchange")
    (pipe,) = run_worker(tmp / "pipe", 4, [dict(BASE, pp=2, **MIGRATE)], worker=WORKER, timeout=300)
    (ref,) = run_worker(tmp / "ref", None, [dict(BASE, ref_dp=2)], worker=WORKER, timeout=300)
    return pipe, ref


def test_tied_gradient_crosses_the_data_parallel_group_once(results):
    """Bytes into the data-parallel all-reduce, summed over replica 0's two stages: every
    gradient once (the tied one is held, with its gradient, by both stages, so the stages'
    gradient bytes count it twice) plus the presence mask (one float32 per parameter). Each
    owner all-reducing its copy sends ``TIED_BYTES`` more per step."""
    pipe, _ = results
    assert pipe["dp"] == 2 and len(pipe["sent"]) == BASE["steps"]
    assert sum(h["applied"] for h in pipe["history"]) >= 2  # layers moved between the steps
    extra = [s - (g - TIED_BYTES) for s, g in zip(pipe["sent"], pipe["grads"])]
    assert all(0 <= e <= 4 * 64 and e % 4 == 0 for e in extra), (pipe["sent"], pipe["grads"], extra)


def test_exchanging_the_tied_gradient_once_trains_like_one_process(results):
    pipe, ref = results
    assert len(pipe["losses"]) == len(ref["losses"]) == BASE["steps"]
    torch.testing.assert_close(torch.tensor(pipe["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
