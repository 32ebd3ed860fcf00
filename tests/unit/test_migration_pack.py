"""The migration executor's packing, in one process: a layer packed on its old owner and unpacked
on the new one (the skeleton pickled as ``send_object_list`` sends it, the bytes as one flat
buffer) carries every kind of state it owns: parameters with ``requires_grad``, buffers (a pruning
mask, integer and 0-dim ones), accumulated gradients and optimizer state (moments, step counts,
non-tensor entries) in two optimizers, back in single-process order. Training on after the
round trip equals training on without it, bitwise. The moves between ranks are
tests/distributed/test_equivalence.py's."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from lightning_dynmo.dynamic.pruning import PrunableLinear
from lightning_dynmo.runtime.migration import pack_layer, unpack_layer
from lightning_dynmo.runtime.optimizer_layout import OptimizerLayout

CPU = torch.device("cpu")
MOVED = 1  # the layer that migrates


class Block(nn.Module):
    """One of each kind of state a layer can own."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = PrunableLinear(5, 3)  # a bool mask buffer of odd length (15) before float entries
        self.norm = nn.BatchNorm1d(3)  # float running stats and an int64 0-dim buffer
        self.frozen = nn.Parameter(torch.randn(3), requires_grad=False)
        self.scale = nn.Parameter(torch.randn(3, dtype=torch.float64))
        self.register_buffer("seen", torch.zeros((), dtype=torch.int32))

    def forward(self, x):
        self.seen += 1
        return self.norm(self.lin(x)) * self.scale.float() + self.frozen


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(5, 5), Block(), nn.Linear(3, 2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def optimizers(model: Model) -> list[torch.optim.Optimizer]:
    """Adam on the linear weights, SGD with momentum (another optimizer, two groups) on the rest."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n]
    rest = [p for n, p in model.named_parameters() if p.requires_grad and not any(p is w for w in weights)]
    adam = torch.optim.Adam(weights, lr=1e-2)
    sgd = torch.optim.SGD([{"params": rest[:2]}, {"params": rest[2:], "lr": 0.05}], lr=0.1, momentum=0.9)
    return [adam, sgd]


def step(model, opts, x, optimize=True):
    model(x).square().mean().backward()
    if optimize:
        for opt in opts:
            opt.step()
            opt.zero_grad()


def trained():
    """A model after two optimizer steps, a pruned mask, a non-tensor state entry and a
    gradient accumulated for the next step; and a deep copy of all of it (the reference)."""
    model = Model()
    opts = optimizers(model)
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(1))
    block = model.layers[MOVED]
    block.lin.prune_to(torch.rand(3, 5, generator=torch.Generator().manual_seed(2)) > 0.4)
    step(model, opts, x)
    step(model, opts, x)
    opts[0].state[block.lin.weight]["note"] = {"pruned_at": 1}
    step(model, opts, x, optimize=False)
    reference, ref_opts = copy.deepcopy((model, opts))
    for p, r in zip(model.parameters(), reference.parameters()):  # (a Parameter's deepcopy drops its grad)
        r.grad = None if p.grad is None else p.grad.clone()
    return model, opts, reference, ref_opts, x


def migrate_in_place(model, opts, keep=frozenset()):
    """What ``execute_migration`` does with one layer on its two ranks, minus the wire."""
    layout = OptimizerLayout.record(model, opts)
    prefix = f"layers.{MOVED}."
    meta, flat = pack_layer(model.layers[MOVED], prefix, opts, layout, CPU, keep)
    meta = pickle.loads(pickle.dumps(meta))  # what send_object_list carries
    layer, states = unpack_layer(meta, flat.clone(), CPU)
    model.layers[MOVED] = layer
    for name, p in layer.named_parameters():
        layout.attach_param(opts, model, prefix + name, p, states.get(name))
    return meta, flat


def assert_state_equal(model, opts, reference, ref_opts):
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        r = ref_params[name]
        assert p.requires_grad == r.requires_grad and p.dtype == r.dtype, name
        torch.testing.assert_close(p.detach(), r.detach(), rtol=0, atol=0, msg=name)
        assert (p.grad is None) == (r.grad is None), name
        if r.grad is not None:
            torch.testing.assert_close(p.grad, r.grad, rtol=0, atol=0, msg=f"{name}.grad")
    ref_buffers = dict(reference.named_buffers())
    assert dict(model.named_buffers()).keys() == ref_buffers.keys()
    for name, b in model.named_buffers():
        assert b.dtype == ref_buffers[name].dtype, name
        torch.testing.assert_close(b, ref_buffers[name], rtol=0, atol=0, msg=name)
    names, ref_names = ({id(p): n for n, p in m.named_parameters()} for m in (model, reference))
    for opt, ref in zip(opts, ref_opts):
        assert [[names[id(p)] for p in g["params"]] for g in opt.param_groups] == \
            [[ref_names[id(p)] for p in g["params"]] for g in ref.param_groups]  # single-process order
        state = {names[id(p)]: s for p, s in opt.state.items()}
        ref_state = {ref_names[id(p)]: s for p, s in ref.state.items()}
        assert state.keys() == ref_state.keys()
        for name, s in state.items():
            assert s.keys() == ref_state[name].keys(), name
            for k, v in s.items():
                if torch.is_tensor(v):
                    assert v.dtype == ref_state[name][k].dtype and v.device == ref_state[name][k].device
                    torch.testing.assert_close(v, ref_state[name][k], rtol=0, atol=0, msg=f"{name}.{k}")
                else:
                    assert v == ref_state[name][k], (name, k)


def test_every_kind_of_state_survives_the_round_trip_and_training_goes_on_bitwise():
    model, opts, reference, ref_opts, x = trained()
    moved = {f"layers.{MOVED}.{n}" for n, _ in model.layers[MOVED].named_parameters()}
    assert any("step" in s for s in opts[0].state.values())  # (Adam's step counts travel too)
    meta, _ = migrate_in_place(model, opts)
    kinds = {kind for kind, *_ in meta["entries"]}
    assert kinds == {"param", "grad", "state", "buffer"}
    assert meta["extras"]["lin.weight"] == {"note": {"pruned_at": 1}}
    assert_state_equal(model, opts, reference, ref_opts)
    assert all(p.device == CPU for p in model.parameters())
    for _ in range(2):  # the gradient accumulated before the move is part of the next step
        for m, o in ((model, opts), (reference, ref_opts)):
            for opt in o:
                opt.step()
                opt.zero_grad()
            step(m, o, x, optimize=False)
    assert_state_equal(model, opts, reference, ref_opts)
    assert moved <= {n for n, _ in model.named_parameters()}


def test_the_sender_lets_go_of_its_optimizer_state_unless_it_keeps_the_parameter():
    model, opts, *_ = trained()
    layout = OptimizerLayout.record(model, opts)
    block = model.layers[MOVED]
    weight, scale = block.lin.weight, block.scale
    adam_before = {k: v.clone() if torch.is_tensor(v) else v for k, v in opts[0].state[weight].items()}
    meta, flat = pack_layer(block, f"layers.{MOVED}.", opts, layout, CPU, keep=frozenset({"lin.weight"}))
    assert weight in opts[0].state and any(p is weight for p in opts[0].param_groups[0]["params"])  # kept
    assert scale not in opts[1].state and not any(p is scale for g in opts[1].param_groups for p in g["params"])
    _, states = unpack_layer(meta, flat, CPU)
    for k, v in adam_before.items():  # a copy of the kept parameter's state travelled
        got = states["lin.weight"][k]
        assert torch.equal(got, v) if torch.is_tensor(v) else got == v
        if torch.is_tensor(v):
            assert got.data_ptr() != opts[0].state[weight][k].data_ptr()


@pytest.mark.parametrize("dtype", [torch.bool, torch.int32, torch.float16])
def test_odd_length_entries_before_wider_ones_unpack_aligned(dtype):
    layer = nn.Module()
    layer.register_buffer("odd", torch.ones(3, dtype=dtype))
    layer.register_buffer("wide", torch.arange(5, dtype=torch.float64))
    layout = OptimizerLayout({}, [])
    meta, flat = pack_layer(layer, "", [], layout, CPU)
    out, _ = unpack_layer(meta, flat, CPU)
    assert torch.equal(out.odd, layer.odd) and torch.equal(out.wide, layer.wide)
