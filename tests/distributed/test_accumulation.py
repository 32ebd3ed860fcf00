"""``Trainer(accumulate_grad_batches=k)`` through the pipeline equals single-process Lightning with
the same setting: per-batch losses against plain Lightning training, weights, Adam state and
pre-clip gradient norms against single-process training on the pipeline's micro-batches (as in
test_equivalence.py: Adam amplifies fp32 rounding in near-zero gradients). Gradients are clipped
on every optimizer step. Covered: rebalancing (decisions at window starts only: the rebalancer
counts optimizer steps), layers migrating inside a window with their partial gradients, tied
weights, two data-parallel replicas (averaged once per optimizer step) and SGD without clipping
(where a wrong 1 / k or replica divisor shows in the weights).
"""
from __future__ import annotations

import types
import warnings

import lightning as L
import pytest
import torch

from tests.distributed.test_equivalence import BACKWARD_ORDER, CLIP, RTOL, assert_close, migrations
from tests.support.multiproc import run_named_pairs
from tests.support.workers.common import LossRecorder, make_loader, make_model, reference_batches

from lightning_dynmo import GradualPruning
from lightning_dynmo.protocol.activations import run_layers

pytestmark = pytest.mark.slow
K = 2  # batches per optimizer step
STEPS = 3  # optimizer steps (K x STEPS batches)
TIED_TOL = 5e-5  # test_reliability.py's


def lightning_losses(cfg: dict, dp: int) -> list[float]:
    """Per-batch losses of plain single-process Lightning with ``accumulate_grad_batches``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rec = LossRecorder()
        pruning = [GradualPruning(**cfg["pruning"])] if cfg.get("pruning") else []
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=cfg["steps"], logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            limit_val_batches=0, gradient_clip_val=cfg.get("clip"), callbacks=[rec, *pruning],
                            accumulate_grad_batches=cfg["accumulate"])
        trainer.fit(make_model(cfg), train_dataloaders=make_loader(cfg, cfg["batch"] * dp, reference=True, dp=dp))
    finally:
        torch.set_num_threads(threads)
    return rec.losses


class _ReferencePruning:
    """``cfg["pruning"]``'s ``GradualPruning`` driven at the points of a Lightning step (prune at a
    window's start, masks re-applied after the update) in the reference loop below; its trainer
    is a stand-in carrying what the callback reads in one process (the optimizer, the step)."""

    def __init__(self, cfg: dict, model, opt) -> None:
        self.model, self.cb = model, GradualPruning(**dict(cfg["pruning"], storage_density=None))  # masked dense
        self.trainer = types.SimpleNamespace(optimizers=[opt], strategy=types.SimpleNamespace(), global_step=0,
                                             precision="32-true")
        self.cb.setup(self.trainer, model, "fit")
        self.cb.on_train_start(self.trainer, model)

    def before_step(self, step: int) -> None:
        self.trainer.global_step = step
        with warnings.catch_warnings():  # (self.log without a trainer: nothing to log to)
            warnings.simplefilter("ignore")
            self.cb.on_train_batch_start(self.trainer, self.model, None, 0)

    def after_step(self) -> None:
        self.cb.on_train_batch_end(self.trainer, self.model, None, None, 0)


def accumulated_reference(cfg: dict, dp: int, pruning_history: list | None = None):
    """One process, the pipeline's arithmetic: per batch and replica, each micro-batch's loss
    divided by k back-propagated, summed in the schedule's order and divided by the micro-batch
    count; batches added over the window; replicas averaged; clipped; one step per window.
    ``cfg["pruning"]``: with that gradual pruning (its history appended to ``pruning_history``).
    Returns (state dict, optimizer state dict, pre-clip norms)."""
    torch.set_num_threads(1)
    k, m = cfg["accumulate"], cfg["microbatches"]
    model = make_model(cfg)
    layers = model.pipeline_layers()
    conf = model.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    pruning = _ReferencePruning(cfg, model, opt) if cfg.get("pruning") else None
    loader = reference_batches(cfg, dp)
    params = list(model.parameters())
    norms = []
    for step in range(cfg["steps"]):
        if pruning is not None:
            pruning.before_step(step)
        window = [[None] * len(params) for _ in range(dp)]
        for _ in range(k):
            x, y = next(loader)
            for r in range(dp):
                per_mb = []
                for xm, ym in zip(torch.tensor_split(x[r::dp], m), torch.tensor_split(y[r::dp], m)):
                    (model.pipeline_loss(run_layers(layers, model.pipeline_inputs(xm, ym)), ym) / k).backward()
                    per_mb.append([p.grad for p in params])
                    opt.zero_grad(set_to_none=True)
                acc = None
                for j in BACKWARD_ORDER.get(cfg.get("schedule", "1f1b"), lambda m: range(m))(m):
                    acc = list(per_mb[j]) if acc is None else [_add(a, g) for a, g in zip(acc, per_mb[j])]
                batch = [None if a is None else a / m for a in acc]
                window[r] = [_add(w, b) for w, b in zip(window[r], batch)]
        for i, p in enumerate(params):
            g = window[0][i]
            for other in window[1:]:
                g = _add(g, other[i])
            p.grad = g / dp if dp > 1 and g is not None else g  # None: no gradient anywhere, as in Lightning
        if cfg.get("clip"):
            norms.append(float(torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]],
                                                              cfg["clip"])))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if pruning is not None:
            pruning.after_step()
    if pruning is not None and pruning_history is not None:
        pruning_history.extend(pruning.cb.history)
    return {k_: v.clone() for k_, v in model.state_dict().items()}, opt.state_dict(), norms


def _add(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    """A sum of gradients where ``None`` (no gradient) adds nothing."""
    return a if b is None else b if a is None else a + b


def assert_close_tied(a: torch.Tensor, b: torch.Tensor, what: str, kind: str) -> None:
    """As test_reliability.py compares tied GPTs: the pipeline sums a tied gradient per owner,
    then over the owners (one process: per use), so agreement is to fp32 rounding relative to the
    tensor's largest entry, which Adam amplifies in near-zero entries."""
    err = (a.double() - b.double()).abs().max().item() / max(b.double().abs().max().item(), 1e-12)
    assert err <= TIED_TOL, (what, err)


def check_accumulation(res: dict, cfg: dict, replica_averages: int | None = None, close=None) -> None:
    """``replica_averages``: the data-parallel all-reduces expected (default one per optimizer step);
    ``close``: the weight and optimizer-state comparison (default: by ``cfg``, see below)."""
    dp = res["dp"]
    ref = lightning_losses(cfg, dp)
    assert len(res["losses"]) == len(ref) == cfg["steps"] * cfg["accumulate"]
    for i, (a, b) in enumerate(zip(res["losses"], ref)):
        assert abs(a - b) <= RTOL * abs(b), f"batch {i}: pipeline loss {a} != single-process {b}"
    state_ref, optim_ref, norms_ref = accumulated_reference(cfg, dp)
    if cfg.get("clip") and not cfg.get("tied"):  # (the probe counts a tied parameter's two copies)
        torch.testing.assert_close(torch.tensor(res["grad_norms"]), torch.tensor(norms_ref), rtol=RTOL, atol=0)
        assert min(res["grad_norms"]) > cfg["clip"], res["grad_norms"]  # clipping scaled every update
    state = torch.load(res["state"])
    assert set(state) == set(state_ref)
    close = close or (assert_close if not cfg.get("tied") else assert_close_tied)
    for key, v in state_ref.items():
        if torch.is_floating_point(v):
            close(state[key], v, f"weight {key}", "weight")
    if cfg.get("tied"):  # the copies took the same updates
        assert torch.equal(state["layers.0.wte.weight"], state["layers.8.lm_head.weight"])
    optim = torch.load(res["optim"], weights_only=False)
    assert set(optim["state"]) == set(optim_ref["state"])
    for i, st in optim_ref["state"].items():
        for name in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
            if name in st:
                close(optim["state"][i][name], st[name], f"optimizer state {i}.{name}", name)
        if "step" in st:  # one optimizer step per window
            assert float(optim["state"][i]["step"]) == float(st["step"]) == cfg["steps"]
    # one data-parallel average per optimizer step, after the window's last batch
    want = cfg["steps"] if replica_averages is None else replica_averages
    assert res["replica_averages"] == want, res["replica_averages"]


def base(**kw) -> dict:
    cfg = {"pp": 2, "steps": STEPS, "batch": 8, "microbatches": 4, "clip": CLIP, "accumulate": K}
    cfg.update(kw)
    return cfg


# partitions of the 9 layers that every rebalance_to inside a window alternates between
MOVES = [[0, 3, 9], [0, 6, 9]]
TWO_RANK_RUNS = {
    "rebalancing": base(rebalance="every_n", balancer="test_cycle"),
    "mid_window": base(schedule="interleaved_1f1b", partition=[0, 2, 4, 6, 9],
                       mid_window_partitions=[[0, 1, 3, 5, 9], [0, 2, 4, 6, 9]]),
    "mid_window_1f1b": base(partition=MOVES[1], mid_window_partitions=MOVES, accumulate=3),
    "tied": base(tied=True, rebalance="every_n", balancer="test_cycle"),
}
FOUR_RANK_RUNS = {
    "dp2_mid_window": base(partition=MOVES[1], mid_window_partitions=MOVES, rebalance="every_n", balancer="test_cycle"),
    "dp2_sgd_no_clip": base(clip=None, optimizer="sgd", partition=MOVES[1], mid_window_partitions=MOVES),
}


@pytest.fixture(scope="module")
def two_rank(tmp_path_factory):
    return run_named_pairs(tmp_path_factory.mktemp("acc2"), 2, TWO_RANK_RUNS)


@pytest.fixture(scope="module")
def four_rank(tmp_path_factory):
    return run_named_pairs(tmp_path_factory.mktemp("acc4"), 4, FOUR_RANK_RUNS)


def test_accumulation_with_rebalancing_matches_single_process(two_rank):
    cfg, res = two_rank["rebalancing"]
    check_accumulation(res, cfg)
    # a decision before every optimizer step after the first, none inside a window
    assert [h["step"] for h in res["history"]] == list(range(1, STEPS)), res["history"]
    assert migrations(res) == STEPS - 1


@pytest.mark.parametrize("name", ["mid_window", "mid_window_1f1b"])
def test_layers_migrating_inside_a_window_carry_their_partial_gradients(two_rank, name):
    cfg, res = two_rank[name]
    assert res["mid_window_moves"] == STEPS * (cfg["accumulate"] - 1)
    check_accumulation(res, cfg)


def test_accumulation_with_tied_weights(two_rank):
    cfg, res = two_rank["tied"]
    check_accumulation(res, cfg)


def test_two_replicas_average_once_per_optimizer_step(four_rank):
    cfg, res = four_rank["dp2_mid_window"]
    assert res["dp"] == 2 and res["mid_window_moves"] == STEPS
    check_accumulation(res, cfg)


def test_sgd_without_clipping_shows_the_accumulated_scale(four_rank):
    cfg, res = four_rank["dp2_sgd_no_clip"]
    assert res["dp"] == 2
    check_accumulation(res, cfg)
