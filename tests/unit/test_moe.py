"""Mixture-of-Experts GPT: routing, capacity, grouped experts, auxiliary losses attached in
backward, exactness under micro-batching, the per-step load signal and the load monitor."""
from __future__ import annotations

import copy
import math

import lightning as L
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch.utils.data import DataLoader, TensorDataset

from lightning_dynmo.callbacks.moe import MoELoadMonitor
from lightning_dynmo.models import GPTConfig, MoEBlock, MoEConfig, MoEGPT, MoELayer
from lightning_dynmo.models._aux_loss import set_aux_loss_scale
from lightning_dynmo.models.moe import TopKRouter, load_balancing_loss, router_z_loss
from lightning_dynmo.protocol import PipelineControl, ReportsLoad

from tests.support.grads import param_grads
from tests.support.tokens import tokens

GPT_CFG = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=True)
MOE_CFG = dict(num_experts=4, top_k=2, capacity_factor=1.0, aux_loss_coeff=0.1, z_loss_coeff=0.01,
               shared_expert=True)


def router_with_logits(num_experts: int, top_k: int, **kw) -> TopKRouter:
    """A router whose logits are its input (gate = identity), for hand-made routing cases."""
    router = TopKRouter(num_experts, MoEConfig(num_experts=num_experts, top_k=top_k, **kw))
    with torch.no_grad():
        router.gate.weight.copy_(torch.eye(num_experts))
    return router


# ---------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "kw, fix",
    [
        (dict(num_experts=2, top_k=3), "lower top_k or raise num_experts"),
        (dict(moe_every=0), "1: every block is MoE"),
        (dict(capacity_factor=0), "use None for dropless"),
        (dict(capacity_factor=-1.5), "use None for dropless"),
        (dict(score_func="relu"), "softmax"),
        (dict(drop_policy="random"), "position"),
        (dict(aux_loss_coeff=-0.1), "0 disables it"),
        (dict(shared_expert=0), "positive hidden size"),
        (dict(expert_ratio=0), "mlp_ratio"),
        (dict(num_experts=0), "num_experts must be >= 1"),
    ],
)
def test_bad_config_names_the_fix(kw, fix):
    with pytest.raises(ValueError, match=fix):
        MoEConfig(**kw)


def test_bad_model_config_names_the_fix():
    with pytest.raises(ValueError, match="use moe_every <= 2"):
        MoEGPT(GPT_CFG, moe=dict(moe_every=3))
    with pytest.raises(ValueError, match="unknown MoEConfig keys"):
        MoEGPT(GPT_CFG, moe=dict(experts=4))


# ---------------------------------------------------------------------------------- router
@settings(derandomize=True, max_examples=25, deadline=None)
@given(
    b=st.integers(1, 3), t=st.integers(1, 9), e=st.integers(1, 6), data=st.data(),
    score_func=st.sampled_from(["softmax", "sigmoid"]), renormalize=st.booleans(),
    capacity_factor=st.one_of(st.none(), st.floats(0.1, 3.0)), drop_policy=st.sampled_from(["probs", "position"]),
)
def test_router_properties(b, t, e, data, score_func, renormalize, capacity_factor, drop_policy):
    k = data.draw(st.integers(1, e))
    router = router_with_logits(e, k, score_func=score_func, renormalize=renormalize,
                                capacity_factor=capacity_factor, drop_policy=drop_policy)
    x = torch.randn(b, t, e, generator=torch.Generator().manual_seed(b * 100 + t * 10 + e))
    r = router(x)
    scores = x.softmax(-1) if score_func == "softmax" else x.sigmoid()
    # each token picks k distinct experts, the k highest scores
    assert r.experts.shape == (b, t, k)
    assert (r.experts.sort(-1).values.diff(dim=-1) > 0).all()
    chosen = scores.gather(-1, r.experts)
    unchosen = scores.scatter(-1, r.experts, -math.inf)
    assert (chosen.min(-1).values >= unchosen.max(-1).values).all()
    assert (r.weights >= 0).all()
    if renormalize:
        torch.testing.assert_close(r.weights.sum(-1), torch.ones(b, t))
    else:
        torch.testing.assert_close(r.weights, chosen)
    torch.testing.assert_close(r.probs.sum(-1), torch.ones(b, t))
    if capacity_factor is None:
        assert r.keep is None
        return
    cap = router.capacity(t)
    assert cap == min(t, math.ceil(capacity_factor * t * k / e))
    kept_per_expert = torch.zeros(b, e, dtype=torch.long).scatter_add_(
        1, r.experts.reshape(b, -1), r.keep.reshape(b, -1).long())
    routed_per_expert = torch.zeros(b, e, dtype=torch.long).scatter_add_(
        1, r.experts.reshape(b, -1), torch.ones(b, t * k, dtype=torch.long))
    # every expert takes min(routed, capacity) tokens of each row
    assert torch.equal(kept_per_expert, routed_per_expert.clamp(max=cap))


def test_capacity_drops_exactly_the_expected_slots():
    # row 0: all four tokens prefer expert 0 with rising confidence; row 1: two tokens per expert
    x = torch.tensor([[[1.0, 0], [2, 0], [3, 0], [4, 0]],
                      [[0.0, 1], [0, 2], [2, 0], [1, 0]]])
    kw = dict(capacity_factor=1.0)  # capacity = ceil(1 * 4 tokens * top-1 / 2 experts) = 2 per row
    by_probs = router_with_logits(2, 1, drop_policy="probs", **kw)(x).keep[..., 0]
    by_position = router_with_logits(2, 1, drop_policy="position", **kw)(x).keep[..., 0]
    assert by_probs.tolist() == [[False, False, True, True], [True, True, True, True]]
    assert by_position.tolist() == [[True, True, False, False], [True, True, True, True]]

    # top-2 of 2 experts, capacity ceil(0.5 * 2 * 2 / 2) = 1: each expert keeps one of the two tokens
    x = torch.tensor([[[2.0, 0], [0, 1]]])
    r = router_with_logits(2, 2, capacity_factor=0.5, drop_policy="probs")(x)
    assert r.experts.tolist() == [[[0, 1], [1, 0]]]
    assert r.keep.tolist() == [[[True, False], [True, False]]]  # each expert keeps its most confident token
    r = router_with_logits(2, 2, capacity_factor=0.5, drop_policy="position")(x)
    assert r.keep.tolist() == [[[True, True], [False, False]]]  # each expert keeps the first token


def test_layer_counts_kept_tokens_per_expert():
    layer = MoELayer(2, 8, MoEConfig(num_experts=2, top_k=1, capacity_factor=1.0, drop_policy="position"))
    with torch.no_grad():
        layer.router.gate.weight.copy_(torch.eye(2))
    x = torch.tensor([[[1.0, 0], [2, 0], [3, 0], [4, 0]], [[0.0, 1], [0, 2], [2, 0], [1, 0]]])
    layer(x)
    for window in (layer.load_window, layer.stats_window):
        assert window.expert_tokens.tolist() == [4, 2]  # row 0 keeps 2 of its 4 expert-0 tokens
        assert (window.forwards, window.tokens, window.causal_pairs) == (1, 8, 2 * (4 * 5 // 2))


# ---------------------------------------------------------------------------------- experts
def _layer_outputs(layer: MoELayer, x: torch.Tensor, grouped: bool):
    layer.experts.grouped_mm = grouped
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = layer(x)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_grouped_mm_path_equals_expert_loop(capacity_factor):
    torch.manual_seed(0)
    layer = MoELayer(32, 64, MoEConfig(**dict(MOE_CFG, capacity_factor=capacity_factor)))
    layer.init_weights(0.02, 0.02)
    if not layer.experts.uses_grouped_mm(torch.float32, torch.device("cpu")):
        pytest.skip("this torch build has no CPU torch._grouped_mm")
    x = torch.randn(3, 11, 32)
    grouped = _layer_outputs(layer, x, True)
    loop = _layer_outputs(layer, x, False)
    torch.testing.assert_close(grouped[0], loop[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grouped[1], loop[1], rtol=1e-6, atol=1e-6)
    for name in loop[2]:
        torch.testing.assert_close(grouped[2][name], loop[2][name], rtol=1e-6, atol=1e-6, msg=name)


def test_unaligned_sizes_fall_back_to_the_loop():
    layer = MoELayer(30, 50, MoEConfig(num_experts=3, top_k=2))  # 30 * 4 bytes is not a multiple of 16
    assert not layer.experts.uses_grouped_mm(torch.float32, torch.device("cpu"))
    layer.experts.grouped_mm = True
    with pytest.raises(RuntimeError, match="set grouped_mm=None"):
        layer(torch.randn(1, 4, 30))


# ---------------------------------------------------------------------------------- aux losses
def test_load_balancing_loss_is_sequence_wise():
    probs = torch.tensor([[[0.7, 0.3], [0.6, 0.4]],   # both tokens -> expert 0: f=(2,0), P=(.65,.35): 1.3
                          [[0.2, 0.8], [0.1, 0.9]]])  # both tokens -> expert 1: f=(0,2), P=(.15,.85): 1.7
    experts = probs.argmax(-1, keepdim=True)
    assert load_balancing_loss(probs, experts, 2).item() == pytest.approx(1.5)
    # the batch-wise form would call this batch perfectly balanced (1.0)
    b, t, e = probs.shape
    assert (torch.bincount(experts.flatten(), minlength=e) * e / (b * t) * probs.mean((0, 1))).sum().item() == \
        pytest.approx(1.0)


def test_router_z_loss_hand_computed():
    logits = torch.tensor([[[0.0, 0.0], [1.0, 1.0]], [[2.0, 0.0], [0.0, 0.0]]])
    lse = [[math.log(2), 1 + math.log(2)], [math.log(math.exp(2) + 1), math.log(2)]]
    expected = sum(sum(v * v for v in row) / 2 for row in lse) / 2
    assert router_z_loss(logits).item() == pytest.approx(expected, rel=1e-6)


@pytest.fixture
def aux_loss_scale():
    yield set_aux_loss_scale
    set_aux_loss_scale(1.0)


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_aux_gradients_equal_adding_the_aux_losses_to_the_loss(scale, aux_loss_scale):
    """Attached in backward == added to the loss; ``scale`` is what accumulate_grad_batches=2
    multiplies the main loss by."""
    model = MoEGPT(GPT_CFG, moe=MOE_CFG, seed=0)
    x, y = tokens(4, seed=1), tokens(4, seed=2)
    aux_loss_scale(scale)
    (model.pipeline_loss(model(x), y) * scale).backward()
    attached = param_grads(model)

    explicit = copy.deepcopy(model)
    explicit.zero_grad(set_to_none=True)
    router_inputs = []
    for _, block in explicit.moe_blocks():
        block.mlp.aux_loss_coeff = block.mlp.z_loss_coeff = 0.0
        block.mlp.register_forward_pre_hook(lambda m, args: router_inputs.append((m, args[0])))
    loss = explicit.pipeline_loss(explicit(x), y)
    for layer, h in router_inputs:
        r = layer.router(h)
        loss = loss + MOE_CFG["aux_loss_coeff"] * load_balancing_loss(r.probs, r.experts, layer.num_experts)
        loss = loss + MOE_CFG["z_loss_coeff"] * router_z_loss(r.logits)
    (loss * scale).backward()
    expected = param_grads(explicit)

    assert attached.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(attached[name], expected[name], rtol=1e-5, atol=1e-7, msg=name)
    ce_only = copy.deepcopy(explicit)  # coefficients 0: what the router would get without the aux terms
    ce_only.zero_grad(set_to_none=True)
    ce_only.pipeline_loss(ce_only(x), y).backward()
    router = "layers.1.mlp.router.gate.weight"
    assert not torch.allclose(param_grads(ce_only)[router], attached[router], atol=1e-6)


@pytest.mark.parametrize("score_func, drop_policy", [("softmax", "probs"), ("sigmoid", "position")])
def test_microbatches_equal_the_full_batch(score_func, drop_policy):
    """What the pipeline does: per-micro-batch mean losses, gradients summed then divided by m."""
    model = MoEGPT(GPT_CFG, moe=dict(MOE_CFG, score_func=score_func, drop_policy=drop_policy), seed=0)
    x, y = tokens(8, seed=3), tokens(8, seed=4)
    full_loss = model.pipeline_loss(model(x), y)
    full_loss.backward()
    full = param_grads(model)
    assert all(b.routing_stats().dropped_fraction > 0 for _, b in model.moe_blocks())  # capacity drops here

    model.zero_grad(set_to_none=True)
    losses = [model.pipeline_loss(model(xm), ym) for xm, ym in zip(x.split(2), y.split(2))]
    for loss in losses:
        loss.backward()
    micro = {n: g / 4 for n, g in param_grads(model).items()}

    assert torch.stack(losses).mean().item() == pytest.approx(full_loss.item(), abs=1e-6)
    assert micro.keys() == full.keys()
    for name in full:
        torch.testing.assert_close(micro[name], full[name], rtol=1e-5, atol=1e-6, msg=name)


# ---------------------------------------------------------------------------------- load signal
def _block_routing_everything_to_expert_0(capacity_factor):
    cfg = GPTConfig(**GPT_CFG)
    block = MoEBlock(cfg, MoEConfig(num_experts=4, top_k=1, capacity_factor=capacity_factor), expert_hidden=64)
    with torch.no_grad():  # router input = ln_2(x) = 1 everywhere; only expert 0's logit is non-zero
        block.ln_2.weight.zero_()
        block.ln_2.bias.fill_(1.0)
        block.mlp.router.gate.weight.zero_()
        block.mlp.router.gate.weight[0] = 1.0
    return block


def test_load_factor_follows_routing():
    block = _block_routing_everything_to_expert_0(capacity_factor=1.0)
    assert isinstance(block, ReportsLoad)
    assert block.load_factor() is None and block.routing_stats() is None
    x = torch.randn(2, 8, 32)
    with torch.no_grad():
        block(x)  # no-grad passes (validation, shape discovery) do not count
    assert block.load_factor() is None
    block(x)
    # capacity ceil(1 * 8 * 1 / 4) = 2 tokens per row: expert 0 keeps 4 of the 16 tokens
    c, t, h, e = 32, 8, 64, 4
    fixed = 16 * (4 * c * c + c * e) + 2 * c * (2 * t * (t + 1) // 2)
    per_slot = 3 * c * h
    expected = (fixed + 4 * per_slot) / (fixed + 16 * per_slot)
    assert block.load_factor() == pytest.approx(expected)
    stats = block.routing_stats()
    assert stats.expert_counts.tolist() == [4, 0, 0, 0]
    assert stats.dropped_fraction == pytest.approx(0.75)
    assert stats.relative_work == pytest.approx(expected)
    block(x)  # a second forward in the same window: the same mean, twice the counts
    assert block.load_factor() == pytest.approx(expected)
    assert block.expert_counts().tolist() == [8, 0, 0, 0]

    block.reset_load()  # the strategy's window restarts; the monitoring window is independent
    assert block.load_factor() is None
    assert block.expert_counts().tolist() == [8, 0, 0, 0]
    block.reset_routing_stats()
    assert block.routing_stats() is None and block.expert_counts().tolist() == [0, 0, 0, 0]

    dropless = _block_routing_everything_to_expert_0(capacity_factor=None)
    dropless(x)
    assert dropless.load_factor() == 1.0 and dropless.routing_stats().dropped_fraction == 0.0
    assert dropless.expert_counts().tolist() == [16, 0, 0, 0]


def test_relative_work_is_set_by_the_busiest_expert_shard():
    """Under expert parallelism the token all_to_all waits for the shard that received most:
    balanced shards (tokens * top_k slots each) cost as dropless routing on one rank, all of a
    group's slots on one of ep shards cost ep times the expert work."""
    block = MoEBlock(GPTConfig(**GPT_CFG), MoEConfig(num_experts=4, top_k=2), expert_hidden=64)
    c, t, h, e, rows, ep = 32, 8, 64, 4, 2, 2
    tokens, pairs = rows * t, rows * t * (t + 1) // 2
    fixed = tokens * (4 * c * c + c * e) + 2 * c * pairs
    per_slot, slots = 3 * c * h, tokens * 2
    assert block.relative_work(tokens, pairs, busiest=slots) == pytest.approx(1.0)
    one_shard = block.relative_work(tokens, pairs, busiest=ep * slots)
    assert one_shard == pytest.approx((fixed + ep * slots * per_slot) / (fixed + slots * per_slot))
    assert 1.0 < block.relative_work(tokens, pairs, busiest=slots + 3) < one_shard


# ---------------------------------------------------------------------------------- model
def test_moe_every_places_moe_blocks_and_seed_fixes_weights():
    model = MoEGPT(dict(GPT_CFG, n_layer=4), moe=dict(MOE_CFG, moe_every=2), seed=0)
    assert [i for i, _ in model.moe_blocks()] == [2, 4]  # blocks 1 and 3 of 0..3 (layer 0 is the embedding)
    again = MoEGPT(dict(GPT_CFG, n_layer=4), moe=dict(MOE_CFG, moe_every=2), seed=0)
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name


def test_state_dict_and_hparams_round_trip():
    model = MoEGPT(GPTConfig(**GPT_CFG), moe=MoEConfig(**MOE_CFG), seed=0)
    assert isinstance(model.hparams["config"], dict) and isinstance(model.hparams["moe"], dict)
    clone = MoEGPT(**model.hparams)
    clone.load_state_dict(model.state_dict())
    assert "layers.1.mlp.experts.w1" in model.state_dict()
    assert "layers.1.mlp.shared_expert.w2.weight" in model.state_dict()
    x = tokens(2)
    torch.testing.assert_close(clone(x), model(x), rtol=0, atol=0)


class PipelineLikeStrategy(SingleDeviceStrategy):
    """A single-device strategy satisfying PipelineControl; records rebalance requests."""

    pipeline_group = None

    def __init__(self):
        super().__init__(device=torch.device("cpu"))
        self.requests: list[str] = []

    def local_layer_indices(self) -> list[int]:
        return list(range(len(self.lightning_module.pipeline_layers())))

    def request_rebalance(self, reason: str = "requested", reprofile: bool = True) -> None:
        self.requests.append(reason)

    def request_repack(self, target="auto") -> None:
        raise AssertionError("not expected")

    def invalidate_pipeline(self) -> None:
        raise AssertionError("not expected")


def test_trains_with_lightning_and_monitor_logs_and_requests_rebalance(tmp_path):
    torch.manual_seed(0)
    data = tokens(16, seed=5, t=17)
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=8, shuffle=False)
    model = MoEGPT(GPT_CFG, moe=MOE_CFG, lr=1e-2, warmup_steps=0, seed=0)

    class Record(L.Callback):
        def __init__(self):
            self.losses: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(float(outputs["loss"]))

    record, monitor, strategy = Record(), MoELoadMonitor(shift_threshold=0.01), PipelineLikeStrategy()
    assert isinstance(strategy, PipelineControl)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=20, strategy=strategy, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[record, monitor], default_root_dir=tmp_path)
    trainer.fit(model, loader)
    assert len(record.losses) == 20
    assert record.losses[-1] < record.losses[0] - 0.5, record.losses
    metrics = trainer.logged_metrics
    for key in ("moe/max_over_mean_load", "moe/dropped_fraction", "moe/aux_loss",
                "moe/max_over_mean_load_L1", "moe/dropped_fraction_L2"):
        assert key in metrics, sorted(metrics)
    assert 0 < float(metrics["moe/dropped_fraction"]) < 1
    assert float(metrics["moe/max_over_mean_load"]) >= 1
    assert set(monitor.last_stats) == {1, 2}
    # capacity drops tokens from the first step on, so the work moved away from the dropless 1.0
    assert strategy.requests and strategy.requests[0].startswith("moe: relative work of layer")
    assert monitor.requests[0]["step"] == 1


def test_monitor_rejects_a_dense_model():
    from lightning_dynmo.models import GPT

    with pytest.raises(TypeError, match="MoEGPT"):
        MoELoadMonitor().setup(None, GPT(GPT_CFG), "fit")
