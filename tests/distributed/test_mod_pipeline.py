"""Mixture-of-Depths training on a 2-rank pipeline (1F1B, a layer migration before every step)
equals single-process Lightning training, in every routing mode, with the capacity annealed by
the MixtureOfDepths callback, which also asks the pipeline to rebalance as the load shifts; also
with MoE MLPs in the MoD blocks (MoD + MoE)."""
from __future__ import annotations


import pytest
import torch

from lightning_dynmo.models.mod import ROUTING_MODES
from tests.support.multiproc import ROOT, run_worker

WORKER = ROOT / "tests" / "support" / "workers" / "mod_worker.py"
JOB = dict(timeout=300, worker=WORKER)
STEPS = 5
CALLBACK = {"capacity": 1.0, "final_capacity": 0.25, "anneal_steps": 3, "drift": 0.1}
RUNS = [
    dict(steps=STEPS, batch=8, clip=1.0, callback=CALLBACK,
         mod={"routing": routing, "capacity": 0.25, "every": 2, "predictor_loss_coeff": 0.1})
    for routing in ROUTING_MODES
]
# MoD and MoE in one model: MoE MLPs in every block, so the MoD blocks' MLPs route only the real
# slots of their packed rows (dropless), with both the MixtureOfDepths and MoELoadMonitor callbacks
MOD_MOE = dict(RUNS[1], moe={"num_experts": 4, "top_k": 2, "moe_every": 1, "shared_expert": True,
                             "aux_loss_coeff": 0.05, "z_loss_coeff": 0.01},
               moe_monitor={"shift_threshold": 0.05})
PIPELINE = dict(pp=2, schedule="1f1b", microbatches=4, balancer="test_shift", rebalance="every_n", rebalance_interval=1)
# ... and under expert parallelism (pp=2 x dp=2, each replica holding half the experts), which
# accepts MoE inside MoD blocks only with expert-choice routing (it always picks tokens); 16
# samples = one global batch of 2 x 8, so every step closes an epoch
MOD_MOE_EP = dict(MOD_MOE, mod=dict(RUNS[0]["mod"]), n_samples=16)
# zero-bubble schedules split the backward into input and weight passes: the predictor's loss
# (attached to a stage output) must survive that too
ZBV = dict(PIPELINE, schedule="zbv")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mod")
    pipe = run_worker(tmp / "pp2", 2, [dict(r, **PIPELINE) for r in RUNS] + [dict(RUNS[1], **ZBV),
                                                                             dict(MOD_MOE, **PIPELINE)], **JOB)
    return pipe, run_worker(tmp / "ref", None, RUNS + [MOD_MOE], **JOB)


def check_same_training(p: dict, r: dict) -> None:
    assert len(p["history"]) == STEPS - 1 and all(h["applied"] for h in p["history"])  # a migration before every step
    torch.testing.assert_close(torch.tensor(p["losses"]), torch.tensor(r["losses"]), rtol=1e-5, atol=0)
    sp, sr = torch.load(p["state"]), torch.load(r["state"])
    assert sp.keys() == sr.keys()
    for k in sr:  # routers and predictors included (Adam amplifies fp32 noise in tiny gradients: 1e-4)
        torch.testing.assert_close(sp[k], sr[k], rtol=1e-4, atol=1e-4, msg=k)


@pytest.mark.parametrize("routing", ROUTING_MODES)
def test_mod_pp2_with_migrations_equals_single_process(results, routing):
    pipe, ref = results
    i = ROUTING_MODES.index(routing)
    p, r = pipe[i], ref[i]
    check_same_training(p, r)
    # the same per-block token fractions on both sides; the annealed capacity shifted the load profile
    assert p["callback"]["last_fractions"] == pytest.approx(r["callback"]["last_fractions"], nan_ok=True)
    assert p["callback"]["requests"] and not r["callback"]["requests"]  # only a pipeline is asked to rebalance
    assert any("mod:" in h["reason"] for h in p["history"])  # requests reach the strategy
    # MoD blocks report their load: after the first profiled step, every decision scales that
    # profile by the token fractions (c_i = r_i t_i) instead of profiling again, unless a block's
    # load left the band around its profiled load (then it is profiled afresh)
    reasons = [h["reason"] for h in p["history"]]
    from_counters = [r for r in reasons if "(load counters)" in r]
    reprofiled = [r for r in reasons[1:] if "left the profiled band" in r]
    assert from_counters and len(from_counters) + len(reprofiled) == len(reasons) - 1, reasons


@pytest.mark.compat  # torch <= 2.12's split backward through a custom autograd.Function (runtime/torch_compat.py)
def test_predictor_loss_survives_the_split_backward_of_zero_bubble(results):
    pipe, ref = results
    assert ROUTING_MODES[1] == "predictor"
    check_same_training(pipe[len(RUNS)], ref[1])


def test_mod_with_moe_pp2_with_migrations_equals_single_process(results):
    pipe, ref = results
    p, r = pipe[len(RUNS) + 1], ref[len(RUNS)]
    check_same_training(p, r)
    assert any(".mlp.experts.w1" in k and k.startswith("layers.2.") for k in torch.load(r["state"]))  # a MoD block's
    assert p["callback"]["last_fractions"] == pytest.approx(r["callback"]["last_fractions"], nan_ok=True)
    # the monitor sees every block's MoE MLP (layers 1-6; MoD blocks 2, 4, 6) on both sides, alike
    sp, sr = p["moe_monitor"]["last_stats"], r["moe_monitor"]["last_stats"]
    assert sorted(sr, key=int) == [str(i) for i in range(1, 7)] and sp.keys() == sr.keys()
    for i in sr:
        assert sp[i]["dropped"] == sr[i]["dropped"] == 0.0  # dropless
        assert sp[i]["balance_loss"] == pytest.approx(sr[i]["balance_loss"], rel=1e-4), i
        assert sp[i]["max_over_mean"] == pytest.approx(sr[i]["max_over_mean"], rel=1e-4), i


@pytest.fixture(scope="module")
def ep_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mod_moe_ep")
    return [run_worker(tmp / "ep2", 4, [dict(MOD_MOE_EP, **PIPELINE, expert_parallel=2)], **JOB)[0],
            run_worker(tmp / "ref", None, [dict(MOD_MOE_EP, dp=2)], **JOB)[0]]


def test_mod_with_moe_under_expert_parallelism_equals_single_process(ep_results):
    ep, ref = ep_results
    full = MOD_MOE_EP["moe"]["num_experts"]
    assert set(ref["expert_rows_per_rank"][0].values()) == {full}
    assert all(n == full // 2 for r in ep["expert_rows_per_rank"] for n in r.values())  # each replica: half
    assert len(ep["history"]) >= STEPS - 1 and all(h["applied"] for h in ep["history"])
    torch.testing.assert_close(torch.tensor(ep["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
    se, sr = torch.load(ep["state"]), torch.load(ref["state"])
    assert se.keys() == sr.keys()
    for k in sr:
        assert se[k].shape == sr[k].shape, k  # whole experts, gathered from both replicas
        torch.testing.assert_close(se[k], sr[k], rtol=1e-4, atol=1e-4, msg=k)
