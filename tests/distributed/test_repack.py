"""Elastic re-packing: 4 pipeline ranks -> 2 (or 2 x 2 replicas -> 1 x 2, or 8 virtual stages ->
4), with Adam state carried, the other ranks released, training continuing with the same math;
``repack="auto"`` and ``request_repack("auto")`` weigh the predicted step time against
``repack_tolerance``; micro-batches are re-tuned after packing when not pinned; refusals leave
training intact; a checkpoint taken after packing resumes on a job with fewer devices."""
from __future__ import annotations

import csv
from pathlib import Path

import pytest

from tests.support.workers.common import make_model
from tests.support.multiproc import run_worker, run_named_pairs
from tests.distributed.test_equivalence import base, check_against_reference, lightning_reference_losses, \
    total_static_bytes

pytestmark = pytest.mark.slow
# 8 equal blocks: on 4 ranks each holds 2; packing onto 3, 2 or 1 ranks predicts a step about
# 1.3x, 1.4x or 2.3x as long (1F1B, 4 micro-batches: (m + p - 1) x the heaviest stage)
EQUAL = {"n_layer": 8, "mlp_ratios": [4] * 8}

RUNS = {
    "pack_4_to_2": base(pp=4, steps=8, rebalance="every_n", rebalance_interval=3, balancer="partition_time", repack=2),
    # a runtime request (the option repack=4 on 4 ranks is refused at construction: test_options.py)
    "not_below": base(pp=4, steps=6, rebalance="every_n", rebalance_interval=3, balancer="partition_param",
                      request_repack=[2, 4]),
    "memory": base(pp=4, steps=6, rebalance="every_n", rebalance_interval=3, balancer="partition_param", repack=2,
                   memory_capacity=0.45 * total_static_bytes({})),
    "save": base(pp=4, steps=6, n_samples=48, rebalance="every_n", rebalance_interval=3, balancer="partition_param",
                 repack=2, save_ckpt=True),
    "request_never": base(pp=4, steps=6, balancer="partition_param", request_repack=[2, 2], logger=True),
    "repack_to": base(pp=4, steps=5, balancer="partition_param", repack_to=[2, 2]),  # the public call
    "replicas": base(pp=2, steps=5, balancer="partition_param", request_repack=[2, 1]),  # 2 x 2 -> 1 x 2
    "virtual": base(pp=4, steps=5, schedule="interleaved_1f1b", balancer="partition_param", request_repack=[2, 2]),
    "retune": base(pp=4, steps=5, batch=16, microbatches=None, balancer="partition_param", request_repack=[2, 2]),
    "auto_tolerance_0": base(pp=4, steps=4, **EQUAL, rebalance="every_n", rebalance_interval=2,
                             balancer="partition_time", repack="auto", repack_tolerance=0.0),
    "request_auto_tolerance_09": base(pp=4, steps=5, **EQUAL, balancer="partition_time", request_repack=[2, "auto"],
                                      repack_tolerance=0.9),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("repack")
    return tmp, run_named_pairs(tmp / "four", 4, RUNS)


def packs(res: dict) -> list[dict]:
    return [h for h in res["history"] if h.get("kind") == "repack"]


def assert_released(res: dict, released: list[int]) -> None:
    """Released ranks hold no parameters, gradients or optimizer state, do no training compute
    (autograd saved nothing on them in the last step), and every rank heard the hook."""
    world = len(res["released_per_rank"])
    assert [r for r in range(world) if res["released_per_rank"][r]] == released
    for r in released:
        assert res["params_per_rank"][r] == 0 and res["grads_per_rank"][r] == 0, r
        assert res["optim_tensors_per_rank"][r] == 0, r
        assert res["saved_tensors_per_rank"][r][-1] == 0, r
    for r in range(world):
        if r not in released:
            assert res["grads_per_rank"][r] > 0 and res["optim_tensors_per_rank"][r] > 0, r
    assert res["released_hook_per_rank"] == [released] * world  # the hook fired on every rank
    assert res["strategy_released_ranks_per_rank"] == [released] * world  # strategy.pipeline.released_ranks agrees


def test_repack_to_returns_the_released_ranks(runs):
    _, r = runs
    cfg, res = r["repack_to"]
    assert res["repack_to_returned_per_rank"] == [[2, 3]] * 4  # every rank hears which ranks went
    assert_released(res, [2, 3])
    check_against_reference(res, cfg)


def test_pack_4_to_2_matches_single_process_and_releases_ranks(runs):
    _, r = runs
    cfg, res = r["pack_4_to_2"]
    check_against_reference(res, cfg)  # losses, weights and Adam state as single-process training
    p = packs(res)
    assert p and p[0]["applied"] and p[0]["ranks_after"] == 2, res["history"]
    assert p[0]["step"] < cfg["steps"] - 2  # the pipeline kept running on 2 ranks
    assert_released(res, [2, 3])
    assert sum(res["params_per_rank"]) == sum(q.numel() for q in make_model(cfg).parameters())
    assert res["partition"].count("|") == 1


def test_released_ranks_report_an_empty_last_step_timeline(runs):
    _, r = runs
    _, res = r["pack_4_to_2"]
    assert res["released_per_rank"] == [False, False, True, True]
    for rank in (2, 3):
        assert res["chunk_seconds_per_rank"][rank] == {"F": 0, "B": 0, "W": 0}, res["chunk_seconds_per_rank"]


def test_target_not_below_current_is_refused_and_training_continues(runs):
    _, r = runs
    cfg, res = r["not_below"]
    refusals = packs(res)
    assert refusals and not any(h["applied"] for h in refusals)
    assert "not below the current 4" in refusals[0]["why"]
    assert res["released_per_rank"] == [False] * 4
    check_against_reference(res, cfg)


def test_memory_that_does_not_fit_is_refused(runs):
    _, r = runs
    cfg, res = r["memory"]
    refusals = packs(res)
    assert refusals and not refusals[0]["applied"]
    assert "capacity" in refusals[0]["why"], refusals[0]["why"]
    assert res["partition"].count("|") == 3
    check_against_reference(res, cfg)


def test_checkpoint_after_packing_resumes_on_two_devices(runs):
    tmp, r = runs
    _, saved = r["save"]
    assert saved["released_per_rank"] == [False, False, True, True]
    resumed = run_worker(tmp / "resume", 2, [base(pp=2, steps=9, n_samples=48, resume=saved["ckpt"])])[0]
    ref = lightning_reference_losses(base(steps=9, n_samples=48), 1)
    assert len(resumed["losses"]) == 3
    for a, b in zip(resumed["losses"], ref[6:]):
        assert abs(a - b) <= 1e-5 * abs(b), (resumed["losses"], ref[6:])


def test_request_repack_packs_under_rebalance_never(runs):
    _, r = runs
    cfg, res = r["request_never"]
    assert [h["kind"] for h in res["history"]] == ["repack"], res["history"]  # no rebalance ran
    pack = res["history"][0]
    assert pack["applied"] and pack["ranks_after"] == 2 and pack["step"] == 3, pack
    assert_released(res, [2, 3])
    check_against_reference(res, cfg)
    with open(Path(res["log_dir"]) / "metrics.csv") as fh:
        ranks = [float(row["pipeline/ranks"]) for row in csv.DictReader(fh) if row.get("pipeline/ranks")]
    assert ranks and set(ranks) == {2.0}  # reported through the logger from the packing step on


def test_pack_with_two_replicas(runs):
    _, r = runs
    cfg, res = r["replicas"]
    assert res["dp"] == 2
    pack = packs(res)[0]
    assert pack["applied"] and pack["ranks_after"] == 1 and pack["released"] == [1, 3], pack
    assert_released(res, [1, 3])  # pipeline rank 1 of each replica
    assert res["partition"] == "0-8"
    check_against_reference(res, cfg)


def test_pack_with_virtual_stages(runs):
    _, r = runs
    cfg, res = r["virtual"]
    pack = packs(res)[0]
    assert pack["applied"] and pack["ranks_after"] == 2, pack
    assert pack["before"].count("|") == 7 and res["partition"].count("|") == 3  # 8 -> 4 virtual stages
    assert_released(res, [2, 3])
    check_against_reference(res, cfg)


def test_microbatches_are_retuned_after_packing(runs):
    _, r = runs
    cfg, res = r["retune"]
    # microbatches=None: the largest divisor of the batch (16) that is <= 4 x stages
    assert res["microbatches_per_step"] == [16, 16, 16, 8, 8], res["microbatches_per_step"]
    assert packs(res)[0]["microbatches"] == 8
    assert_released(res, [2, 3])
    check_against_reference(res, cfg)  # the reference uses the same micro-batches per step


def test_repack_auto_refuses_when_every_packing_is_slower_than_the_tolerance(runs):
    _, r = runs
    cfg, res = r["auto_tolerance_0"]
    refusals = packs(res)
    assert refusals and not any(h["applied"] for h in refusals), res["history"]
    for ranks in (1, 2, 3):  # every candidate was weighed and found slower than 1.00 x now
        assert f"{ranks} ranks: predicted step" in refusals[0]["why"] and "> 1.00 x" in refusals[0]["why"]
    assert res["released_per_rank"] == [False] * 4
    check_against_reference(res, cfg)


def test_request_repack_auto_packs_within_the_tolerance(runs):
    _, r = runs
    cfg, res = r["request_auto_tolerance_09"]
    pack = packs(res)[0]
    # typically 1 rank predicts ~2.3x the current step (> 1.9x: refused) and 2 ranks ~1.4x; the
    # prediction comes from measured times, so on a loaded machine 1 rank may fit the tolerance
    assert pack["applied"] and pack["ranks_after"] in (1, 2), res["history"]
    assert_released(res, list(range(pack["ranks_after"], 4)))
    check_against_reference(res, cfg)
