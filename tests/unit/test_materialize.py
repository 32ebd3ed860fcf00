"""Meta-device initialisation (lightning_dynmo.runtime.materialize): a layer materialised on its
own equals the same layer of a model built on a real device, optimizers are re-bound, and a model
that cannot be materialised says why."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dynmo.models import GPT, GPTConfig
from lightning_dynmo.protocol import RemoteLayer
from lightning_dynmo.protocol import MaterializationError, layer_seed
from lightning_dynmo.runtime.materialize import has_meta_tensors, materialize_pipeline
from lightning_dynmo.runtime.optimizer_layout import OptimizerLayout

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32, mlp_ratios=(1, 4, 2, 3),
                attention=("dense", "hash_sparse", "dense", "dense"))


def meta_gpt(**kw) -> GPT:
    with torch.device("meta"):
        return GPT(CFG, seed=3, **kw)


def test_meta_gpt_has_no_storage_but_a_real_metric():
    model = meta_gpt()
    assert all(p.is_meta for p in model.parameters())
    assert not model.val_loss_mean.mean_value.is_meta


@pytest.mark.parametrize("own", [[0, 1], [2, 3, 4], [5, 6], list(range(7))])
def test_each_rank_materialises_exactly_the_single_process_values(own):
    reference = GPT(CFG, seed=3)
    model = meta_gpt()
    layers = model.pipeline_layers()
    for i in range(len(layers)):
        if i not in own:
            layers[i] = RemoteLayer(i)
    stats = materialize_pipeline(model, layers, own)
    assert stats.layers == tuple(own) and stats.bytes > 0
    assert not has_meta_tensors(model)
    ref = reference.state_dict()
    state = model.state_dict()
    assert set(state) == {k for k in ref if int(k.split(".")[1]) in own}
    for k, v in state.items():
        assert torch.equal(v, ref[k]), k  # bitwise, buffers (hash rotations, hash_step) included


def test_values_do_not_depend_on_dtype_of_the_meta_model():
    """Precision plugins convert the (meta) module before it is materialised: a bf16 layer gets the
    fp32 single-process values rounded, as ``GPT(...).to(torch.bfloat16)`` gives."""
    reference = GPT(CFG, seed=3).to(torch.bfloat16)
    model = meta_gpt().to(torch.bfloat16)
    materialize_pipeline(model, model.pipeline_layers(), range(7))
    for k, v in model.state_dict().items():
        assert v.dtype == reference.state_dict()[k].dtype and torch.equal(v, reference.state_dict()[k]), k


def test_seed_none_draws_the_base_seed_from_the_global_rng():
    torch.manual_seed(11)
    a = GPT(CFG)
    torch.manual_seed(11)
    with torch.device("meta"):
        b = GPT(CFG)
    materialize_pipeline(b, b.pipeline_layers(), range(7))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert layer_seed(0, 1) != layer_seed(0, 2) != layer_seed(1, 1)


def test_optimizer_is_recorded_on_meta_and_rebound_to_local_parameters():
    """The strategy's order: configure_optimizers and OptimizerLayout.record on the full meta model,
    drop remote layers, keep local params, materialise, re-bind. The optimizer then steps the real
    parameters exactly as one built on them."""
    model = meta_gpt()
    opt = model.configure_optimizers()["optimizer"]
    layout = OptimizerLayout.record(model, [opt])
    layers = model.pipeline_layers()
    own = [3, 4, 5, 6]
    for i in range(3):
        layers[i] = RemoteLayer(i)
    OptimizerLayout.keep_only_local(model, [opt])
    materialize_pipeline(model, layers, own, [opt])
    in_opt = [p for g in opt.param_groups for p in g["params"]]
    assert not any(p.is_meta for p in in_opt)
    assert {id(p) for p in in_opt} == {id(p) for p in model.parameters()}
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    positions, total = layout.positions(model, [opt], opt)
    assert total == sum(1 for _ in GPT(CFG, seed=3).parameters()) and len(positions) == len(in_opt)

    reference = GPT(CFG, seed=3)
    ref_opt = reference.configure_optimizers()["optimizer"]
    x = torch.randn(2, 16, 32)
    for m, o in ((model, opt), (reference, ref_opt)):
        h = x
        for i in own:
            h = m.pipeline_layers()[i](h)
        h.square().mean().backward()
        o.step()
    ref = reference.state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref[k]), k


def test_after_layer_sees_each_layer_real_and_its_optimizer_slots_rebound_before_the_next_is_allocated():
    """``dp_sharding="fsdp"`` shards in ``after_layer``: at that moment layer i must be real, its
    parameters already in the optimizer, and the later local layers still on the meta device (so
    a stage is never whole at once)."""
    model = meta_gpt()
    opt = model.configure_optimizers()["optimizer"]
    layers = model.pipeline_layers()
    own = [2, 3, 4]
    for i in range(len(layers)):
        if i not in own:
            layers[i] = RemoteLayer(i)
    OptimizerLayout.keep_only_local(model, [opt])
    seen = []

    def after(i):
        in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
        seen.append(i)
        assert not has_meta_tensors(layers[i])
        assert all(id(p) in in_opt for p in layers[i].parameters())
        assert all(has_meta_tensors(layers[j]) for j in own if j > i)

    materialize_pipeline(model, layers, own, [opt], after_layer=after)
    assert seen == own and not has_meta_tensors(model)


class NoInit(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])


class PartialInit(NoInit):
    def init_pipeline_layer(self, index, layer):
        layer.weight.normal_()  # forgets the bias


def test_a_model_without_init_pipeline_layer_is_refused_with_the_fix():
    with torch.device("meta"):
        model = NoInit()
    with pytest.raises(MaterializationError, match="does not define init_pipeline_layer"):
        materialize_pipeline(model, model.layers, [0, 1])


def test_an_incomplete_init_names_the_tensor_it_missed():
    with torch.device("meta"):
        model = PartialInit()
    with pytest.raises(MaterializationError, match=r"layer 0 .*\['bias'\]"):
        materialize_pipeline(model, model.layers, [0])


def test_meta_state_outside_the_layers_is_named():
    with torch.device("meta"):
        model = PartialInit()
        model.register_buffer("scale", torch.ones(()))
    model.init_pipeline_layer = lambda index, layer: [t.zero_() for t in layer.parameters()]
    with pytest.raises(MaterializationError, match="scale"):
        materialize_pipeline(model, model.layers, [0, 1])


def test_tied_meta_parameters_are_refused():
    with torch.device("meta"):
        model = PartialInit()
    model.layers[1].weight = model.layers[0].weight
    with pytest.raises(MaterializationError, match="tied"):
        materialize_pipeline(model, model.layers, [0, 1])


def test_a_real_model_is_left_alone():
    model = GPT(CFG, seed=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert materialize_pipeline(model, model.pipeline_layers(), range(7)) is None
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
