"""N:M (2:4) pruning: the mask rule (hypothesis properties), the schedule's cap, training equal to a
hand-written masked dense run, the 2:4 route's CPU fallback and the measured kernel choice."""
from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dynmo.callbacks import GradualPruning
from lightning_dynmo.dynamic import PrunableLinear
from lightning_dynmo.dynamic.nm_sparsity import nm_droppable, nm_keep, parse_nm, satisfies_nm, \
    transposable_2to4_keep, transposable_droppable
from lightning_dynmo.models import GPT
from lightning_dynmo.models.gpt import Block
from lightning_dynmo.sparse.dispatch import choose_linear_kernel, linear_kernel_candidates
from lightning_dynmo.sparse.semi_structured import is_2to4, semi_structured_unavailable
from tests.support.workers.common import LossRecorder

NM = st.sampled_from([(1, 2), (2, 4), (1, 4), (3, 4), (2, 8), (4, 8)])


@st.composite
def scores_and_pattern(draw):
    n, m = draw(NM)
    rows, groups = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    # few distinct values: ties are common
    vals = draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.5]), min_size=rows * groups * m,
                         max_size=rows * groups * m))
    return torch.tensor(vals).reshape(rows, groups * m), n, m


@settings(max_examples=200, deadline=None)
@given(scores_and_pattern())
def test_nm_keep_keeps_exactly_the_n_largest_ties_to_the_lower_index(case):
    scores, n, m = case
    keep = nm_keep(scores, n, m)
    g, k = scores.reshape(scores.shape[0], -1, m), keep.reshape(scores.shape[0], -1, m)
    assert bool((k.sum(-1) == n).all())  # exactly N per group
    for r in range(g.shape[0]):
        for j in range(g.shape[1]):
            vals = g[r, j].tolist()
            order = sorted(range(m), key=lambda i: (-vals[i], i))  # larger first, then lower index
            assert sorted(order[:n]) == k[r, j].nonzero().flatten().tolist()
    assert torch.equal(nm_keep(scores.clone(), n, m), keep)  # deterministic


@settings(max_examples=100, deadline=None)
@given(scores_and_pattern(), st.integers(0, 2**16))
def test_droppable_never_leaves_the_pattern_and_masks_only_shrink(case, seed):
    w, n, m = case
    w = w * torch.where(torch.rand(w.shape, generator=torch.Generator().manual_seed(seed)) < 0.5, -1.0, 1.0)
    mask = torch.ones_like(w, dtype=torch.bool)
    for _ in range(3):  # repeated pruning of every droppable weight: at most M-N per group, then exactly N:M
        drop = nm_droppable(w, mask, n, m)
        assert not bool((drop & ~mask).any())
        mask = mask & ~drop
        w = w * mask
        assert satisfies_nm(mask, n, m)
        assert bool((mask.reshape(w.shape[0], -1, m).sum(-1) == n).all())
    assert not bool(nm_droppable(w, mask, n, m).any())  # at 1 - N/M nothing more is prunable


def _all_transposable_tiles() -> list:
    """Brute force over all 2^16 4x4 0/1 tiles (independent of the rule's own enumeration)."""
    from itertools import product

    return [bits for bits in product((0, 1), repeat=16)
            if all(sum(bits[4 * r:4 * r + 4]) == 2 for r in range(4)) and all(sum(bits[c::4]) == 2 for c in range(4))]


TILES = _all_transposable_tiles()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.5]), min_size=16, max_size=16))
def test_transposable_tile_is_the_best_of_all_90(vals):
    assert len(TILES) == 90
    scores = torch.tensor(vals).reshape(4, 4)
    keep = transposable_2to4_keep(scores)
    assert satisfies_nm(keep, 2, 4) and satisfies_nm(keep.t().contiguous(), 2, 4)
    best = max(sum(v for v, b in zip(vals, bits) if b) for bits in TILES)
    assert float(scores[keep].sum()) == best


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.integers(0, 2**16))
def test_transposable_droppable_only_shrinks_and_ends_transposable(rt, ct, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(4 * rt, 4 * ct, generator=gen)
    mask = torch.ones_like(w, dtype=torch.bool)
    for _ in range(3):  # prune a random part of the droppable weights, then train (perturb), again
        drop = transposable_droppable(w, mask)
        assert not bool((drop & ~mask).any())
        mask &= ~(drop & (torch.rand(w.shape, generator=gen) < 0.5))
        w = (w + torch.randn(w.shape, generator=gen)) * mask
    mask &= ~transposable_droppable(w, mask)
    assert mask.float().mean() == 0.5
    assert satisfies_nm(mask, 2, 4) and satisfies_nm(mask.t().contiguous(), 2, 4)


def test_pattern_parsing_and_cap():
    assert parse_nm("2:4") == (2, 4) and parse_nm("unstructured") is None and parse_nm(None) is None
    for bad in ("4:2", "2:2", "0:4", "two:four", "2-4", "1:2:4"):
        with pytest.raises(ValueError, match="pattern"):
            parse_nm(bad)
    GradualPruning(final_sparsity=0.5, pattern="2:4")
    GradualPruning(final_sparsity=0.5, pattern="2:4T")
    with pytest.raises(ValueError, match="capped"):
        GradualPruning(final_sparsity=0.51, pattern="2:4T")
    with pytest.raises(ValueError, match=r"capped at 1 - N/M = 0.5"):
        GradualPruning(final_sparsity=0.6, pattern="2:4")
    with pytest.raises(ValueError, match="divisible by 4"):
        nm_keep(torch.zeros(2, 6), 2, 4)


# ---------------------------------------------------------------------------------- training
CFG = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=True)
PRUNE = dict(final_sparsity=0.5, start_step=1, n_steps=2, frequency=2)  # 0 %, 43.75 %, 50 % at steps 1, 3, 5
STEPS = 7


def batches():
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 64, (STEPS * 8, 17), generator=g)
    return DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=8, shuffle=False)


def hand_written_masked_dense() -> tuple[list[float], dict]:
    """The schedule written out by hand: plain PyTorch, masks from a sort (not the pairwise rule),
    threshold from ``kthvalue`` over all weights, forward on ``weight * mask``."""
    model = GPT(CFG, seed=0, warmup_steps=1, max_steps=12)
    conf = model.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    linears = {f"{i}.{n}": m for i, layer in enumerate(model.pipeline_layers()) if isinstance(layer, Block)
               for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
    masks = {k: torch.ones_like(m.weight, dtype=torch.bool) for k, m in linears.items()}
    handles = [m.register_forward_pre_hook(lambda mod, args, k=k: setattr(mod, "_m", masks[k]))
               for k, m in linears.items()]
    for m in linears.values():  # forward with the masked weight
        m.forward = lambda x, m=m: F.linear(x, m.weight * m._m, m.bias)
    losses = []
    for step, (x, y) in enumerate(batches()):  # Lightning prunes at on_train_batch_start of these steps
        if step in (1, 3, 5):
            s = 0.5 + (0.0 - 0.5) * (1 - (step - 1) / 4) ** 3
            drops, ranked = {}, []
            with torch.no_grad():
                for k, m in linears.items():
                    w = m.weight.abs()
                    key = torch.where(masks[k], w, torch.full_like(w, -1.0)).reshape(w.shape[0], -1, 4)
                    order = key.sort(dim=-1, descending=True, stable=True).indices
                    top2 = torch.zeros_like(key, dtype=torch.bool).scatter_(-1, order[..., :2], True)
                    drops[k] = masks[k] & ~top2.reshape(w.shape)
                    ranked.append(torch.where(drops[k], w, torch.where(masks[k], torch.inf, 0.0)).flatten())
                allw = torch.cat(ranked)
                kk = round(s * allw.numel())
                if kk > 0:
                    thr = allw.kthvalue(kk).values
                    for k, m in linears.items():
                        masks[k] &= ~(drops[k] & (m.weight.abs() <= thr))
                        m.weight.mul_(masks[k])
        loss = model.lm_loss(x, y)
        losses.append(float(loss.detach()))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        with torch.no_grad():
            for k, m in linears.items():
                m.weight.mul_(masks[k])
    for h in handles:
        h.remove()
    return losses, masks


def test_two_four_training_equals_hand_written_masked_dense(tmp_path):
    rec, cb = LossRecorder(), GradualPruning(pattern="2:4", sparse_kernels="auto", **PRUNE)
    model = GPT(CFG, seed=0, warmup_steps=1, max_steps=12)
    tr = L.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                   default_root_dir=tmp_path, callbacks=[rec, cb])
    tr.fit(model, batches())
    ref_losses, ref_masks = hand_written_masked_dense()
    mods = {f"{i}.{n}": m for i, layer in enumerate(model.pipeline_layers()) for n, m in layer.named_modules()
            if isinstance(m, PrunableLinear)}
    assert mods.keys() == ref_masks.keys() and len(mods) == 8
    for k, m in mods.items():
        assert not m.compressed and is_2to4(m.weight_mask) and m.density == 0.5, k  # exactly 2:4, dense-stored
        assert torch.equal(m.weight_mask, ref_masks[k]), k
        assert not m.semi_structured  # on CPU the 2:4 route does not exist: never chosen
    assert [h["target"] for h in cb.history] == pytest.approx([0.0, 0.4375, 0.5])
    assert cb.sparsity == 0.5
    torch.testing.assert_close(torch.tensor(rec.losses), torch.tensor(ref_losses), rtol=1e-6, atol=0)
    assert len(set(rec.losses)) == STEPS  # training moved
    assert cb.history[1]["sparsity"] == pytest.approx(0.4375, abs=1e-3)  # the gradual step pruned, not N:M yet


def test_transposable_pattern_trains_to_an_exact_transposable_mask(tmp_path):
    cb = GradualPruning(pattern="2:4T", **PRUNE)
    model = GPT(CFG, seed=0, warmup_steps=1, max_steps=12)
    tr = L.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                   default_root_dir=tmp_path, callbacks=[cb])
    tr.fit(model, batches())
    mods = [m for m in model.modules() if isinstance(m, PrunableLinear)]
    assert len(mods) == 8 and cb.sparsity == 0.5
    for m in mods:
        assert m.density == 0.5 and is_2to4(m.weight_mask) and is_2to4(m.weight_mask.t().contiguous())
        assert bool((m.weight[~m.weight_mask] == 0).all())


def test_gpt_with_indivisible_linears_fails_early(tmp_path):
    model = GPT(dict(CFG, n_embd=30, n_head=2), seed=0)
    tr = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                   callbacks=[GradualPruning(pattern="2:4", **PRUNE)])
    with pytest.raises(ValueError, match="not divisible by 4.*layer_filter"):
        tr.fit(model, batches())


# ---------------------------------------------------------------------------------- 2:4 route on CPU
def test_two_four_route_falls_back_to_masked_dense_on_cpu():
    torch.manual_seed(0)
    layer = PrunableLinear(64, 32)
    layer.set_mask(nm_keep(layer.weight.abs(), 2, 4))
    ref = PrunableLinear(64, 32)
    ref.load_state_dict(layer.state_dict())
    layer.set_semi_structured(True)
    x = torch.randn(5, 64, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    for dtype in (torch.float32, torch.bfloat16):
        assert "CUDA" in layer.semi_structured_unavailable(x.device, dtype)
    y, yr = layer(x), ref(xr)
    assert torch.equal(y, yr)  # the same math: masked dense
    y.square().sum().backward()
    yr.square().sum().backward()
    assert torch.equal(layer.weight.grad, ref.weight.grad) and torch.equal(x.grad, xr.grad)
    assert layer._semi_cache is None  # the compressed route never ran
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(layer(x), ref(x))
    # the choice: on CPU 2:4 is never a candidate, whatever the dtype or override
    assert "2:4" not in linear_kernel_candidates(64, 32, "cpu", torch.bfloat16, 0.5, two_four=True)
    assert semi_structured_unavailable("cpu", torch.bfloat16, 32, 64) is not None


def test_kernel_choice_override_and_candidates(monkeypatch):
    monkeypatch.setenv("LDSPARSE_KERNEL", "2:4")  # cannot run on CPU: dense
    assert choose_linear_kernel(64, 32, 256, "cpu", torch.float32, 0.5, two_four=True) == "dense"
    monkeypatch.setenv("LDSPARSE_KERNEL", "bogus")
    with pytest.raises(ValueError, match="LDSPARSE_KERNEL"):
        choose_linear_kernel(64, 32, 256, "cpu", torch.float32, 0.5)
    monkeypatch.delenv("LDSPARSE_KERNEL")
    monkeypatch.setenv("LDSPARSE_CROSSOVER", "0.0")  # CSR never wins
    assert choose_linear_kernel(64, 32, 256, "cpu", torch.float32, 0.5) == "dense"
    from lightning_dynmo.sparse import extension_available
    if extension_available():
        monkeypatch.setenv("LDSPARSE_CROSSOVER", "1.0")  # CSR wins below density 1
        assert choose_linear_kernel(64, 32, 256, "cpu", torch.float32, 0.5) == "csr"
        assert choose_linear_kernel(64, 32, 256, "cpu", torch.float32, 1.0) == "dense"


def test_semi_structured_backend_choice_is_validated(monkeypatch):
    """LDSPARSE_SEMI_BACKEND picks torch's CUTLASS or cuSPARSELt 2:4 kernels; anything else is an error
    that names the choices (not a silent fallback)."""
    from lightning_dynmo.sparse.semi_structured import semi_structured_backend
    if not hasattr(torch.sparse, "SparseSemiStructuredTensorCUTLASS"):
        pytest.skip("this torch has no semi-structured tensors")
    monkeypatch.setenv("LDSPARSE_SEMI_BACKEND", "cutlass")
    assert semi_structured_backend() is torch.sparse.SparseSemiStructuredTensorCUTLASS
    monkeypatch.setenv("LDSPARSE_SEMI_BACKEND", "cusparse")
    with pytest.raises(ValueError, match="LDSPARSE_SEMI_BACKEND must be one of"):
        semi_structured_backend()
