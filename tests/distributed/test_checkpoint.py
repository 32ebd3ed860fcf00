"""Checkpoints are partition-independent: saved by a 2-stage pipeline (or 2 stages x 2 replicas),
resumed on 1, 2 (every other schedule) or 4 stages, or by plain single-process Lightning,
training continues on the same loss curve. Gradients are clipped (and the clip triggers) on
every step, before and after the resume."""
from __future__ import annotations

import os

import lightning as L
import pytest
import torch

from tests.distributed.test_equivalence import CLIP, assert_close, microbatched_reference
from tests.support.multiproc import run_worker
from tests.support.workers.common import LossRecorder, make_loader, make_model

pytestmark = pytest.mark.slow
# 24 samples / batch 8 = 3 steps per epoch: the checkpoint at step 3 closes epoch 0, so a resumed
# run starts epoch 1 with the same sampler permutation as an uninterrupted run (with 2 replicas
# an epoch is one step).
BASE = {"steps": 6, "batch": 8, "microbatches": 4, "clip": CLIP, "n_samples": 24, "schedule": "1f1b",
        "rebalance": "every_n", "balancer": "partition_time"}
RESUME_SCHEDULES = ["interleaved_1f1b", "zbv", "dualpipev", "zero_bubble", "looped_bfs"]


def _clipped(res: dict, steps: int) -> None:
    assert len(res["grad_norms"]) == steps and min(res["grad_norms"]) > CLIP, res["grad_norms"]


def _continuation(full: dict, resumed: dict) -> None:
    assert len(resumed["losses"]) == 3, resumed["losses"]
    for a, b in zip(resumed["losses"], full["losses"][3:]):
        assert abs(a - b) <= 1e-5 * abs(b), (resumed["losses"], full["losses"][3:])
    if "grad_norms" in resumed:
        _clipped(resumed, 3)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt")
    runs = [
        dict(BASE, pp=2),  # uninterrupted, 6 steps
        dict(BASE, pp=2, steps=3, save_ckpt=True),
    ]
    results = run_worker(tmp / "pp2", 2, runs)
    _clipped(results[0], 6)
    return tmp, results


def test_checkpoint_holds_the_single_process_state(saved):
    """The file is exactly what single-process training with the same micro-batches holds after
    3 steps: every layer keyed by its global index, weights and Adam state in torch's format."""
    tmp, results = saved
    ckpt = torch.load(results[1]["ckpt"], weights_only=False)
    ref_state, ref_optim, _ = microbatched_reference(dict(BASE, steps=3), 1)
    assert set(ckpt["state_dict"]) == set(ref_state)
    for k, v in ref_state.items():
        assert_close(ckpt["state_dict"][k], v, f"weight {k}", "weight")
    opt = ckpt["optimizer_states"][0]
    assert [g["params"] for g in opt["param_groups"]] == [g["params"] for g in ref_optim["param_groups"]]
    assert sorted(opt["state"]) == sorted(ref_optim["state"])
    for i, st in ref_optim["state"].items():
        assert float(opt["state"][i]["step"]) == 3.0
        for name in ("exp_avg", "exp_avg_sq"):
            assert_close(opt["state"][i][name], st[name], f"optimizer state {i}.{name}", name)


def test_checkpoint_resumes_in_plain_single_process_lightning(saved, tmp_path):
    """A plain module and optimizer load the file (torch's own formats), and single-process
    Lightning resumed from it continues the pipeline's curve."""
    tmp, results = saved
    ckpt = torch.load(results[1]["ckpt"], weights_only=False)
    model = make_model(BASE)
    model.load_state_dict(ckpt["state_dict"])  # strict: every key, every shape
    for k, v in model.state_dict().items():
        assert torch.equal(v, ckpt["state_dict"][k]), k
    opt = model.configure_optimizers()["optimizer"]
    opt.load_state_dict(ckpt["optimizer_states"][0])
    loaded = opt.state_dict()["state"]
    for i, st in ckpt["optimizer_states"][0]["state"].items():
        assert all(torch.equal(loaded[i][k], v) for k, v in st.items()), i
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rec = LossRecorder()
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                            gradient_clip_val=CLIP, callbacks=[rec], default_root_dir=tmp_path)
        trainer.fit(make_model(dict(BASE, seed=1)), train_dataloaders=make_loader(BASE, 8, reference=True, dp=1),
                    ckpt_path=results[1]["ckpt"])
    finally:
        torch.set_num_threads(threads)
    _continuation(results[0], {"losses": rec.losses})


def test_resume_on_one_stage_continues_the_curve(saved):
    tmp, results = saved
    resumed = run_worker(tmp / "resume_pp1", 1, [dict(BASE, pp=1, resume=results[1]["ckpt"])])[0]
    _continuation(results[0], resumed)


@pytest.fixture(scope="module")
def resumed_two_ranks(saved):
    tmp, results = saved
    runs = [dict(BASE, pp=2, schedule=s, resume=results[1]["ckpt"]) for s in RESUME_SCHEDULES]
    return run_worker(tmp / "resume_pp2", 2, runs)


@pytest.mark.parametrize("schedule", RESUME_SCHEDULES)
def test_resume_onto_another_schedule_continues_the_curve(saved, resumed_two_ranks, schedule):
    _, results = saved
    _continuation(results[0], resumed_two_ranks[RESUME_SCHEDULES.index(schedule)])


@pytest.fixture(scope="module")
def four_ranks(saved):
    """One 4-rank job: 2 stages x 2 replicas uninterrupted and saved at step 3, that checkpoint
    resumed on 2 x 2, and the 2-stage checkpoint resumed on 4 stages."""
    tmp, results = saved
    out = tmp / "four"
    dp2_ckpt = os.path.join(out, "ckpt1", "last.ckpt")  # where run 1 of this job saves
    runs = [
        dict(BASE, pp=2),
        dict(BASE, pp=2, steps=3, save_ckpt=True),
        dict(BASE, pp=2, resume=dp2_ckpt),
        dict(BASE, pp=4, resume=results[1]["ckpt"]),
    ]
    return run_worker(out, 4, runs)


def test_save_and_resume_with_two_replicas_continues_the_curve(four_ranks):
    full, saved_dp2, resumed = four_ranks[:3]
    assert full["dp"] == saved_dp2["dp"] == resumed["dp"] == 2
    _clipped(full, 6)
    assert full["losses"][:3] == pytest.approx(saved_dp2["losses"], rel=1e-6)
    _continuation(full, resumed)


def test_resume_on_four_stages_continues_the_curve(saved, four_ranks):
    _, results = saved
    assert four_ranks[3]["partition"].count("|") == 3
    _continuation(results[0], four_ranks[3])
