"""Expert parallelism: an MoE GPT on pp=2 x dp=2 with expert_parallel=2 (each replica of a stage
holds half the experts of every MoE layer it owns; tokens travel by all_to_all) and a layer
migration before every step equals single-process training on the global batch. Its checkpoints
are the single-process format: one saved under expert_parallel=2 loads into a plain module and
resumes under expert_parallel=1, and a single-process one resumes under expert_parallel=2, both
continuing the single-process curve. Under dp_sharding="fsdp" (dense parameters FSDP-sharded over
a stage's replicas, experts split as above and not sharded again) the same run equals this one
and single-process training, and its DCP checkpoint resumes on the single-process curve."""
from __future__ import annotations

import os

import pytest
import torch

from lightning_dynmo.models import MoEGPT
from tests.distributed.test_accumulation import assert_close_tied
from tests.distributed.test_moe_pipeline import MOE, PIPELINE, RUN, RTOL, _launch
from tests.support.workers.moe_worker import build_model

STEPS, MORE = RUN["steps"], 2
CLIP = 0.3  # below the gradient norm (~0.5), so clipping acts: each expert shard must count once
# 16 samples = one global batch of 2 x 8: every step closes an epoch, so a run resumed from any
# step's checkpoint draws the same batches as an uninterrupted one
DATA = dict(RUN, clip=CLIP, n_samples=16)
EP_RUN = dict(DATA, **PIPELINE, expert_parallel=2)
FSDP_EP_RUN = dict(EP_RUN, dp_sharding="fsdp", checkpoint_format="dcp")  # (dcp: fsdp's default format)
FSDP_EP_INDEX = 9  # its run's index in the expert-parallel job (its checkpoint's directory)
# per-iteration decisions from load counters, on two pipelines without expert parallelism: each
# replica's MoELoadMonitor measures its own routing, so at some step (step 7 with this data) only one
# replica asks; every rank must still decide. (Under expert parallelism a group's replicas report the
# same busiest-shard load, so their MoE monitors agree.) No overhead budget: every request is served.
AUTO_DATA = dict(DATA, steps=8, n_samples=64)
AUTO_RUN = dict(AUTO_DATA, **dict(PIPELINE, balancer="partition_time", rebalance="auto"), expert_parallel=1,
                rebalance_cooldown=1, imbalance_threshold=0.02, monitor_threshold=0.02, overhead_budget=float("inf"))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe_ep")
    ref, ref_longer, ref_auto = _launch(tmp / "ref", [dict(DATA, dp=2, save_ckpt=True),
                                                      dict(DATA, dp=2, steps=STEPS + MORE), dict(AUTO_DATA, dp=2)],
                                        nproc=None)
    ep_ckpt = os.path.join(tmp / "ep2", "moe_ckpt0", "last.ckpt")  # where run 0 of the job saves
    fsdp_ckpt = os.path.join(tmp / "ep2", f"moe_ckpt{FSDP_EP_INDEX}", "last.ckpt")  # a DCP directory
    (ep, ep_from_ref, ep1_from_ep, auto, ep_zb, ep_ac, ep_packed, ep_fp16, ep_freeze, ep_fsdp, ep_fsdp_resumed,
     ep_fsdp_fp16) = _launch(tmp / "ep2", [
        dict(EP_RUN, save_ckpt=True),
        dict(EP_RUN, steps=STEPS + MORE, resume=ref["ckpt"]),
        dict(EP_RUN, steps=STEPS + MORE, expert_parallel=1, resume=ep_ckpt),
        AUTO_RUN,
        dict(EP_RUN, schedule="zero_bubble"),  # split dI/dW backward: expert all_to_all inside both halves
        dict(EP_RUN, checkpointing=True),  # recompute replays the dispatch all_to_all in backward
        # each replica packs onto one rank, keeping its expert group
        dict(EP_RUN, balancer="partition_param", repack=1),
        # fp16 with a grad scaler: at step 1 an expert gradient overflows on replica 0 only
        dict(EP_RUN, precision="16-mixed", inf_at=[1, "layers.1.mlp.experts.w1"]),
        # gradient-norm freezing: a MoE layer's norm differs between replicas (each holds other experts)
        dict(EP_RUN, freezing={"threshold": 1e-9, "interval": 1}),
        dict(FSDP_EP_RUN, save_ckpt=True),
        dict(FSDP_EP_RUN, steps=STEPS + MORE, resume=fsdp_ckpt),
        dict(FSDP_EP_RUN, precision="16-mixed", inf_at=[1, "layers.1.mlp.experts.w1"]),
    ], nproc=4)
    return dict(ep=ep, ref=ref, ref_longer=ref_longer, ep_from_ref=ep_from_ref, ep1_from_ep=ep1_from_ep,
                auto=auto, ref_auto=ref_auto, ep_zb=ep_zb, ep_ac=ep_ac, ep_packed=ep_packed, ep_fp16=ep_fp16,
                ep_freeze=ep_freeze, ep_fsdp=ep_fsdp, ep_fsdp_resumed=ep_fsdp_resumed, ep_fsdp_fp16=ep_fsdp_fp16)


def test_each_replica_holds_half_of_the_experts(results):
    ep, ref = results["ep"], results["ref"]
    rows = ep["expert_rows_per_rank"]  # rank g: stage g % 2 of replica g // 2
    assert all(n == MOE["num_experts"] // 2 for r in rows for n in r.values())
    assert rows[0] == rows[2] and rows[1] == rows[3]  # replicas of a stage hold the same layers
    assert sorted(int(i) for r in rows[:2] for i in r) == sorted(int(i) for i in ref["expert_rows_per_rank"][0])
    assert all(n == MOE["num_experts"] for n in ref["expert_rows_per_rank"][0].values())


def test_expert_parallel_with_migration_every_step_matches_single_process(results):
    ep, ref = results["ep"], results["ref"]
    assert len(ep["history"]) >= STEPS - 1 and all(h["applied"] for h in ep["history"])
    torch.testing.assert_close(torch.tensor(ep["losses"]), torch.tensor(ref["losses"]), rtol=RTOL, atol=0)
    # the whole model's gradient (every expert from its owner) before and after clipping
    assert min(ref["grad_norms"]) > CLIP
    for key in ("grad_norms", "clipped_grad_norms"):
        torch.testing.assert_close(torch.tensor(ep[key]), torch.tensor(ref[key]), rtol=RTOL, atol=0, msg=key)
    se, sr = torch.load(ep["state"]), torch.load(ref["state"])
    assert se.keys() == sr.keys()
    for k in sr:
        assert se[k].shape == sr[k].shape, k  # whole experts, gathered from both replicas
        torch.testing.assert_close(se[k], sr[k], rtol=1e-4, atol=1e-4, msg=k)
    oe, orf = torch.load(ep["optim"]), torch.load(ref["optim"])
    assert oe["param_groups"] == orf["param_groups"] and oe["state"].keys() == orf["state"].keys()
    for i, st in orf["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            scale = st[key].abs().max().item()
            torch.testing.assert_close(oe["state"][i][key], st[key], rtol=1e-3, atol=1e-3 * scale, msg=f"{i} {key}")


@pytest.mark.parametrize("run", ["ep_zb", "ep_ac"])
def test_expert_parallel_under_zero_bubble_and_activation_checkpointing_matches_single_process(results, run):
    """Zero bubble splits each backward into input and weight halves, activation checkpointing
    recomputes the forward (and with it the token dispatch) inside backward: both must leave expert
    parallel training equal to single process, with a migration before every step."""
    got, ref = results[run], results["ref"]
    assert len(got["history"]) >= STEPS - 1 and all(h["applied"] for h in got["history"])
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(got["grad_norms"]), torch.tensor(ref["grad_norms"]), rtol=RTOL, atol=0)
    sg, sr = torch.load(got["state"]), torch.load(ref["state"])
    assert sg.keys() == sr.keys()
    for k in sr:
        torch.testing.assert_close(sg[k], sr[k], rtol=1e-4, atol=1e-4, msg=k)


def test_expert_parallel_repacked_onto_one_rank_per_replica_matches_single_process(results):
    """Re-packing each replica's pipeline onto one rank releases the stage-1 ranks; the remaining
    rank of each replica holds every MoE layer, still with half of its experts, and the expert
    group (the two replicas' remaining ranks) keeps training equal to single process."""
    got, ref = results["ep_packed"], results["ref"]
    packs = [h for h in got["history"] if h.get("kind") == "repack"]
    assert [(h["after"], h["applied"], h["released"]) for h in packs] == [("0-6", True, [1, 3])], got["history"]
    rows = got["expert_rows_per_rank"]
    assert rows[1] == {} and rows[3] == {} and rows[0] == rows[2]
    assert sorted(int(i) for i in rows[0]) == sorted(int(i) for i in ref["expert_rows_per_rank"][0])
    assert all(n == MOE["num_experts"] // 2 for n in rows[0].values())
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=RTOL, atol=0)
    sg, sr = torch.load(got["state"]), torch.load(ref["state"])
    for k in sr:
        torch.testing.assert_close(sg[k], sr[k], rtol=1e-4, atol=1e-4, msg=k)


def test_an_overflow_in_one_replicas_expert_shard_is_skipped_by_every_replica(results):
    """16-mixed: expert shards differ between replicas, so their grad-scaler inf checks can
    disagree. Every rank must skip the step and back off the same scale, or the replicas' shared
    weights drift apart silently (they did before found-inf was agreed over the replicas too)."""
    run = results["ep_fp16"]
    scales = run["scales_per_rank"]
    assert all(s == scales[0] for s in scales), scales
    assert scales[0][1] == scales[0][0] / 2, scales[0]  # the step with the overflow was skipped, once
    digests = run["shared_digest_per_rank"]  # rank g: stage g % 2 of replica g // 2
    for stage in (0, 1):
        a, b = digests[stage], digests[2 + stage]
        assert a.keys() == b.keys() and a, (stage, sorted(a), sorted(b))
        assert all(a[k] == b[k] for k in a), {k: (a[k], b[k]) for k in a if a[k] != b[k]}


def test_gradient_norm_freezing_decides_on_the_same_numbers_on_every_replica(results):
    """LayerFreezing(criterion="grad_norm") freezes from per-layer gradient norms; an MoE layer's
    norm differs between replicas that hold different experts, so the numbers are averaged over
    the replicas too: every rank sees the same vector and takes the same decision."""
    run = results["ep_freeze"]
    means = run["freezing_means_per_rank"]
    assert means[0] is not None and all(m == means[0] for m in means), means


def test_checkpoint_saved_under_expert_parallel_loads_into_one_process(results):
    ep = results["ep"]
    ckpt = torch.load(ep["ckpt"], weights_only=False)
    final = torch.load(ep["state"])
    model = MoEGPT(**ckpt["hyper_parameters"])
    model.load_state_dict(ckpt["state_dict"])  # strict: every key, whole-expert shapes
    for k, v in model.state_dict().items():
        assert torch.equal(v, final[k]), k
    opt = model.configure_optimizers()["optimizer"]
    opt.load_state_dict(ckpt["optimizer_states"][0])  # whole-expert moments fit the whole parameters
    saved = torch.load(ep["optim"])["state"]
    loaded = opt.state_dict()["state"]
    assert loaded.keys() == saved.keys()
    for i, st in saved.items():
        assert all(torch.equal(loaded[i][k], v) for k, v in st.items()), i


@pytest.mark.parametrize("run", ["ep_from_ref", "ep1_from_ep"])
def test_resume_across_expert_parallel_settings_continues_the_curve(results, run):
    """ep_from_ref: a single-process checkpoint sliced into shards; ep1_from_ep: an
    expert_parallel=2 checkpoint resumed with every replica holding every expert."""
    resumed, longer = results[run], results["ref_longer"]
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(longer["losses"][STEPS:]),
                               rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(resumed["grad_norms"]), torch.tensor(longer["grad_norms"][STEPS:]),
                               rtol=RTOL, atol=0)


def test_per_iteration_decisions_with_replicas_that_disagree_on_requests(results):
    auto, ref = results["auto"], results["ref_auto"]
    reasons = [h["reason"] for h in auto["history"]]
    assert any("(load counters)" in r for r in reasons), reasons
    assert any("a load monitor of another replica" in r for r in reasons), reasons  # only one replica asked
    torch.testing.assert_close(torch.tensor(auto["losses"]), torch.tensor(ref["losses"]), rtol=RTOL, atol=0)


def _expected_loads(cfg: dict, rows_per_step: list[dict], ep: int) -> list[dict[int, float]]:
    """Each step's load factor per MoE layer, computed here from the single-process run's routing
    (expert slots kept per row): replica ``r`` of ``dp`` trains rows ``r::dp`` in ``microbatches``
    contiguous micro-batches; per micro-batch, shard ``j`` of an expert-parallel group receives the
    group's slots for experts ``[j n, (j + 1) n)``; the layer's work follows the busiest shard,
    summed over micro-batches. With ``ep == 1`` every replica is its own group (its kept slots),
    and the strategy reports the mean over replicas."""
    model = build_model(cfg)
    dp, m, t = 2, cfg["microbatches"], cfg.get("block", 16)
    out = []
    for step in rows_per_step:
        loads = {}
        for layer, rows in step.items():
            rows = torch.tensor(rows)  # [dp * batch, E]
            per_mb = torch.stack([rows[r::dp].reshape(m, -1, rows.shape[1]).sum(1) for r in range(dp)])  # [dp, m, E]
            groups = per_mb.view(dp // ep, ep, m, ep, -1).sum(dim=(1, 4))  # [group, m, shard]
            busiest = groups.max(dim=2).values.sum(dim=1)  # per group
            block, tokens = model.layers[int(layer)], cfg["batch"] * t
            work = [block.relative_work(tokens, cfg["batch"] * t * (t + 1) // 2, int(b)) for b in busiest]
            loads[int(layer)] = sum(w for w in work for _ in range(ep)) / dp  # mean over replicas
        out.append(loads)
    return out


def test_load_factor_follows_the_busiest_expert_shard(results):
    """The token all_to_all waits for the shard that received most, so under expert parallelism an
    MoE layer's load factor is its busiest shard's, the same on every replica of the group."""
    ep, ref = results["ep"], results["ref"]
    expected = _expected_loads(EP_RUN, ref["routing_rows"], ep=2)
    assert len(ep["layer_load"]) == len(expected) == STEPS
    for step, (got, want) in enumerate(zip(ep["layer_load"], expected)):
        for layer, value in want.items():
            assert got[layer] == pytest.approx(value, rel=1e-9), (step, layer)
        for g in range(0, 4, 2):  # ranks g, g + 1: the two stages of replica g // 2
            mine = ep["local_load_per_rank"][g + 0][step] | ep["local_load_per_rank"][g + 1][step]
            assert {int(i): v for i, v in mine.items()} == pytest.approx(want), (step, g)
    # the busiest shard is not the mean shard: the replicas' mean of what each routes (what each shard
    # would receive at balance) differs (with capacity_factor=1 no shard can receive more than at
    # balance, so here the busiest shard's load is <= 1 and imbalance shows as less than the maximum)
    replica_view = _expected_loads(dict(EP_RUN, expert_parallel=1), ref["routing_rows"], ep=1)
    assert max(abs(w[i] - r[i]) for w, r in zip(expected, replica_view) for i in w) > 1e-3


def test_without_expert_parallel_the_load_is_each_replicas_kept_slots(results):
    resumed, longer = results["ep1_from_ep"], results["ref_longer"]
    expected = _expected_loads(dict(EP_RUN, expert_parallel=1), longer["routing_rows"][STEPS:], ep=1)
    assert len(resumed["layer_load"]) == len(expected) == MORE
    for step, (got, want) in enumerate(zip(resumed["layer_load"], expected)):
        for layer, value in want.items():
            assert got[layer] == pytest.approx(value, rel=1e-9), (step, layer)


def test_under_fsdp_dense_parameters_are_shards_and_experts_stay_split(results):
    """Each rank: every local parameter outside the experts is an FSDP shard (a DTensor over the
    stage's replicas); the experts are this replica's half, plain tensors, not sharded again."""
    got = results["ep_fsdp"]
    assert got["expert_rows_per_rank"] == results["ep"]["expert_rows_per_rank"]
    for rank, kinds in enumerate(got["dtensor_params_per_rank"]):
        experts = {n for n in kinds if ".mlp.experts." in n}
        assert experts and kinds, rank
        assert not any(kinds[n] for n in experts), (rank, sorted(n for n in experts if kinds[n]))
        assert all(kinds[n] for n in kinds if n not in experts), (rank, sorted(n for n in kinds if not kinds[n]))


def test_expert_parallel_inside_fsdp_stages_matches_replicate_and_single_process(results):
    """pp2 x dp2, expert_parallel=2, a migration before every step, clipping acting: losses and the
    whole model's gradient norms equal single-process training, weights and Adam's state equal it to
    the MoE tests' tolerance and the same run under ``replicate`` to fp32 rounding, step counts exactly."""
    got, ep, ref = results["ep_fsdp"], results["ep"], results["ref"]
    assert len(got["history"]) >= STEPS - 1 and all(h["applied"] for h in got["history"])
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=RTOL, atol=0)
    for key in ("grad_norms", "clipped_grad_norms"):
        torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(ref[key]), rtol=RTOL, atol=0, msg=key)
    sg, se, sr = torch.load(got["state"]), torch.load(ep["state"]), torch.load(ref["state"])
    assert sg.keys() == sr.keys()
    for k in sr:
        assert sg[k].shape == sr[k].shape, k
        torch.testing.assert_close(sg[k], sr[k], rtol=1e-4, atol=1e-4, msg=k)
        assert_close_tied(sg[k], se[k], f"weight {k}", "weight")
    og, oe, orf = (torch.load(r["optim"], weights_only=False) for r in (got, ep, ref))
    assert og["param_groups"] == orf["param_groups"] and og["state"].keys() == orf["state"].keys()
    for i, st in orf["state"].items():
        assert float(og["state"][i]["step"]) == float(st["step"]), i
        for key in ("exp_avg", "exp_avg_sq"):
            scale = st[key].abs().max().item()
            torch.testing.assert_close(og["state"][i][key], st[key], rtol=1e-3, atol=1e-3 * scale, msg=f"{i} {key}")
            assert_close_tied(og["state"][i][key], oe["state"][i][key], f"optimizer state {i}.{key}", key)


def test_dcp_checkpoint_of_expert_parallel_fsdp_stages_resumes_on_the_single_process_curve(results):
    resumed, longer = results["ep_fsdp_resumed"], results["ref_longer"]
    assert os.path.isdir(results["ep_fsdp"]["ckpt"])  # DCP, fsdp's default format
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(longer["losses"][STEPS:]),
                               rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(resumed["grad_norms"]), torch.tensor(longer["grad_norms"][STEPS:]),
                               rtol=RTOL, atol=0)


def test_an_overflow_in_one_replicas_expert_shard_is_skipped_by_every_fsdp_replica(results):
    """16-mixed under fsdp: the grad scaler unscales FSDP shards and expert shards together (torch's
    kernel refuses the mix; runtime/precision.py) and every rank skips the step with the inf on
    replica 0's expert shard only, so training ends where ``replicate`` does. Tolerance: up to the
    step after the skip both runs are bitwise equal (losses, gradient norms); there the clipping
    coefficients differ by an fp32 ulp (a sharded gradient's norm is summed from its shards' norms),
    and fp16 autocast turns that into rounding flips that Adam amplifies: measured up to 1.0e-3 of a
    tensor's largest entry after the last step. A replica that stepped alone at the skip would leave
    half of every dense tensor an Adam update (~3e-3, a few % of the largest entry) away."""
    got, ep = results["ep_fsdp_fp16"], results["ep_fp16"]
    scales = got["scales_per_rank"]
    assert all(s == scales[0] for s in scales) and scales[0] == ep["scales_per_rank"][0], scales
    assert scales[0][1] == scales[0][0] / 2, scales[0]
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ep["losses"]), rtol=RTOL, atol=0)
    sg, se = torch.load(got["state"]), torch.load(ep["state"])
    for k, v in se.items():
        assert float((sg[k] - v).abs().max() / v.abs().max().clamp_min(1e-12)) <= 5e-3, k
