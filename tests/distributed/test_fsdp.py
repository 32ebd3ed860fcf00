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
token leaves after block 1 does the same for whole layers (blocks 2-5, which migrate).

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

from tests.distributed.test_accumulation import assert_close_tied, base, check_accumulation, migrations
from tests.distributed.test_equivalence import assert_close
from tests.support.multiproc import run_worker
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


@pytest.fixture(scope="module")
def four_rank(tmp_path_factory):
    names = list(RUNS)
    results = run_worker(tmp_path_factory.mktemp("fsdp4"), 4, [RUNS[n] for n in names])
    return {n: (RUNS[n], r) for n, r in zip(names, results)}


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


def _optimizer_index(cfg: dict) -> dict[str, int]:
    """Parameter name -> its key in the optimizer's state dict (the single-process numbering)."""
    model = make_model(cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    order = [p for g in model.configure_optimizers()["optimizer"].param_groups for p in g["params"]]
    return {names[id(p)]: i for i, p in enumerate(order)}


@pytest.mark.parametrize("schedule", [n for n in RUNS if RUNS[n].get("unused")])
def test_parameters_no_forward_uses_are_left_alone(four_rank, schedule):
    """As in one process: no weight decay (the 2-D one), no Adam state or step count (both), after
    migrations with them (and inside accumulation windows). Without the strategy's correction
    FSDP's zeros made AdamW decay the 2-D one (7.5e-4 of its largest entry after 3 steps) and keep
    state for both."""
    cfg, res = four_rank[schedule]
    state, init = torch.load(res["state"]), make_model(cfg).state_dict()
    optim = torch.load(res["optim"], weights_only=False)["state"]
    index = _optimizer_index(cfg)
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
    index = _optimizer_index(cfg)
    deep = [n for n in index if n.split(".")[1] in {"3", "4", "5", "6"}]  # blocks 2-5 (layer 0: the embedding)
    assert len(deep) > 4
    for name in deep:
        assert torch.equal(state[name], init[name]), name
        assert index[name] not in optim, name
    assert any(index[n] in optim for n in index if n.split(".")[1] == "2")  # block 1 (the exit) trained
