"""Sparse storage of pruned layers (CSR values as the master weight, optimizer re-map in place,
dense checkpoints, migration) and Egeria-style progressive freezing, in one process."""
from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dynmo.callbacks import GradualPruning, LayerFreezing
from lightning_dynmo.dynamic import PrunableLinear, global_magnitude_threshold, sparse_kernels_available
from lightning_dynmo.dynamic.freezing import plasticity, snapshot_layer
from lightning_dynmo.models import GPT
from lightning_dynmo.runtime.migration import pack_layer, unpack_layer
from lightning_dynmo.runtime.optimizer_layout import OptimizerLayout, replace_param
from tests.support.workers.common import LossRecorder

CFG = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=True)
KERNELS = [False, True] if sparse_kernels_available() else [False]


def pruned_pair(kernel: bool, seed: int = 0):
    """Two equal PrunableLinears with the same 30 %-dense mask, each with an AdamW that stepped once."""
    torch.manual_seed(seed)
    a = PrunableLinear(24, 16)
    a.set_mask(torch.rand(16, 24) < 0.3)
    b = copy.deepcopy(a)
    opts = []
    for m in (a, b):
        m.set_sparse_kernel(kernel)
        opt = torch.optim.AdamW([{"params": [m.weight], "weight_decay": 0.1}, {"params": [m.bias]}], lr=1e-2)
        m(torch.randn(5, 24, generator=torch.Generator().manual_seed(1))).square().sum().backward()
        opt.step()
        opt.zero_grad()
        m.apply_mask()
        opts.append(opt)
    return a, b, opts


# ---------------------------------------------------------------------------------- storage
@pytest.mark.parametrize("kernel", KERNELS)
def test_compress_keeps_function_and_shrinks_state(kernel):
    dense, csr, (opt_d, opt_c) = pruned_pair(kernel)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.5 ** s) for o in (opt_d, opt_c)]
    groups = list(opt_c.param_groups)
    swap = csr.compress()
    assert replace_param([opt_c], swap.old, swap.new, swap.state_map)
    nnz = dense.nnz
    assert csr.compressed and csr.weight.shape == (nnz,) and csr.nnz == nnz
    assert "weight_mask" not in dict(csr.named_buffers())  # the pattern is the int32 CSR buffers
    assert all(a is b for a, b in zip(opt_c.param_groups, groups)) and opt_c.param_groups[0]["params"] == [csr.weight]
    st = opt_c.state[csr.weight]
    assert st["exp_avg"].shape == (nnz,) and st["exp_avg_sq"].shape == (nnz,) and float(st["step"]) == 1.0
    assert torch.equal(st["exp_avg"], opt_d.state[dense.weight]["exp_avg"][dense.weight_mask])
    x = torch.randn(3, 7, 24)
    for _ in range(3):  # the same training, bitwise: the kept entries' math is elementwise the same
        yd, yc = dense(x), csr(x)
        assert torch.equal(yd, yc)
        yd.square().sum().backward()
        yc.square().sum().backward()
        assert csr.weight.grad.shape == (nnz,)
        for o in (opt_d, opt_c):
            o.step()
            o.zero_grad()
        for sch in scheds:  # the LR schedule drives the very same group dicts as before the swap
            sch.step()
        dense.apply_mask()
    assert opt_c.param_groups[0]["lr"] == opt_d.param_groups[0]["lr"] == 1e-2 * 0.5 ** 3
    assert torch.equal(csr.dense_weight(), dense.dense_weight())
    # state dict: the dense format, bitwise what the dense-stored layer writes
    sd, sc = dense.state_dict(), csr.state_dict()
    assert list(sd) == list(sc) == ["weight", "bias", "weight_mask"]
    assert all(torch.equal(sd[k], sc[k]) for k in sd)
    plain = nn.Linear(24, 16)
    plain.load_state_dict({k: v for k, v in sc.items() if k != "weight_mask"})
    torch.testing.assert_close(plain(x), csr(x), rtol=1e-5, atol=1e-6)
    fresh = PrunableLinear(24, 16)
    fresh.load_state_dict(sc)  # a dense single-process module loads it
    assert torch.equal(fresh.weight, sd["weight"]) and torch.equal(fresh.weight_mask, sd["weight_mask"])
    csr.load_state_dict(sd)  # the same pattern loads into CSR storage in place
    with pytest.raises(RuntimeError, match="pattern differs"):
        csr.load_state_dict({**sd, "weight_mask": torch.ones(16, 24, dtype=torch.bool)})
    # back to dense: the exact inverse
    swap = csr.decompress()
    replace_param([opt_c], swap.old, swap.new, swap.state_map)
    assert torch.equal(csr.weight, dense.weight) and torch.equal(csr.weight_mask, dense.weight_mask)
    assert torch.equal(opt_c.state[csr.weight]["exp_avg"], opt_d.state[dense.weight]["exp_avg"])


@pytest.mark.parametrize("kernel", KERNELS)
def test_pruning_a_csr_layer_gathers_its_state(kernel):
    dense, csr, (opt_d, opt_c) = pruned_pair(kernel)
    swap = csr.compress()
    replace_param([opt_c], swap.old, swap.new, swap.state_map)
    thr = float(dense.kept_values().abs().median())
    assert dense.prune_magnitude(thr) is None  # dense storage: the mask shrinks in place
    swap = csr.prune_magnitude(thr)
    replace_param([opt_c], swap.old, swap.new, swap.state_map)
    assert torch.equal(csr.dense_mask(), dense.weight_mask) and csr.nnz == dense.nnz
    assert torch.equal(opt_c.state[csr.weight]["exp_avg_sq"],
                       opt_d.state[dense.weight]["exp_avg_sq"][dense.weight_mask])
    assert csr.prune_magnitude(-1.0) is None  # nothing to prune: no swap


def test_threshold_counts_pruned_entries_as_zeros():
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(300, generator=g), torch.randn(70, generator=g)]
    masks = [w.abs() > 0.4 for w in ws]
    zeros = sum(int((~m).sum()) for m in masks)
    for s in (0.0, 0.3, 0.5, 0.8, 0.95):
        dense = global_magnitude_threshold([w * m for w, m in zip(ws, masks)], s, distributed=False)
        kept = global_magnitude_threshold([w[m] for w, m in zip(ws, masks)], s, distributed=False, zeros=zeros)
        assert dense == kept


@pytest.mark.parametrize("kernel", KERNELS)
def test_csr_layer_migrates_with_gradient_and_state(kernel):
    _, layer, (_, opt) = pruned_pair(kernel)
    holder = nn.Module()
    holder.layers = nn.ModuleList([nn.Sequential(layer)])
    swap = layer.compress()
    replace_param([opt], swap.old, swap.new, swap.state_map)
    layer(torch.randn(4, 24)).sum().backward()
    layout = OptimizerLayout.record(holder, [opt])
    assert layout.slots["layers.0.0.weight"].index == 0  # the CSR values keep the dense weight's slot
    x = torch.randn(2, 24)
    want, grad, state = layer(x), layer.weight.grad.clone(), copy.deepcopy(opt.state[layer.weight])
    meta, flat = pack_layer(holder.layers[0], "layers.0.", [opt], layout, torch.device("cpu"))
    assert opt.param_groups[0]["params"] == [] and not opt.state  # the sender kept nothing
    moved, states = unpack_layer(meta, flat, torch.device("cpu"))
    holder.layers[0] = moved
    for name, p in moved.named_parameters():
        layout.attach_param([opt], holder, "layers.0." + name, p, states.get(name))
    new = moved[0]
    assert new.compressed and new.sparse_kernel == kernel and torch.equal(new(x), want)
    assert torch.equal(new.weight.grad, grad)
    assert all(torch.equal(opt.state[new.weight][k], v) for k, v in state.items())


# ---------------------------------------------------------------------------------- training
def loader(batches: int = 6, batch: int = 8):
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 64, (batches * batch, 17), generator=g)
    return DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=batch, shuffle=False)


def fit(tmp_path, steps, callbacks, ckpt=None, seed=0):
    """``steps`` optimizer steps over epochs of 6 batches (a resume at step 6 starts epoch 1)."""
    model = GPT(CFG, seed=seed, warmup_steps=1, max_steps=12)
    rec = LossRecorder()
    tr = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                   default_root_dir=tmp_path, callbacks=[rec, *callbacks])
    tr.fit(model, loader(), ckpt_path=ckpt)
    return tr, model, rec.losses


def pruning(**kw):  # prunes at steps 1 (0 %), 3 (78.75 %) and 5 (90 %)
    return GradualPruning(**dict(dict(final_sparsity=0.9, start_step=1, n_steps=2, frequency=2), **kw))


def test_masked_dense_and_csr_storage_train_the_same(tmp_path):
    """Masked dense (dense master weight) and CSR storage (values as the master weight) give the
    same losses and weights, bitwise; CSR's checkpoint is the dense single-process format (model
    and optimizer) and resumes into a dense-stored run on the same curve."""
    _, m_dense, l_dense = fit(tmp_path, 7, [pruning(storage_density=None, sparse_kernels=False)])
    cb = pruning(storage_density=0.5, sparse_kernels=False)
    tr, m_csr, l_csr = fit(tmp_path, 6, [cb])
    mods = [m for m in m_csr.modules() if isinstance(m, PrunableLinear)]
    assert len(mods) == 8 and all(m.compressed for m in mods) and cb.sparsity == pytest.approx(0.9, abs=2e-3)
    mem = cb.state_bytes(tr, m_csr)  # parameters + gradients + Adam moments of the pruned layers
    assert mem["ratio"] < 0.15 and mem["ratio_with_index"] < 0.2, mem
    assert set(cb.history[-1]["densities"]) == {"1", "2"}
    ckpt = tmp_path / "csr.ckpt"
    tr.save_checkpoint(ckpt)
    raw = torch.load(ckpt, weights_only=False)
    sd, opt_sd = raw["state_dict"], raw["optimizer_states"][0]
    assert sd.keys() == m_dense.state_dict().keys()
    assert all(sd[k].shape == v.shape for k, v in m_dense.state_dict().items())
    shapes = [p.shape for g in GPT(CFG).configure_optimizers()["optimizer"].param_groups for p in g["params"]]
    for i, st in opt_sd["state"].items():  # densified: every moment has its dense parameter's shape
        assert st["exp_avg"].shape == shapes[i] and st["exp_avg_sq"].shape == shapes[i]
    _, m_res, l_res = fit(tmp_path, 7, [pruning(storage_density=None, sparse_kernels=False)], ckpt=str(ckpt), seed=1)
    assert l_csr + l_res == l_dense
    for k, v in m_dense.state_dict().items():
        assert torch.equal(m_res.state_dict()[k], v), k
    if sparse_kernels_available():  # the CSR kernel on CSR storage: equal up to summation order
        _, m_k, l_k = fit(tmp_path, 6, [pruning(storage_density=1.0, sparse_kernels=True)])
        assert all(m.compressed and m.sparse_kernel for m in m_k.modules() if isinstance(m, PrunableLinear))
        torch.testing.assert_close(torch.tensor(l_k), torch.tensor(l_dense[:6]), rtol=1e-5, atol=0)


# ---------------------------------------------------------------------------------- freezing
def test_snapshot_and_plasticity():
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4))
    calls = []
    layer.register_forward_hook(lambda *a: calls.append(1))
    layer(torch.randn(2, 8)).sum().backward()
    ref = snapshot_layer(layer, "cpu")
    assert all(not p.requires_grad and p.grad is None for p in ref.parameters())
    assert not ref._forward_hooks and len(layer._forward_hooks) == 1 and not ref.training
    x = torch.randn(3, 8)
    assert plasticity(layer, ref, x) == 0.0
    with torch.no_grad():
        layer[0].weight.add_(0.1)
    want = float((layer(x) - ref(x)).norm() / ref(x).norm())
    calls.clear()
    assert plasticity(layer, ref, x) == pytest.approx(want, rel=1e-6)
    assert calls == []  # the probe bypasses the layer's hooks (a profiler must not count it)


def test_reference_criterion_freezes_front_to_back_progressively(tmp_path):
    cb = LayerFreezing(criterion="reference", threshold=1e9, interval=2, max_frozen=3, max_per_event=1)
    _, model, _ = fit(tmp_path, 10, [cb])  # (two epochs of 6 and 4 steps)
    # references at step 0; plasticity at 2 and 4 -> the embedding freezes after step 4, then one
    # layer per evaluation
    assert [(h["step"], h["n_frozen"]) for h in cb.history] == [(5, 1), (7, 2), (9, 3)]
    assert [any(p.requires_grad for p in layer.parameters()) for layer in model.pipeline_layers()] == \
        [False] * 3 + [True] * 2
    assert all(len(v) >= 2 for k, v in cb.plasticity.items() if k < 3)
    assert not torch.nn.modules.module._global_forward_pre_hooks  # the capture hook is gone
    refs = cb.references(model)
    assert set(refs) <= {3, 4}  # only the window's layers are copied
    assert all(p.device.type == "cpu" and not p.requires_grad for r in refs.values() for p in r.parameters())
    assert all(not any(n.startswith("_dynmo") for n in layer.state_dict()) for layer in model.pipeline_layers())

    strict = LayerFreezing(criterion="reference", threshold=1e-9, interval=2)  # nothing plateaus
    fit(tmp_path, 8, [strict])
    assert strict.n_frozen == 0 and len(strict.plasticity[0]) == 3
    assert LayerFreezing(criterion="reference", threshold=1e-9, interval=2, min_plasticity=10.0)._converged(0) is False
