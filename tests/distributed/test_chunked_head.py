"""A GPT with a vocabulary-chunked head (``head_chunks`` 2-4: tuple activations carrying the
targets and the online-softmax statistics) equals single-process training under every schedule,
with a layer migration before every step; references as in ``test_equivalence.py``."""
from __future__ import annotations

import os

import pytest
import torch

from lightning_dynmo import available_schedules
from tests.distributed.test_checkpoint import BASE, _continuation
from tests.distributed.test_equivalence import base, check_against_reference, migrations
from tests.support.multiproc import run_worker, run_named_pairs

pytestmark = [pytest.mark.slow, pytest.mark.compat]  # compat: also on the lowest torch (CI)
SCHEDULES = available_schedules()
RUNS = {f"chunks_{s}": base(schedule=s, rebalance="every_n", balancer="test_cycle",
                            gpt={"head_chunks": 2 + i % 3})  # 3 chunks of a 64-token vocabulary: 22, 21, 21
        for i, s in enumerate(SCHEDULES)}
RUNS["chunks_checkpointed"] = base(schedule="1f1b", rebalance="every_n", balancer="test_cycle",
                                   gpt={"head_chunks": 3}, activation_checkpointing=True)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_named_pairs(tmp_path_factory.mktemp("chunks"), 2, RUNS)


@pytest.mark.parametrize("name", list(RUNS))
def test_chunked_head_rebalancing_every_step_matches_single_process(results, name):
    cfg, res = results[name]
    check_against_reference(res, cfg)
    assert migrations(res) == cfg["steps"] - 1, res["history"]


@pytest.fixture(scope="module")
def across_chunk_counts(tmp_path_factory):
    """One job: an uninterrupted 6-step run with one head chunk; 3 steps saved with 1 and with 4
    chunks; each checkpoint resumed with the other chunk count (and the 4-chunk one on a
    4-chunk model too)."""
    out = tmp_path_factory.mktemp("chunk_ckpt")
    one, four = {"gpt": {"head_chunks": 1}}, {"gpt": {"head_chunks": 4}}
    ckpt = [os.path.join(out, f"ckpt{i}", "last.ckpt") for i in range(3)]  # where runs 1 and 2 save
    runs = [dict(BASE, pp=2, **one),
            dict(BASE, pp=2, steps=3, save_ckpt=True, **one),
            dict(BASE, pp=2, steps=3, save_ckpt=True, **four),
            dict(BASE, pp=2, resume=ckpt[1], **four),
            dict(BASE, pp=2, resume=ckpt[2], **one)]
    return run_worker(out, 2, runs)


def test_a_checkpoint_names_the_head_as_one_matrix_whatever_the_chunk_count(across_chunk_counts):
    saved_one, saved_four = (torch.load(r["ckpt"], weights_only=False) for r in across_chunk_counts[1:3])
    assert saved_one["state_dict"].keys() == saved_four["state_dict"].keys()
    assert [g["params"] for g in saved_one["optimizer_states"][0]["param_groups"]] == \
        [g["params"] for g in saved_four["optimizer_states"][0]["param_groups"]]
    head = "layers.8.lm_head.weight"  # 6 blocks: embedding, blocks 1-6, final norm, head
    assert saved_four["state_dict"][head].shape == saved_one["state_dict"][head].shape == (64, 32)
    torch.testing.assert_close(saved_four["state_dict"][head], saved_one["state_dict"][head], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("resumed", [3, 4], ids=["saved_1_resumed_4", "saved_4_resumed_1"])
def test_a_checkpoint_resumes_under_another_chunk_count(across_chunk_counts, resumed):
    _continuation(across_chunk_counts[0], across_chunk_counts[resumed])
