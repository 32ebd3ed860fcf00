"""The one memory rule (runtime/memory.py): what a layer holds through a training step, the
same before its first step, after it and between steps, for each optimizer kind."""
import pytest
import torch
from torch import nn

from lightning_dynmo.runtime.memory import layer_state_bytes


def layer():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4, bias=False))


def param_bytes(m):
    return sum(p.numel() * p.element_size() for p in m.parameters())


def step(m, opt):
    m(torch.randn(3, 8)).square().sum().backward()
    opt.step()


@pytest.mark.parametrize("make, tensors", [
    (lambda ps: torch.optim.AdamW(ps), 2),
    (lambda ps: torch.optim.Adam(ps, amsgrad=True), 3),
    (lambda ps: torch.optim.SGD(ps, lr=0.1), 0),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 1),
    (lambda ps: torch.optim.RMSprop(ps, momentum=0.5, centered=True), 3),
])
def test_the_count_is_the_same_before_the_first_step_after_it_and_between_steps(make, tensors):
    m = layer()
    opt = make(m.parameters())
    expected = (2 + tensors) * param_bytes(m)  # parameters, gradients, state
    before = layer_state_bytes(m, [opt])
    step(m, opt)
    after = layer_state_bytes(m, [opt])
    opt.zero_grad(set_to_none=True)
    between = layer_state_bytes(m, [opt])
    assert before == after == between == expected


def test_without_an_optimizer_or_before_one_is_built():
    m = layer()
    assert layer_state_bytes(m, ()) == 2 * param_bytes(m)  # evaluation: parameters and gradients
    assert layer_state_bytes(m) == 4 * param_bytes(m)  # not built yet: counted as Adam


def test_frozen_parameters_count_themselves_and_the_state_they_still_hold():
    m = layer()
    opt = torch.optim.AdamW(m.parameters())
    step(m, opt)
    frozen = m[2].weight
    frozen.requires_grad_(False)
    frozen.grad = None
    n = frozen.numel() * 4
    assert layer_state_bytes(m, [opt]) == 4 * param_bytes(m) - n  # no gradient; its moments stay
    opt.state.pop(frozen)
    assert layer_state_bytes(m, [opt]) == 4 * param_bytes(m) - 3 * n


def test_buffers_count():
    m = layer()
    m.register_buffer("mask", torch.ones(16, 8, dtype=torch.bool))
    assert layer_state_bytes(m, ()) == 2 * param_bytes(m) + 16 * 8


def test_a_parameter_of_another_layer_in_the_same_optimizer_does_not_count():
    a, b = layer(), layer()
    opt = torch.optim.AdamW([*a.parameters(), *b.parameters()])
    step(a, opt)
    assert layer_state_bytes(a, [opt]) == layer_state_bytes(b, [opt]) == 4 * param_bytes(a)
