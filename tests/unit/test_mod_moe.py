"""Mixture-of-Depths blocks with MoE MLPs: the masked MoE layer (only the valid slots of packed
rows are routed), MoDGPT(moe=...), exactness under micro-batching and the load monitor."""
from __future__ import annotations

import copy
import math

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_dynmo.callbacks.mod import MixtureOfDepths
from lightning_dynmo.callbacks.moe import MoELoadMonitor
from lightning_dynmo.models import GPTConfig, MoEBlock, MoEConfig, MoEGPT, MoELayer
from lightning_dynmo.models.gpt import Block
from lightning_dynmo.models.mod import MoDBlock, MoDGPT
from lightning_dynmo.models.moe import load_balancing_loss, router_z_loss

from tests.support.grads import param_grads
from tests.support.tokens import tokens

GPT_CFG = dict(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32, bias=True)
MOE_CFG = dict(num_experts=4, top_k=2, aux_loss_coeff=0.1, z_loss_coeff=0.01, shared_expert=True)
MOD_CFG = dict(routing="predictor", capacity=0.5, every=2, predictor_loss_coeff=0.1)


def _masked_case():
    torch.manual_seed(0)
    layer = MoELayer(32, 48, MoEConfig(**MOE_CFG))
    layer.init_weights(0.2, 0.1)
    x = torch.randn(4, 6, 32)
    lengths = [6, 3, 0, 1]  # a full row, padded rows and a row without a valid token
    valid = torch.arange(6)[None, :] < torch.tensor(lengths)[:, None]
    return layer, x, valid, lengths


# ---------------------------------------------------------------------------------- MoELayer(valid)
def test_masked_layer_equals_each_row_on_its_valid_tokens_alone():
    layer, x, valid, lengths = _masked_case()
    layer.eval()
    with torch.no_grad():
        out = layer(x, valid)
        assert torch.equal(out[~valid], torch.zeros_like(out[~valid]))  # padding slots: output 0
        for r, n in enumerate(lengths):
            if n:
                torch.testing.assert_close(out[r, :n], layer(x[r:r + 1, :n])[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(layer(x, torch.ones(4, 6, dtype=torch.bool)), layer(x), rtol=1e-5, atol=1e-6)


def test_masked_counts_and_aux_losses_are_per_row_means_over_valid_tokens():
    layer, x, valid, lengths = _masked_case()
    layer.train()
    layer(x, valid)
    window = layer.stats_window
    assert window.tokens == sum(lengths) and window.causal_pairs == sum(n * (n + 1) // 2 for n in lengths)
    assert int(window.expert_tokens.sum()) == sum(lengths) * layer.top_k  # dropless: every valid slot
    assert int(window.busiest_slots) == sum(lengths) * layer.top_k
    stats = layer.routing_stats()
    assert stats.dropped_fraction == 0.0 and stats.relative_work == pytest.approx(1.0)

    r = layer.router(x)
    per_row_balance, per_row_z = [], []
    for i, n in enumerate(lengths):  # each row alone, on its valid tokens; an empty row gives 0
        if n == 0:
            per_row_balance.append(torch.tensor(0.0))
            per_row_z.append(torch.tensor(0.0))
            continue
        per_row_balance.append(load_balancing_loss(r.probs[i:i + 1, :n], r.experts[i:i + 1, :n], layer.num_experts))
        per_row_z.append(router_z_loss(r.logits[i:i + 1, :n]))
    expected_balance = torch.stack(per_row_balance).mean()  # the empty row counts in the mean over rows
    torch.testing.assert_close(window.balance_loss_sum, expected_balance.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(load_balancing_loss(r.probs, r.experts, layer.num_experts, valid), expected_balance,
                               rtol=1e-6, atol=0)
    torch.testing.assert_close(router_z_loss(r.logits, valid), torch.stack(per_row_z).mean(), rtol=1e-6, atol=0)
    # all-valid masks give the unmasked losses
    full = torch.ones(4, 6, dtype=torch.bool)
    torch.testing.assert_close(load_balancing_loss(r.probs, r.experts, 4, full),
                               load_balancing_loss(r.probs, r.experts, 4))
    torch.testing.assert_close(router_z_loss(r.logits, full), router_z_loss(r.logits))


def test_masked_layer_rejects_capacity_and_bad_masks():
    layer = MoELayer(8, 16, MoEConfig(num_experts=2, top_k=1, capacity_factor=1.0))
    with pytest.raises(ValueError, match="capacity_factor=None"):
        layer(torch.randn(1, 3, 8), torch.ones(1, 3, dtype=torch.bool))
    dropless = MoELayer(8, 16, MoEConfig(num_experts=2, top_k=1))
    with pytest.raises(ValueError, match="bool mask"):
        dropless(torch.randn(1, 3, 8), torch.ones(1, 3))


# ---------------------------------------------------------------------------------- MoDGPT(moe=...)
def test_block_types_follow_every_and_moe_every():
    model = MoDGPT(GPT_CFG, mod=MOD_CFG, moe=dict(MOE_CFG, moe_every=1), seed=0)
    blocks = list(model.layers)[1:5]
    assert [type(b) for b in blocks] == [MoEBlock, MoDBlock, MoEBlock, MoDBlock]
    assert all(isinstance(b.mlp, MoELayer) for b in blocks)
    assert [i for i, _ in model.moe_blocks()] == [1, 2, 3, 4] and [i for i, _ in model.mod_blocks()] == [2, 4]

    overlap = MoDGPT(GPT_CFG, mod=MOD_CFG, moe=dict(MOE_CFG, moe_every=2), seed=0)
    assert [type(b) for b in list(overlap.layers)[1:5]] == [Block, MoDBlock, Block, MoDBlock]
    assert [i for i, _ in overlap.moe_blocks()] == [2, 4]
    # routers, predictors and the attention of the MoD blocks are those of MoDGPT without MoE
    plain = MoDGPT(GPT_CFG, mod=MOD_CFG, seed=0).state_dict()
    for name, value in overlap.state_dict().items():
        if ".mlp." not in name:
            assert torch.equal(value, plain[name]), name

    assert MoDGPT(GPT_CFG, mod=MOD_CFG, seed=0).moe_config is None  # no moe: unchanged model


def test_capacity_inside_mod_blocks_is_rejected_with_the_fix():
    with pytest.raises(ValueError, match=r"MoD blocks \[1, 3\].*capacity_factor=None, or MoD every / moe_every"):
        MoDGPT(GPT_CFG, mod=MOD_CFG, moe=dict(MOE_CFG, capacity_factor=1.25), seed=0)
    # no overlap (MoE block 2, MoD blocks 1 and 3): capacity is fine on the MoEBlock
    model = MoDGPT(GPT_CFG, mod=MOD_CFG, moe=dict(MOE_CFG, moe_every=3, capacity_factor=1.25), seed=0)
    assert [i for i, _ in model.moe_blocks()] == [3]


def test_hparams_reload():
    model = MoDGPT(GPTConfig(**GPT_CFG), mod=MOD_CFG, moe=MoEConfig(**MOE_CFG), seed=0)
    assert isinstance(model.hparams["moe"], dict) and isinstance(model.hparams["mod"], dict)
    clone = MoDGPT(**model.hparams)
    clone.load_state_dict(model.state_dict())
    x = tokens(2)
    model.eval(), clone.eval()
    torch.testing.assert_close(clone(x), model(x), rtol=0, atol=0)


def test_moe_gpt_weights_are_those_of_the_inline_construction():
    """install_moe (shared with MoDGPT) draws what MoEGPT.__init__ drew before it was factored out."""
    for moe in (dict(MOE_CFG), dict(MOE_CFG, moe_every=2, expert_ratio=1.5, shared_expert=16)):
        cfg = GPTConfig(**GPT_CFG)
        model = MoEGPT(cfg, moe=moe, seed=3)
        ref = MoEGPT.__mro__[1](cfg, seed=3)  # the dense GPT, then the former inline loop
        moe_config = MoEConfig(**moe)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(3)
            for i in range(cfg.n_layer):
                if (i + 1) % moe_config.moe_every:
                    continue
                ratio = cfg.block_mlp_ratio(i) if moe_config.expert_ratio is None else moe_config.expert_ratio
                block = MoEBlock(cfg, moe_config, expert_hidden=max(1, round(ratio * cfg.n_embd)))
                for name in ("ln_1", "attn", "ln_2"):
                    getattr(block, name).load_state_dict(getattr(ref.layers[1 + i], name).state_dict())
                block.mlp.init_weights(0.02, 0.02 / math.sqrt(2 * cfg.n_layer))
                ref.layers[1 + i] = block
        a, b = model.state_dict(), ref.state_dict()
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("routing", ["predictor", "expert_choice", "threshold"])
def test_micro_batches_equal_the_whole_batch(routing):
    """What the pipeline does: per-micro-batch mean losses (CE + attached MoE and predictor
    losses), gradients summed then divided by m; packed widths differ per micro-batch."""
    model = MoDGPT(GPT_CFG, mod=dict(MOD_CFG, routing=routing, capacity=0.3), moe=dict(MOE_CFG, moe_every=1), seed=0)
    x, y = tokens(8, seed=3), tokens(8, seed=4)
    full_loss = model.pipeline_loss(model(x), y)
    full_loss.backward()
    full = param_grads(model)
    assert any(n.endswith("mlp.router.gate.weight") and n.startswith("layers.2.") for n in full)  # a MoD block's

    micro = copy.deepcopy(model)
    micro.zero_grad(set_to_none=True)
    losses = []
    for xs, ys in zip(x.chunk(4), y.chunk(4)):
        loss = micro.pipeline_loss(micro(xs), ys)
        loss.backward()  # the attached losses are seeded with 1 each: scale the sum, as the pipeline does
        losses.append(loss.detach())
    torch.testing.assert_close(torch.stack(losses).mean(), full_loss.detach(), rtol=1e-6, atol=1e-6)
    got = {n: g / 4 for n, g in param_grads(micro).items()}
    if routing != "expert_choice":  # rows pick different counts: packed rows have padding slots
        assert all(b.tokens_computed > b.tokens_routed > 0 for _, b in micro.mod_blocks())
    assert got.keys() == full.keys()
    for name in full:
        torch.testing.assert_close(got[name], full[name], rtol=1e-4, atol=1e-6, msg=name)


def test_lightning_trains_and_the_monitor_sees_the_mod_blocks_moe_mlps():
    model = MoDGPT(GPT_CFG, mod=dict(MOD_CFG, routing="expert_choice"), moe=dict(MOE_CFG, moe_every=2),
                   lr=3e-3, seed=0)
    monitor = MoELoadMonitor(shift_threshold=0.5)
    data = TensorDataset(tokens(32, seed=5), tokens(32, seed=6))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[MixtureOfDepths(capacity=1.0, final_capacity=0.5, anneal_steps=2), monitor])
    trainer.fit(model, DataLoader(data, batch_size=8))
    assert sorted(monitor.last_stats) == [2, 4]  # both MoE MLPs sit in MoD blocks
    for stats in monitor.last_stats.values():
        assert stats["dropped"] == 0.0 and stats["load"] == pytest.approx(1.0)  # dropless, one expert shard
    assert "moe/max_over_mean_load" in trainer.callback_metrics
    model.train()
    model.set_capacity(0.5)
    for _, block in model.mod_blocks():
        block.reset_load(), block.mlp.reset_routing_stats()
    model(tokens(8, seed=7))
    for _, block in model.mod_blocks():
        assert block.load_factor() == pytest.approx(0.5)  # the MoD token fraction, as without MoE
        stats = block.mlp.routing_stats()
        assert int(stats.expert_counts.sum()) == 8 * 8 * 2  # 8 of 16 tokens per row, top-2


def test_expert_parallel_refuses_mod_blocks_that_may_skip_their_experts():
    """Predictor or threshold routing can pick no token of a micro-batch; its block then skips the
    MoE layer, whose token exchange under expert parallelism is a collective of the replicas: the
    strategy's model check refuses it (expert_choice always picks tokens and is accepted)."""
    from lightning_dynmo.models import MoDGPT
    from lightning_dynmo.runtime.expert_parallel import check_expert_parallel_model

    cfg = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    moe = dict(num_experts=4, top_k=2, capacity_factor=None, moe_every=1)
    for routing in ("predictor", "threshold"):
        model = MoDGPT(cfg, mod=dict(every=1, routing=routing, capacity=0.5), moe=moe, seed=0)
        with pytest.raises(ValueError, match="expert_choice"):
            check_expert_parallel_model(model, 2)
        check_expert_parallel_model(model, 1)  # no exchange without expert parallelism
    check_expert_parallel_model(MoDGPT(cfg, mod=dict(every=1, routing="expert_choice", capacity=0.5), moe=moe,
                                       seed=0), 2)
