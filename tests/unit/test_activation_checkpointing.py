"""Activation checkpointing: the cost model's recompute rule, the auto choice (pure), and the
runtime wrapper (exact gradients, RNG replay, refusal of layers that change buffers in forward)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, strategies as st

from lightning_dynmo.models import GPT, GPTConfig
from lightning_dynmo.plan.cost_model import CostModel, LayerCosts, choose_recompute
from lightning_dynmo.plan.partition import Partition
from lightning_dynmo.protocol import is_recomputing
from lightning_dynmo.runtime.recompute import (
    ActivationCheckpointing,
    CheckpointedLayer,
    check_activation_checkpointing,
    saved_activation_bytes,
)
from lightning_dynmo.runtime.memory import layer_state_bytes

COSTS = LayerCosts(forward=(1.0, 2.0, 3.0, 4.0), backward=(2.0, 4.0, 6.0, 8.0), params=(1, 1, 1, 1),
                   memory=(10.0, 10.0, 10.0, 10.0), activation=(100.0, 50.0, 300.0, 40.0))
P = Partition((0, 2, 4))


# ------------------------------------------------------------------ cost model
def test_recomputed_layers_cost_an_extra_forward():
    base = CostModel(microbatches=4)
    rc = base.with_recompute({1, 2})
    assert rc.stage_times(COSTS, P) == [3.0 + 6.0 + 2.0, 9.0 + 12.0 + 3.0]
    assert base.stage_times(COSTS, P) == [9.0, 21.0]
    assert rc.predicted_step_time(COSTS, P) > base.predicted_step_time(COSTS, P)


def test_recomputed_layers_keep_no_activations_in_flight():
    """1F1B, 2 stages: stage 0 holds 2 micro-batches, stage 1 holds 1. A recomputed layer's
    activations drop out of the in-flight sum; the largest recomputed one is alive once."""
    base = CostModel(microbatches=4)
    assert base.stage_memory(COSTS, P) == [20 + 2 * 150, 20 + 1 * 340]
    rc = base.with_recompute({0, 3})
    assert rc.stage_memory(COSTS, P) == [20 + 2 * 50 + 100, 20 + 1 * 300 + 40]
    every = base.with_recompute(range(4))
    assert every.stage_memory(COSTS, P) == [20 + 100, 20 + 300]


def test_empty_recompute_is_the_plain_model_and_bad_indices_are_refused():
    assert CostModel(microbatches=4, recompute=frozenset()) == CostModel(microbatches=4)
    with pytest.raises(ValueError, match="recompute"):
        CostModel(microbatches=4, recompute={-1})
    with pytest.raises(ValueError, match="recompute"):
        CostModel(microbatches=4, recompute="all")
    with pytest.raises(ValueError, match="4 layers"):
        CostModel(microbatches=4, recompute={7}).stage_times(COSTS, P)


@given(st.lists(st.tuples(st.floats(0.01, 10), st.floats(0, 1e3)), min_size=2, max_size=12), st.data())
def test_recompute_is_exact_and_monotone(layers, data):
    n = len(layers)
    costs = LayerCosts(tuple(f for f, _ in layers), tuple(2 * f for f, _ in layers), (1,) * n, (1.0,) * n,
                       tuple(a for _, a in layers))
    rc = frozenset(data.draw(st.sets(st.integers(0, n - 1))))
    model = CostModel(microbatches=4, recompute=rc)
    for start in range(n):
        for stop in range(start + 1, n + 1):
            expect = math.fsum(costs.forward[start:stop]) + math.fsum(costs.backward[start:stop]) \
                + math.fsum(costs.forward[i] for i in rc if start <= i < stop)
            got = model.segment_time(costs, start, stop)
            assert got == pytest.approx(expect, rel=1e-12)
            if stop < n:
                assert model.segment_time(costs, start, stop + 1) >= got
                assert model.segment_memory(costs, start, stop + 1, 0, 2) >= model.segment_memory(costs, start, stop,
                                                                                                  0, 2)


def test_choose_recompute_frees_most_bytes_per_second_first_and_stops_when_it_fits():
    # stage 1 (layers 2, 3) needs 20 + 340 = 360; capacity 330: layer 2 frees 300 B at 3 s (100 B/s),
    # layer 3 frees 40 B at 4 s (10 B/s): recomputing layer 2 alone gives 20 + 40 + 300 = 360 (its
    # transient), not enough, then layer 3 too: 20 + 300 = 320 fits.
    model = CostModel(microbatches=4, capacity=330.0)
    chosen = choose_recompute(COSTS, model, P, stages=[1])
    assert chosen == {2, 3}
    assert model.with_recompute(chosen).fits(model.with_recompute(chosen).stage_memory(COSTS, P)[1])
    # stage 0 needs 20 + 2 x 150 = 320 and fits 330: nothing. Capacity 230: layer 0 (100 B/s) goes
    # first and is enough (20 + 2 x 50 + 100 = 220); capacity 200 needs layer 1 too (20 + 100).
    assert choose_recompute(COSTS, model, P, stages=[0]) == frozenset()
    assert choose_recompute(COSTS, CostModel(microbatches=4, capacity=230.0), P, stages=[0]) == {0}
    assert choose_recompute(COSTS, CostModel(microbatches=4, capacity=200.0), P, stages=[0]) == {0, 1}


def test_choose_recompute_without_capacity_or_beyond_hope():
    assert choose_recompute(COSTS, CostModel(microbatches=4), P) == frozenset()
    hopeless = CostModel(microbatches=4, capacity=1.0)
    assert choose_recompute(COSTS, hopeless, P) == {0, 1, 2, 3}
    assert choose_recompute(COSTS, CostModel(microbatches=4, capacity=1.0, recompute={1}), P, stages=[]) == {1}


def test_option_validation():
    assert check_activation_checkpointing(True, None) is True
    assert check_activation_checkpointing("false", None) is False
    assert check_activation_checkpointing("auto", 1e9) == "auto"
    with pytest.raises(ValueError, match="memory_capacity"):
        check_activation_checkpointing("auto", None)
    with pytest.raises(ValueError, match="True, False or 'auto'"):
        check_activation_checkpointing("sometimes", None)


# ------------------------------------------------------------------ runtime wrapper
def gpt(dropout=0.0, **kw):
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32, dropout=dropout, **kw), seed=0)


def grads_of(model, wrap: set[int], x, y):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    h = x
    for i, layer in enumerate(model.pipeline_layers()):
        h = CheckpointedLayer(layer, i)(h) if i in wrap else layer(h)
    loss = model.pipeline_loss(h, y)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_checkpointed_layers_give_the_same_loss_and_gradients(dropout):
    model = gpt(dropout)
    x = torch.randint(0, 64, (2, 16))
    y = torch.randint(0, 64, (2, 16))
    loss0, g0 = grads_of(model, set(), x, y)
    loss1, g1 = grads_of(model, {0, 1, 2, 3, 4, 5}, x, y)
    assert torch.equal(loss0, loss1)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))  # bitwise: recompute replays the RNG


def test_recompute_is_visible_to_layers_and_eval_runs_plainly():
    seen = []

    class Probe(torch.nn.Linear):
        def forward(self, x):
            seen.append(is_recomputing())
            return super().forward(x)

    layer = CheckpointedLayer(Probe(4, 4), 0)
    x = torch.randn(2, 4, requires_grad=True)
    layer(x).sum().backward()
    assert seen == [False, True] and not is_recomputing()
    with torch.no_grad():
        layer(x)
    assert seen == [False, True, False]


def test_a_layer_that_changes_buffers_in_forward_is_refused():
    layer = CheckpointedLayer(torch.nn.BatchNorm1d(16), 2)  # training updates its running statistics
    with pytest.raises(RuntimeError, match=r"layer 2 .*num_batches_tracked.*activation_checkpointing=False"):
        layer(torch.randn(2, 16, 32))


def test_hash_redraw_changes_no_buffer_in_forward():
    model = gpt(attention=("dense", "hash_sparse", "dense"), hash_redraw=True)
    layer = CheckpointedLayer(model.pipeline_layers()[2], 2)
    x = torch.randn(2, 16, 32, requires_grad=True)
    layer(x).sum().backward()
    ref = x.grad.clone()
    x.grad = None
    model.pipeline_layers()[2](x).sum().backward()
    torch.testing.assert_close(x.grad, ref, rtol=1e-6, atol=1e-7)  # recomputation reproduces the forward


def test_saved_activation_bytes_measures_a_layer_without_side_effects():
    model = gpt(0.1, attention=("dense", "hash_sparse", "dense"), hash_redraw=True)
    block = model.pipeline_layers()[2]
    x = torch.randn(2, 16, 32)
    rng = torch.get_rng_state()
    state = {k: v.clone() for k, v in block.state_dict().items()}
    nbytes = saved_activation_bytes(block, x)
    assert nbytes > 4 * x.numel() * 4  # a block keeps several activations of its input's size
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(v, state[k]) for k, v in block.state_dict().items())
    assert block.training
    wrapped = saved_activation_bytes(CheckpointedLayer(model.pipeline_layers()[1], 1), x)
    assert wrapped < nbytes / 4


def test_auto_policy_recomputes_only_in_stages_over_capacity():
    """Two local stages of a GPT (virtual stages on one rank): a capacity that stage 0 meets and
    stage 1 does not makes only stage 1 recompute, and only as much as needed."""
    from lightning_dynmo.plan.schedules import get_schedule
    from lightning_dynmo.runtime.tensor_specs import TensorSpec

    model = gpt()
    layers = model.pipeline_layers()
    x = torch.randint(0, 64, (2, 16))
    specs, h = [], x
    with torch.no_grad():
        for layer in layers:
            h = layer(h)
            specs.append((TensorSpec.of(h, requires_grad=h.is_floating_point()),))
    spec = get_schedule("gpipe")
    partition = Partition((0, 1, 6))
    state = {i: layer_state_bytes(layers[i]) for i in range(len(layers))}
    probe = ActivationCheckpointing("auto", 1e12, state.__getitem__)
    assert probe.layers_to_recompute(layers, partition, spec, 0, 1, specs, x, 1) == frozenset()
    acts = probe.saved_bytes[((tuple(x.shape), x.dtype),)]
    need1 = sum(state[i] for i in range(1, 6)) + sum(acts[i] for i in range(1, 6))
    policy = ActivationCheckpointing("auto", need1 - 1, state.__getitem__)
    chosen = policy.layers_to_recompute(layers, partition, spec, 0, 1, specs, x, 1)
    assert chosen and chosen <= set(range(1, 6)) and len(chosen) < 5
    assert policy.decisions[0] == frozenset()
    every = ActivationCheckpointing(True, None, state.__getitem__)
    assert every.layers_to_recompute(layers, partition, spec, 0, 1, specs, x, 1) == frozenset(range(6))
