"""Checkpoints are partition-independent: saved by a 2-stage pipeline, resumed on 1 or 4 stages
(or a different schedule), training continues on the same loss curve."""
from __future__ import annotations


import pytest
import torch

from tests.support.multiproc import run_worker

pytestmark = pytest.mark.slow
# 24 samples / batch 8 = 3 steps per epoch: the checkpoint at step 3 closes epoch 0, so a resumed
# run starts epoch 1 with the same sampler permutation as an uninterrupted run.
BASE = {"steps": 6, "batch": 8, "microbatches": 4, "clip": 1.0, "n_samples": 24, "schedule": "1f1b"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt")
    runs = [
        dict(BASE, pp=2, rebalance="every_n", balancer="partition_time"),  # uninterrupted, 6 steps
        dict(BASE, pp=2, steps=3, save_ckpt=True, rebalance="every_n", balancer="partition_time"),
    ]
    results = run_worker(tmp / "pp2", 2, runs)
    return tmp, results


def _continuation(results_full, resumed):
    full = results_full["losses"]
    assert len(resumed["losses"]) == 3, resumed["losses"]
    for a, b in zip(resumed["losses"], full[3:]):
        assert abs(a - b) <= 1e-5 * abs(b), (resumed["losses"], full[3:])


def test_checkpoint_holds_the_full_single_process_state(saved):
    tmp, results = saved
    ckpt = torch.load(results[1]["ckpt"], weights_only=False)
    from tests.support.workers.common import make_model

    ref = make_model(BASE).state_dict()
    assert set(ckpt["state_dict"]) == set(ref)  # every layer, keyed by global index
    opt = ckpt["optimizer_states"][0]
    n_params = sum(len(g["params"]) for g in opt["param_groups"])
    assert sorted(opt["state"]) == list(range(n_params))  # single-process optimizer format
    assert float(opt["state"][0]["step"]) == 3.0


@pytest.mark.parametrize("nproc,pp,schedule", [(1, 1, "1f1b"), (2, 2, "interleaved_1f1b"), (4, 4, "1f1b")])
def test_resume_on_other_pipeline_depths_continues_the_curve(saved, nproc, pp, schedule):
    tmp, results = saved
    run = dict(BASE, pp=pp, schedule=schedule, resume=results[1]["ckpt"])
    resumed = run_worker(tmp / f"resume_pp{pp}_{schedule}", nproc, [run])[0]
    _continuation(results[0], resumed)


def test_checkpoint_loads_into_a_plain_single_process_module(saved):
    tmp, results = saved
    from tests.support.workers.common import make_model

    model = make_model(BASE)
    ckpt = torch.load(results[1]["ckpt"], weights_only=False)
    model.load_state_dict(ckpt["state_dict"])
    opt = model.configure_optimizers()["optimizer"]
    opt.load_state_dict(ckpt["optimizer_states"][0])  # standard torch format
