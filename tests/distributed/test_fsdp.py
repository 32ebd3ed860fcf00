"""``dp_sharding="fsdp"``: FSDP2 inside each stage of a pp2 x dp2 pipeline (4 CPU ranks, gloo)
equals single-process training, with a migration before every optimizer step and layers moving
inside accumulation windows (each move gathers the layer whole on the sending stage's replicas and
shards it again on the receiving stage's), gradients clipped by the global norm and
``accumulate_grad_batches=2``: losses against plain Lightning, weights, Adam state and pre-clip
gradient norms against single-process training (test_accumulation.py's reference and checks).
Three schedules run in one torchrun job. The same job checks that state really is sharded, and
what ``dp_sharding="fsdp"`` refuses at setup. Every run's model has two parameters no forward
uses, on layers that migrate (a 2-D weight-decayed one and a 1-D one): they must end as in one
process, with their original values and no optimizer state (FSDP reduce-scatters zeros for them;
the strategy sets their gradient back to ``None``, runtime/fsdp.py). An early-exit run where every
token leaves after block 1 does the same for whole layers (blocks 2-5, which migrate). The tied
GPT (embedding and LM head one parameter) runs with its ends in two stages (against ``replicate``
on the same layout too), in the two stages of one rank (zbv), and in one stage after a repack,
whose DCP checkpoint a fresh run resumes.

Tolerance: FSDP reduce-scatters each batch's gradients when its schedule ends (torch's pipelining
reduces at every step's last backward), so an accumulation window sums the replicas' gradients
per batch and then the batches, where single-process training (and ``replicate``, which averages
once per window) sums each replica's batches first. That is fp32 rounding, which Adam amplifies
in near-zero entries, so with accumulation the weights and moments agree to 5e-5 of the tensor's
largest entry (test_accumulation.py's tolerance for tied weights, whose sums are also reordered).
Without accumulation the order is the single-process one and the strict element-wise tolerance of
test_equivalence.py holds.
"""
from __future__ import annotations

import pytest
import torch

from tests.distributed.test_accumulation import (MOVES, RTOL, accumulated_reference, assert_close_tied, base,
                                                  check_accumulation, lightning_losses, migrations)
from tests.distributed.test_equivalence import assert_close
from tests.support.multiproc import run_named_pairs
from tests.support.optim import state_index
from tests.support.workers.common import make_model

pytestmark = pytest.mark.slow
STEPS = 3

# parameters no forward uses, on layers that migrate: a 2-D one (weight-decayed: one process
# leaves it as it is) and a 1-D one (no decay: only Adam's state and step count would show)
UNUSED = [[5, [7, 4]], [3, [5]]]

RUNS = {
    "1f1b": base(dp_sharding="fsdp", unused=UNUSED, partition=[0, 6, 9], mid_window_partitions=[[0, 3, 9], [0, 6, 9]],
                 rebalance="every_n", balancer="test_cycle"),
    "interleaved_1f1b": base(dp_sharding="fsdp", unused=UNUSED, schedule="interleaved_1f1b", partition=[0, 2, 4, 6, 9],
                             mid_window_partitions=[[0, 1, 3, 5, 9], [0, 2, 4, 6, 9]],
                             rebalance="every_n", balancer="test_cycle"),
    "zero_bubble": base(dp_sharding="fsdp", unused=UNUSED, schedule="zero_bubble", partition=[0, 2, 4, 6, 9],
                        mid_window_partitions=[[0, 1, 3, 5, 9], [0, 2, 4, 6, 9]],
                        rebalance="every_n", balancer="test_cycle"),
    "1f1b_no_accumulation": base(dp_sharding="fsdp", unused=UNUSED, accumulate=1, partition=[0, 6, 9],
                                 rebalance="every_n", balancer="test_cycle"),
    # every token exits after block 1 (cos > -1 always holds): blocks 2-5 get no gradient anywhere
    "early_exit": base(dp_sharding="fsdp", accumulate=1, partition=[0, 6, 9], rebalance="every_n",
                       balancer="test_cycle", early_exit_gpt={"exit_layers": [1], "exit_threshold": -1.0}),
}
ACCUMULATING = [n for n in RUNS if RUNS[n]["accumulate"] > 1]
# The tied GPT: the LM head (layer 8) shares the embedding's weight (layer 0), a migration before
# every step. 1f1b holds the ends in two stages (their shards summed per shard over the tied group);
# zbv's V layout holds both on pp rank 0, in its two stages (the head's parameter mirrors the
# embedding's shard) while layers 6 and 7 migrate between the ranks. Without accumulation, against
# one process and replicate; with accumulation (and moves inside the windows) the two fsdp layouts
# against each other (FSDP's per-batch reduce-scatter reorders the window's sums, see above: measured
# 5.1e-5 of one tensor's largest entry off one process after 3 steps, in 1 of its 1024 entries,
# identically in both layouts, while they agree element-wise).
TIED = dict(dp_sharding="fsdp", tied=True, rebalance="every_n", balancer="test_cycle")
TIED_RUNS = {
    "tied": base(**TIED, accumulate=1, partition=[0, 6, 9]),
    "tied_replicate": base(**dict(TIED, dp_sharding="replicate"), accumulate=1, partition=[0, 6, 9]),
    "tied_zbv": base(**TIED, accumulate=1, schedule="zbv", partition=[0, 2, 4, 6, 9]),
    "tied_accumulate": base(**TIED, steps=2, partition=[0, 6, 9], mid_window_partitions=MOVES),
    "tied_accumulate_zbv": base(**TIED, steps=2, schedule="zbv", partition=[0, 2, 4, 6, 9]),
    # packed onto one rank per replica after step 1 (the head moves next to the embedding: one
    # stage), saved by DCP at step 2 (released ranks too), the end of an epoch (2 global batches of
    # 16), so that a fresh pp2 x dp2 fsdp run resuming it sees the batch an uninterrupted run sees
    "tied_repack": base(**dict(TIED, rebalance="never"), accumulate=1, steps=2, repack_to=[1, 1], save_ckpt=True,
                        checkpoint_format="dcp", n_samples=32),
}


def _tied_resume(tmp, index: int) -> dict:
    return dict(TIED_RUNS["tied_repack"], steps=STEPS, repack_to=None, save_ckpt=False,
                resume=str(tmp / f"ckpt{index}" / "last.ckpt"))  # pipeline_worker's ModelCheckpoint directory


@pytest.fixture(scope="module")
def four_rank(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp4")
    runs = dict(RUNS, **TIED_RUNS)
    runs["tied_resumed"] = _tied_resume(tmp, list(runs).index("tied_repack"))
    return run_named_pairs(tmp, 4, runs)


@pytest.mark.parametrize("schedule", ACCUMULATING)
def test_fsdp_with_migrations_every_step_matches_single_process(four_rank, schedule):
    cfg, res = four_rank[schedule]
    assert res["dp"] == 2
    assert res["mid_window_moves"] == STEPS * (cfg["accumulate"] - 1)
    assert migrations(res) == STEPS - 1  # a decision that moved layers before every optimizer step after the first
    # FSDP's reduce-scatter averages over the replicas; the DDP-style all-reduce never runs
    check_accumulation(res, cfg, replica_averages=0, close=assert_close_tied)


def test_fsdp_without_accumulation_matches_single_process_strictly(four_rank):
    cfg, res = four_rank["1f1b_no_accumulation"]
    assert res["dp"] == 2 and migrations(res) == STEPS - 1
    check_accumulation(res, cfg, replica_averages=0, close=assert_close)


def test_each_replica_holds_its_shard_only(four_rank):
    """After the migrations, the four ranks' local parameter pieces add up to the model once
    (replicated: twice), and each stage's two replicas hold about half of it each."""
    cfg, res = four_rank["1f1b"]
    total = sum(p.numel() for p in make_model(cfg).parameters())
    local = res["local_param_numel_per_rank"]  # global ranks: replica 0 = [0, 1], replica 1 = [2, 3]
    assert sum(local) == total, (local, total)
    for stage in (0, 1):
        a, b = local[stage], local[2 + stage]
        assert abs(a - b) <= 0.1 * (a + b), local


@pytest.mark.parametrize("schedule", [n for n in RUNS if RUNS[n].get("unused")])
def test_parameters_no_forward_uses_are_left_alone(four_rank, schedule):
    """As in one process: no weight decay (the 2-D one), no Adam state or step count (both), after
    migrations with them (and inside accumulation windows). Without the strategy's correction
    FSDP's zeros made AdamW decay the 2-D one (7.5e-4 of its largest entry after 3 steps) and keep
    state for both."""
    cfg, res = four_rank[schedule]
    state, init = torch.load(res["state"]), make_model(cfg).state_dict()
    optim = torch.load(res["optim"], weights_only=False)["state"]
    index = state_index(make_model(cfg))
    for layer, _ in cfg["unused"]:
        name = f"layers.{layer}.unused"
        assert torch.equal(state[name], init[name]), name
        assert index[name] not in optim, (name, optim.get(index[name]))


def test_layers_past_an_early_exit_train_as_in_one_process(four_rank):
    """Whole layers without a gradient on any replica (every token exited before them), moving
    between stages: equal to one process, and left as they were (no state, no decay)."""
    cfg, res = four_rank["early_exit"]
    assert res["dp"] == 2 and migrations(res) == STEPS - 1
    check_accumulation(res, cfg, replica_averages=0, close=assert_close)
    state, init = torch.load(res["state"]), make_model(cfg).state_dict()
    optim = torch.load(res["optim"], weights_only=False)["state"]
    index = state_index(make_model(cfg))
    deep = [n for n in index if n.split(".")[1] in {"3", "4", "5", "6"}]  # blocks 2-5 (layer 0: the embedding)
    assert len(deep) > 4
    for name in deep:
        assert torch.equal(state[name], init[name]), name
        assert index[name] not in optim, name
    assert any(index[n] in optim for n in index if n.split(".")[1] == "2")  # block 1 (the exit) trained


def _same_state(res: dict, ref: dict, close) -> None:
    state, want = torch.load(res["state"]), torch.load(ref["state"])
    assert state.keys() == want.keys()
    for key, v in want.items():
        if torch.is_floating_point(v):
            close(state[key], v, f"weight {key}", "weight")
    optim, optim_ref = (torch.load(r["optim"], weights_only=False)["state"] for r in (res, ref))
    assert optim.keys() == optim_ref.keys()
    for i, st in optim_ref.items():
        assert float(optim[i]["step"]) == float(st["step"])
        for name in ("exp_avg", "exp_avg_sq"):
            close(optim[i][name], st[name], f"optimizer state {i}.{name}", name)


def test_tied_embedding_and_head_in_two_sharded_stages_match_replicate_and_one_process(four_rank):
    """Each end's shards summed over the tied group per shard index, after each stage's
    reduce-scatter; clipping counts the parameter once (the weights would differ otherwise)."""
    cfg, res = four_rank["tied"]
    assert res["dp"] == 2 and migrations(res) == STEPS - 1
    check_accumulation(res, cfg, replica_averages=0, close=assert_close_tied)  # (and the two names are equal)
    _, rep = four_rank["tied_replicate"]
    assert res["losses"] == pytest.approx(rep["losses"], rel=RTOL)
    _same_state(res, rep, assert_close_tied)


def test_tied_ends_in_two_stages_of_one_rank_share_one_shard(four_rank):
    """zbv holds both ends on pp rank 0: the head's parameter mirrors the embedding's shard and
    its gradient joins the embedding's; equal to one process, and element-wise to the ends on
    two ranks."""
    cfg, res = four_rank["tied_zbv"]
    assert res["dp"] == 2 and migrations(res) == STEPS - 1
    check_accumulation(res, cfg, replica_averages=0, close=assert_close_tied)
    _same_state(res, four_rank["tied"][1], assert_close)


def test_tied_fsdp_with_accumulation_is_the_same_on_one_rank_and_on_two(four_rank):
    """accumulate_grad_batches=2, layers moving inside the windows: the losses are one process's
    and the ends on one rank (zbv) train element-wise as the ends on two ranks (1f1b)."""
    cfg, res = four_rank["tied_accumulate"]
    _, zbv = four_rank["tied_accumulate_zbv"]
    assert res["mid_window_moves"] == cfg["steps"] and migrations(res) == migrations(zbv) == cfg["steps"] - 1
    ref = lightning_losses(cfg, 2)
    for run in (res, zbv):
        assert run["losses"] == pytest.approx(ref, rel=RTOL), (run["losses"], ref)
        assert run["replica_averages"] == 0
    _same_state(zbv, res, assert_close)


def test_tied_ends_brought_into_one_stage_by_a_repack_train_and_resume_from_dcp(four_rank):
    """The repack moves the head onto the embedding's rank (one stage); the DCP checkpoint it then
    writes resumes on a fresh pp2 x dp2 fsdp layout (the ends on two ranks again) to the weights,
    Adam state and losses of uninterrupted single-process training."""
    cfg, res = four_rank["tied_repack"]
    assert res["strategy_released_ranks_per_rank"] == [[1, 3]] * 4, res["strategy_released_ranks_per_rank"]
    check_accumulation(res, cfg, replica_averages=0, close=assert_close_tied)
    full, resumed = four_rank["tied_resumed"]
    losses = lightning_losses(full, 2)
    assert resumed["losses"] == pytest.approx(losses[cfg["steps"]:], rel=RTOL), (resumed["losses"], losses)
    state_ref, optim_ref, _ = accumulated_reference(full, 2)
    state = torch.load(resumed["state"])
    assert torch.equal(state["layers.0.wte.weight"], state["layers.8.lm_head.weight"])
    for key, v in state_ref.items():
        if torch.is_floating_point(v):
            assert_close_tied(state[key], v, f"weight {key}", "weight")
    optim = torch.load(resumed["optim"], weights_only=False)["state"]
    assert optim.keys() == optim_ref["state"].keys()
    for i, st in optim_ref["state"].items():
        assert float(optim[i]["step"]) == float(st["step"]) == STEPS
        for name in ("exp_avg", "exp_avg_sq"):
            assert_close_tied(optim[i][name], st[name], f"optimizer state {i}.{name}", name)
