"""Elastic re-packing: 4 pipeline ranks -> 2, with Adam state carried, the other ranks released,
training continuing with the same math; refusals leave training intact; a checkpoint taken after
packing resumes on a job with fewer devices."""
from __future__ import annotations


import pytest

from tests.support.workers.common import make_model
from tests.support.multiproc import run_worker
from tests.distributed.test_equivalence import base, check_against_reference, lightning_reference_losses

pytestmark = pytest.mark.slow


def _total_static_bytes() -> float:
    n = sum(p.numel() for p in make_model({"steps": 1}).parameters())
    return 16.0 * n  # weight + grad + two Adam moments, fp32


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("repack")
    configs = [
        base(pp=4, steps=8, rebalance="every_n", rebalance_interval=3, balancer="partition_time", repack=2),
        base(pp=4, steps=6, rebalance="every_n", rebalance_interval=3, balancer="partition_param", repack=4),
        base(pp=4, steps=6, rebalance="every_n", rebalance_interval=3, balancer="partition_param", repack=2,
             memory_capacity=0.45 * _total_static_bytes()),
        base(pp=4, steps=6, n_samples=48, rebalance="every_n", rebalance_interval=3, balancer="partition_param",
             repack=2, save_ckpt=True),
        base(pp=4, steps=6, balancer="partition_param", request_repack=[2, 2]),  # rebalance="never"
    ]
    return tmp, configs, run_worker(tmp / "four", 4, configs)


def test_pack_4_to_2_matches_single_process_and_releases_ranks(runs):
    _, configs, results = runs
    res, cfg = results[0], configs[0]
    check_against_reference(res, cfg)  # losses, weights and Adam state as single-process training
    packs = [h for h in res["history"] if h.get("kind") == "repack"]
    assert packs and packs[0]["applied"] and packs[0]["ranks_after"] == 2, res["history"]
    assert packs[0]["step"] < cfg["steps"] - 2  # the pipeline kept running on 2 ranks
    assert res["released_per_rank"] == [False, False, True, True]
    assert res["params_per_rank"][2:] == [0, 0]  # released ranks hold no parameters
    assert sum(res["params_per_rank"]) == sum(p.numel() for p in make_model(cfg).parameters())
    assert res["released_hook"] == [2, 3]
    assert res["partition"].count("|") == 1


def test_target_not_below_current_is_refused_and_training_continues(runs):
    _, configs, results = runs
    res = results[1]
    refusals = [h for h in res["history"] if h.get("kind") == "repack"]
    assert refusals and not any(h["applied"] for h in refusals)
    assert "not below the current 4" in refusals[0]["why"]
    assert res["released_per_rank"] == [False] * 4
    check_against_reference(res, configs[1])


def test_memory_that_does_not_fit_is_refused(runs):
    _, configs, results = runs
    res = results[2]
    refusals = [h for h in res["history"] if h.get("kind") == "repack"]
    assert refusals and not refusals[0]["applied"]
    assert "capacity" in refusals[0]["why"] or "memory" in refusals[0]["why"], refusals[0]["why"]
    assert res["partition"].count("|") == 3
    check_against_reference(res, configs[2])


def test_checkpoint_after_packing_resumes_on_two_devices(runs):
    tmp, configs, results = runs
    saved = results[3]
    assert saved["released_per_rank"] == [False, False, True, True]
    resumed = run_worker(tmp / "resume", 2, [base(pp=2, steps=9, n_samples=48, resume=saved["ckpt"])])[0]
    ref = lightning_reference_losses(base(steps=9, n_samples=48), 1)
    assert len(resumed["losses"]) == 3
    for a, b in zip(resumed["losses"], ref[6:]):
        assert abs(a - b) <= 1e-5 * abs(b), (resumed["losses"], ref[6:])


def test_request_repack_packs_under_rebalance_never(runs):
    _, configs, results = runs
    res = results[4]
    assert [h["kind"] for h in res["history"]] == ["repack"], res["history"]  # no rebalance ran
    pack = res["history"][0]
    assert pack["applied"] and pack["ranks_after"] == 2 and pack["step"] == 3, pack
    assert res["released_per_rank"] == [False, False, True, True]
    check_against_reference(res, configs[4])
