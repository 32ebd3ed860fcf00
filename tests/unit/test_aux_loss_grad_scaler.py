"""Auxiliary losses attached in backward under an fp16 grad scaler: after ``scaler.unscale_`` their
gradients must equal the unscaled (fp32) ones, not be divided by the scale."""
from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dynmo.models import MoEGPT
from lightning_dynmo.models._aux_loss import (
    attach_aux_loss,
    aux_loss_grad_scaler,
    aux_loss_scale,
    set_aux_loss_grad_scaler,
    set_aux_loss_scale,
)

from tests.support.grads import param_grads

INIT_SCALE = 2.0**10


@pytest.fixture(autouse=True)
def _reset_aux_loss_state():
    """The settings are process-wide: leave them as every other test expects them."""
    set_aux_loss_scale(1.0)
    set_aux_loss_grad_scaler(None)
    yield
    set_aux_loss_scale(1.0)
    set_aux_loss_grad_scaler(None)


class WithAux(nn.Module):
    """``body`` carries the main loss; ``router`` gets gradient only from the attached aux loss,
    ``shared`` from both."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(6, 6)
        self.body = nn.Linear(6, 3)
        self.router = nn.Linear(6, 4)

    def forward(self, x):
        h = torch.tanh(self.shared(x))
        aux = torch.logsumexp(self.router(h), dim=-1).pow(2).mean()
        return attach_aux_loss(self.body(h), aux, 0.3)


def _reference(accumulate: int = 1) -> dict[str, torch.Tensor]:
    """fp32, no scaler: ``d(main + 0.3 * aux) / d(theta)``, each micro-batch's loss divided by ``accumulate``."""
    model = WithAux()
    set_aux_loss_scale(1.0 / accumulate)
    for x in _batches(accumulate):
        (model(x).pow(2).mean() / accumulate).backward()
    grads = param_grads(model)
    assert grads.keys() == dict(model.named_parameters()).keys()  # the router's comes from the aux loss alone
    return grads


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(5, 6, generator=g) for _ in range(n)]


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        # the scale is a power of two, so scaling and unscaling is exact
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=0, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("accumulate", [1, 2])
def test_scaled_main_loss_and_unscale_give_the_fp32_gradients(accumulate):
    want = _reference(accumulate)
    assert want["router.weight"].abs().max() > 1e-3  # the aux loss matters to the comparison

    model = WithAux()
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    set_aux_loss_scale(1.0 / accumulate)
    set_aux_loss_grad_scaler(scaler)
    for x in _batches(accumulate):
        scaler.scale(model(x).pow(2).mean() / accumulate).backward()
    assert model.router.weight.grad.abs().max() > 100 * want["router.weight"].abs().max()  # still scaled
    scaler.unscale_(opt)
    _assert_same(param_grads(model), want)


def test_scale_changes_after_update_are_followed():
    """The scale is read at each backward, not when the scaler is registered."""
    want = _reference()
    model = WithAux()
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    set_aux_loss_grad_scaler(scaler)
    for _ in range(2):
        opt.zero_grad()
        (x,) = _batches(1)
        scaler.scale(model(x).pow(2).mean()).backward()
        scaler.unscale_(opt)
        _assert_same(param_grads(model), want)
        scaler.step(opt)
        scaler.update()
    assert scaler.get_scale() == 4 * INIT_SCALE


def test_a_stage_whose_scaler_has_not_scaled_yet_uses_the_init_scale():
    """A non-last pipeline stage back-propagates a gradient the last stage scaled by its (lazily
    created) ``init_scale`` before its own scaler has scaled anything (Lightning's
    ``pre_backward`` scales the reported loss only afterwards)."""
    want = _reference()
    model = WithAux()
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    set_aux_loss_grad_scaler(scaler)
    (x,) = _batches(1)
    out = model(x)
    (upstream,) = torch.autograd.grad(out.pow(2).mean(), out, retain_graph=True)
    assert scaler._scale is None
    out.backward(upstream * INIT_SCALE)  # what the next stage sends back
    scaler.scale(torch.zeros(()))  # Lightning's pre_backward on this rank
    scaler.unscale_(opt)
    _assert_same(param_grads(model), want)


def test_disabled_or_no_scaler_leaves_the_gradient_alone():
    want = _reference()
    for scaler in (None, torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, enabled=False)):
        model = WithAux()
        set_aux_loss_grad_scaler(scaler)
        (x,) = _batches(1)
        model(x).pow(2).mean().backward()
        _assert_same(param_grads(model), want)


def test_registration_checks_its_argument_and_keeps_the_old_api():
    with pytest.raises(TypeError, match="GradScaler"):
        set_aux_loss_grad_scaler(2.0**16)
    set_aux_loss_scale(0.25)
    assert aux_loss_scale() == 0.25
    scaler = torch.amp.GradScaler("cpu")
    set_aux_loss_grad_scaler(scaler)
    assert aux_loss_grad_scaler() is scaler


# ------------------------------------------------------------------ single-process Lightning

GPT_CFG = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=True)


class _GradAfterUnscale(L.Callback):
    """Gradients as the optimizer sees them (Lightning calls this after ``scaler.unscale_``)."""

    def __init__(self):
        self.grads: dict[str, torch.Tensor] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads = {n: p.grad.detach().float().clone() for n, p in pl_module.named_parameters()
                      if "router" in n and p.grad is not None}
        self.registered = aux_loss_grad_scaler()


def _router_grads(precision, aux_loss_coeff: float, tmp_path) -> tuple[dict[str, torch.Tensor], object]:
    """Router gradients after unscale, and the grad scaler the aux losses used during the step."""
    data = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(3))
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=4)
    moe = dict(num_experts=4, top_k=2, capacity_factor=2.0, aux_loss_coeff=aux_loss_coeff, z_loss_coeff=0.0)
    model = MoEGPT(GPT_CFG, moe=moe, lr=1e-3, warmup_steps=0, seed=0)
    record = _GradAfterUnscale()
    kw = dict(plugins=[precision]) if precision is not None else {}
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[record], default_root_dir=tmp_path, **kw)
    trainer.fit(model, loader)
    assert record.grads
    assert aux_loss_grad_scaler() is None and aux_loss_scale() == 1.0  # on_train_end left nothing behind
    return record.grads, record.registered


def test_lightning_16_mixed_router_gradient_matches_fp32(tmp_path):
    """``precision="16-mixed"`` itself becomes bf16 on CPU, so the fp16 plugin is passed directly."""
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    fp16, registered = _router_grads(MixedPrecision("16-mixed", "cpu", scaler=scaler), 1.0, tmp_path)
    assert registered is scaler  # on_train_start registered the plugin's scaler
    fp32, registered = _router_grads(None, 1.0, tmp_path)
    assert registered is None  # ... and a run without one trains without it
    no_aux, _ = _router_grads(None, 0.0, tmp_path)
    for name, want in fp32.items():
        aux_part = (want - no_aux[name]).norm()
        err = (fp16[name] - want).norm()
        assert aux_part > 0.1 * want.norm(), name  # the aux loss is a sizeable part of the gradient
        assert err < 0.05 * aux_part, (name, float(err), float(aux_part))
