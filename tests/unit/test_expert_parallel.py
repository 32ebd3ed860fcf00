"""Expert parallelism without processes: bad settings fail before launch (or at setup, on every
rank, from the module alone) naming the fix; sharding keeps the right experts; the group layout."""
from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_dynmo import DynMoStrategy
from lightning_dynmo.models import GPT, GPTConfig, MoEGPT
from lightning_dynmo.models.moe import GroupedExperts
from lightning_dynmo.plan.topology import Topology
from lightning_dynmo.protocol import ExpertShard
from lightning_dynmo.runtime.expert_parallel import (
    _groups_of_stage,
    check_expert_parallel,
    check_expert_parallel_model,
    shard_slots,
)
from lightning_dynmo.strategy.setup_checks import check_module

CONFIG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=0.0)


@pytest.mark.parametrize("ep", [0, -2, 1.5, True])
def test_expert_parallel_must_be_a_positive_integer(ep):
    with pytest.raises(ValueError, match="expert_parallel must be a positive integer"):
        DynMoStrategy(expert_parallel=ep)


@pytest.mark.parametrize("devices, ep, divisors", [(4, 3, r"\[1, 2\]"), (2, 2, r"\[1\]"), (8, 8, r"\[1, 2, 4\]")])
def test_expert_parallel_not_dividing_the_replicas_fails_before_launch(devices, ep, divisors):
    message = rf"expert_parallel={ep} must divide the {devices // 2} data-parallel.*{divisors}"
    with pytest.raises(ValueError, match=message):
        L.Trainer(strategy=DynMoStrategy(pipeline_parallel=2, expert_parallel=ep), accelerator="cpu", devices=devices)


def test_expert_parallel_dividing_the_replicas_is_accepted():
    check_expert_parallel(2, 4)
    check_expert_parallel(4, 4)
    check_expert_parallel(1, 3)


def test_num_experts_not_divisible_by_expert_parallel_names_the_counts():
    model = MoEGPT(CONFIG, moe=dict(num_experts=4, top_k=2), seed=0)
    with pytest.raises(ValueError, match=r"expert_parallel=3 must divide the number of experts.*num_experts=\[4\]"):
        check_module(model, 2, 2, 1, expert_parallel=3)
    check_module(model, 2, 2, 1, expert_parallel=2)


def test_a_dense_model_cannot_be_expert_parallel():
    with pytest.raises(ValueError, match="GPT has no expert layers.*use expert_parallel=1"):
        check_expert_parallel_model(GPT(CONFIG, seed=0), 2)
    check_expert_parallel_model(GPT(CONFIG, seed=0), 1)


def test_sharding_keeps_the_shards_experts_and_is_idempotent():
    torch.manual_seed(0)
    experts = GroupedExperts(dim=8, hidden=16, num_experts=6)
    for w in experts.parameters():
        torch.nn.init.normal_(w)
    full = {n: p.detach().clone() for n, p in experts.named_parameters()}
    replaced = experts.shard_experts(ExpertShard(rank=1, size=3))
    assert [name for name, _, _ in replaced] == ["w1", "w3", "w2"]
    for name, old, new in replaced:
        assert new is getattr(experts, name) and old is not new
        assert torch.equal(new, full[name][2:4])  # shard 1 of 3: experts 2 and 3
    assert experts.num_experts == 6  # the layer's total; the shard holds 2
    assert experts.shard_experts(ExpertShard(rank=1, size=3)) == []
    with pytest.raises(RuntimeError, match="already hold shard"):
        experts.shard_experts(ExpertShard(rank=0, size=3))
    with pytest.raises(ValueError, match="cannot be split into expert_parallel=4"):
        GroupedExperts(dim=8, hidden=16, num_experts=6).shard_experts(ExpertShard(rank=0, size=4))


def test_sharded_experts_outside_the_strategy_say_so():
    experts = GroupedExperts(dim=8, hidden=16, num_experts=4)
    experts.shard_experts(ExpertShard(rank=0, size=2))
    with pytest.raises(RuntimeError, match="no expert-parallel group"):
        experts(torch.zeros(3, 8), torch.tensor([1, 1, 1, 0]))


def test_groups_are_blocks_of_adjacent_replicas_and_same_shard_strides():
    topo = Topology(world_size=8, pp=2)  # dp = 4; stage 1 lives on ranks 1, 3, 5, 7
    peers, same = _groups_of_stage(topo, ep=2, stage=1)
    assert peers == [[1, 3], [5, 7]]  # replica d holds shard d % 2
    assert same == [[1, 5], [3, 7]]


def test_each_shard_receives_its_experts_rows_from_every_peer():
    # rows peer p sends to each of 4 experts; shard 0 holds experts 0-1, shard 1 experts 2-3
    sent = torch.tensor([[3, 1, 0, 4],
                         [2, 2, 5, 0]])
    assert shard_slots(sent, 2).tolist() == [3 + 1 + 2 + 2, 0 + 4 + 5 + 0]
    assert shard_slots(sent[:1], 1).tolist() == [8]  # one shard: every row this rank routes
    three = torch.arange(18).view(3, 6)  # 3 peers, 6 experts, 2 per shard
    assert shard_slots(three, 3).tolist() == [three[:, 2 * j:2 * j + 2].sum().item() for j in range(3)]


def test_unsharded_experts_report_one_shard_with_every_row():
    experts = GroupedExperts(dim=8, hidden=16, num_experts=4)
    y, slots = experts(torch.randn(5, 8), torch.tensor([2, 0, 3, 0]))
    assert y.shape == (5, 8) and slots.tolist() == [5]
