"""A GPT cut into attention and MLP halves (``pipeline_granularity="sublayer"``) trains on the
pipeline exactly as the single-process *block* GPT does: every schedule with a migration before
every step (halves move one at a time, so stage boundaries fall inside blocks), hash-sparse
attention, re-packing onto fewer ranks, MoE halves under expert parallelism, and checkpoints that
cross granularities both ways (saved by a 2-stage block run, resumed at sublayer granularity, and
the reverse), with losses, weights and Adam state compared with the block model's references."""
from __future__ import annotations

import pytest
import torch

from tests.distributed.test_checkpoint import BASE as CKPT
from tests.distributed.test_equivalence import SCHEDULES, STEPS, assert_close, base, check_against_reference, \
    lightning_reference_losses, microbatched_reference, migrations
from tests.support.multiproc import run_worker, run_named_pairs

pytestmark = pytest.mark.slow
SUB = {"pipeline_granularity": "sublayer"}
RUNS = {
    **{f"cycle_{s}": base(schedule=s, rebalance="every_n", balancer="test_cycle", gpt=SUB) for s in SCHEDULES},
    "hash_sparse": base(schedule="1f1b", rebalance="every_n", balancer="partition_time",
                        gpt={**SUB, "attention": "hash_sparse", "attention_block": 16, "nb_hash": 2}, block=64),
    # halves repacked from 2 stages onto 1 (the other rank released)
    "repack": base(steps=5, balancer="partition_param", request_repack=[2, 1], gpt=SUB),
    "full_block": dict(CKPT, pp=2),  # 6 steps uninterrupted, what the resumed runs continue
    "save_block": dict(CKPT, pp=2, steps=3, save_ckpt=True),
    "save_sublayer": dict(CKPT, pp=2, steps=3, save_ckpt=True, gpt=SUB),
}


def block_model(cfg: dict) -> dict:
    """The same run's configuration at block granularity (what the references train)."""
    gpt = {k: v for k, v in cfg.get("gpt", {}).items() if k != "pipeline_granularity"}
    return {**cfg, "gpt": gpt}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_named_pairs(tmp_path_factory.mktemp("sublayer"), 2, RUNS)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_sublayer_pipeline_migrating_every_step_equals_single_process_block_gpt(results, schedule):
    cfg, res = results[f"cycle_{schedule}"]
    check_against_reference(res, block_model(cfg))
    assert migrations(res) == STEPS - 1, res["history"]
    # layers: embedding, 6 x (attention half at 2i+1, MLP half at 2i+2), final norm, head; a
    # stage starting at an MLP half cuts its block in two, and some partition did
    starts = [int(stage.split("-")[0]) for h in res["history"] if h.get("applied")
              for stage in h["after"].split("|")[1:]]
    assert any(c % 2 == 0 and 2 <= c <= 12 for c in starts), starts


def test_hash_sparse_sublayer_pipeline_equals_single_process_block_gpt(results):
    cfg, res = results["hash_sparse"]
    check_against_reference(res, block_model(cfg))
    assert res["history"], "the load-scaled balancer ran"


def test_sublayer_pipeline_repacked_onto_one_stage_equals_single_process_block_gpt(results):
    cfg, res = results["repack"]
    check_against_reference(res, block_model(cfg))
    pack = [h for h in res["history"] if h.get("kind") == "repack"]
    assert pack and pack[0]["applied"] and pack[0]["ranks_after"] == 1, res["history"]
    assert res["released_per_rank"] == [False, True] and res["params_per_rank"][1] == 0


def _resumed_equals_uninterrupted(res: dict, full: dict) -> None:
    """3 more steps after the step-3 checkpoint continue the uninterrupted block run of 6 steps:
    losses (as single-process Lightning's), weights and Adam state (as the pipeline's)."""
    ref_losses = lightning_reference_losses(dict(CKPT, steps=6), 1)
    assert len(res["losses"]) == 3
    for a, b in zip(res["losses"], ref_losses[3:]):
        assert abs(a - b) <= 1e-5 * abs(b), (res["losses"], ref_losses[3:])
    ref_state, ref_optim = torch.load(full["state"]), torch.load(full["optim"], weights_only=False)
    state = torch.load(res["state"])
    assert set(state) == set(ref_state)
    for k, v in ref_state.items():
        assert_close(state[k], v, f"weight {k}", "weight")
    optim = torch.load(res["optim"], weights_only=False)
    assert set(optim["state"]) == set(ref_optim["state"])
    for i, st in ref_optim["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            assert_close(optim["state"][i][name], st[name], f"optimizer state {i}.{name}", name)


def test_a_sublayer_checkpoint_is_the_block_models_single_process_checkpoint(results):
    _, res = results["save_sublayer"]
    ckpt = torch.load(res["ckpt"], weights_only=False)
    ref_state, ref_optim, _ = microbatched_reference(dict(CKPT, steps=3), 1)
    assert list(ckpt["state_dict"]) == list(ref_state)
    for k, v in ref_state.items():
        assert_close(ckpt["state_dict"][k], v, f"weight {k}", "weight")
    opt = ckpt["optimizer_states"][0]
    assert [g["params"] for g in opt["param_groups"]] == [g["params"] for g in ref_optim["param_groups"]]
    for i, st in ref_optim["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            assert_close(opt["state"][i][name], st[name], f"optimizer state {i}.{name}", name)


@pytest.fixture(scope="module")
def crossed(results, tmp_path_factory):
    runs = [dict(CKPT, pp=2, resume=results["save_block"][1]["ckpt"], gpt=SUB),
            dict(CKPT, pp=2, resume=results["save_sublayer"][1]["ckpt"])]
    return run_worker(tmp_path_factory.mktemp("crossed"), 2, runs)


def test_block_checkpoint_resumes_at_sublayer_granularity(results, crossed):
    _resumed_equals_uninterrupted(crossed[0], results["full_block"][1])


def test_sublayer_checkpoint_resumes_at_block_granularity(results, crossed):
    _resumed_equals_uninterrupted(crossed[1], results["full_block"][1])


def test_moe_halves_under_expert_parallelism_equal_single_process_block_moe(tmp_path):
    """pp=2 x dp=2 with expert_parallel=2 and a migration before every step, MoE halves moving on
    their own: losses, whole-expert weights and Adam state of the checkpoint are the single-process
    block MoE GPT's (the expert shards are gathered under the block model's keys)."""
    from tests.distributed.test_moe_expert_parallel import DATA, EP_RUN
    from tests.distributed.test_moe_pipeline import RTOL as MOE_RTOL, _launch

    (ref,) = _launch(tmp_path / "ref", [dict(DATA, dp=2)], nproc=None)
    (ep,) = _launch(tmp_path / "ep", [dict(EP_RUN, gpt=SUB)], nproc=4)
    assert all(h["applied"] for h in ep["history"]) and ep["history"]
    torch.testing.assert_close(torch.tensor(ep["losses"]), torch.tensor(ref["losses"]), rtol=MOE_RTOL, atol=0)
    se, sr = torch.load(ep["state"]), torch.load(ref["state"])
    assert list(se) == list(sr)
    for k in sr:
        torch.testing.assert_close(se[k], sr[k], rtol=1e-4, atol=1e-4, msg=k)
    oe, orf = torch.load(ep["optim"]), torch.load(ref["optim"])
    assert oe["state"].keys() == orf["state"].keys()
    for i, st in orf["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            scale = st[key].abs().max().item()
            torch.testing.assert_close(oe["state"][i][key], st[key], rtol=1e-3, atol=1e-3 * scale, msg=f"{i} {key}")
