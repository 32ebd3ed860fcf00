"""Pipeline training equals single-process training: every schedule, with and without data
parallelism, and with a layer migration before every step (the non-negotiable).

Each launch runs several configurations in one torchrun job to keep the suite fast; references
are ordinary single-process Lightning runs of the same module and data.
"""
from __future__ import annotations


import lightning as L
import pytest
import torch

from tests.support.workers.common import make_loader, make_model
from tests.support.multiproc import run_worker

from lightning_dynmo import available_balancers, available_schedules

pytestmark = pytest.mark.slow
SCHEDULES = available_schedules()
RTOL = 1e-5
STEPS = 5


class _Losses(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))


_REF_CACHE: dict = {}
# Order in which a schedule accumulates micro-batch gradients on a stage (default: 0..m-1).
BACKWARD_ORDER = {"looped_bfs": lambda m: reversed(range(m))}


def lightning_reference_losses(cfg: dict, dp: int) -> list[float]:
    """Per-step losses of ordinary single-process Lightning training on the whole batch."""
    key = ("lightning", cfg["steps"], cfg["batch"] * dp, cfg.get("clip"), cfg.get("n_samples"))
    if key not in _REF_CACHE:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            rec = _Losses()
            trainer = L.Trainer(
                accelerator="cpu", devices=1, max_steps=cfg["steps"], logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                gradient_clip_val=cfg.get("clip"), callbacks=[rec],
            )
            trainer.fit(make_model(cfg), train_dataloaders=make_loader(cfg, cfg["batch"] * dp, reference=True))
        finally:
            torch.set_num_threads(threads)
        _REF_CACHE[key] = rec.losses
    return _REF_CACHE[key]


def microbatched_reference(cfg: dict, dp: int):
    """Single-process training with the same micro-batches the pipeline uses (gradients summed
    over micro-batches, divided by their count, averaged over replicas), the module's own
    optimizer and LR schedule, and torch's clip_grad_norm_. Adam amplifies fp32 rounding in
    near-zero gradients, so weights are compared against this reference, which sums in the
    pipeline's order; losses are also compared against plain Lightning training above."""
    key = ("micro", cfg["steps"], cfg["batch"], dp, cfg["microbatches"], cfg.get("clip"), cfg.get("schedule"), cfg.get("n_samples"))
    if key in _REF_CACHE:
        return _REF_CACHE[key]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = make_model(cfg)
        layers = model.pipeline_layers()
        conf = model.configure_optimizers()
        opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
        loader = iter(make_loader(cfg, cfg["batch"] * dp, reference=True))
        m = cfg["microbatches"]
        for _ in range(cfg["steps"]):
            x, y = next(loader)
            opt.zero_grad(set_to_none=True)
            replica_grads = []
            for r in range(dp):
                xr, yr = x[r::dp], y[r::dp]
                per_mb = []
                for xm, ym in zip(torch.tensor_split(xr, m), torch.tensor_split(yr, m)):
                    h = xm
                    for layer in layers:
                        h = layer(h)
                    model.pipeline_loss(h, ym).backward()
                    per_mb.append([p.grad for p in model.parameters()])
                    opt.zero_grad(set_to_none=True)
                order = BACKWARD_ORDER.get(cfg.get("schedule", "1f1b"), lambda m: range(m))(m)
                acc = None
                for j in order:  # accumulate in the order the schedule runs backwards
                    acc = list(per_mb[j]) if acc is None else [a + g for a, g in zip(acc, per_mb[j])]
                replica_grads.append([a / m for a in acc])
            for i, p in enumerate(model.parameters()):
                g = replica_grads[0][i]
                for rg in replica_grads[1:]:
                    g = g + rg[i]
                p.grad = g / dp if dp > 1 else g
            if cfg.get("clip"):
                # Lightning clips the optimizer's parameters in optimizer order
                torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], cfg["clip"])
            opt.step()
            sched.step()
    finally:
        torch.set_num_threads(threads)
    _REF_CACHE[key] = ({k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict())
    return _REF_CACHE[key]


def assert_close_rel(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    a, b = a.double(), b.double()
    scale = max(b.abs().max().item(), 1e-12)
    err = (a - b).abs().max().item() / scale
    assert err <= RTOL, f"{what}: relative error {err:.3g} > {RTOL}"


def check_against_reference(res: dict, cfg: dict) -> None:
    ref_losses = lightning_reference_losses(cfg, res["dp"])
    assert len(res["losses"]) == len(ref_losses) == cfg["steps"]
    for step, (a, b) in enumerate(zip(res["losses"], ref_losses)):
        assert abs(a - b) <= RTOL * abs(b), f"step {step}: pipeline loss {a} != single-process {b}"
    ref_state, ref_optim = microbatched_reference(cfg, res["dp"])
    state = torch.load(res["state"])
    assert set(state) == set(ref_state), "checkpoint keys differ from the single-process model"
    for k, v in ref_state.items():
        if torch.is_floating_point(v):
            assert_close_rel(state[k], v, f"weight {k}")
    optim = torch.load(res["optim"], weights_only=False)
    assert [g["params"] for g in optim["param_groups"]] == [g["params"] for g in ref_optim["param_groups"]]
    assert [g["lr"] for g in optim["param_groups"]] == pytest.approx([g["lr"] for g in ref_optim["param_groups"]])
    assert set(optim["state"]) == set(ref_optim["state"])
    for i, st in ref_optim["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            assert_close_rel(optim["state"][i][name], st[name], f"optimizer state {i}.{name}")
        assert float(optim["state"][i]["step"]) == float(st["step"])


def base(**kw) -> dict:
    cfg = {"pp": 2, "steps": STEPS, "batch": 8, "microbatches": 4, "clip": 1.0}
    cfg.update(kw)
    return cfg


def migrations(res: dict) -> int:
    return sum(1 for r in res["history"] if r.get("applied"))


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    runs = [base(schedule=s, rebalance="every_n", balancer="test_cycle") for s in SCHEDULES]
    runs += [base(schedule="1f1b", rebalance="every_n", balancer=b) for b in available_balancers()]
    runs += [base(schedule="gpipe", clip=None, partition=[0, 1, 9])]  # static, lopsided, no clipping
    return runs, run_worker(tmp_path_factory.mktemp("pp2"), 2, runs)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp2_rebalancing_every_step_matches_single_process(two_rank_results, schedule):
    runs, results = two_rank_results
    i = next(i for i, r in enumerate(runs) if r.get("balancer") == "test_cycle" and r["schedule"] == schedule)
    check_against_reference(results[i], runs[i])
    assert migrations(results[i]) == STEPS - 1, results[i]["history"]


@pytest.mark.parametrize("balancer", available_balancers())
def test_every_balancer_rebalancing_every_step_matches_single_process(two_rank_results, balancer):
    runs, results = two_rank_results
    i = next(i for i, r in enumerate(runs) if r.get("balancer") == balancer and r["schedule"] == "1f1b")
    check_against_reference(results[i], runs[i])
    assert len(results[i]["history"]) == STEPS - 1  # a decision before every step after the first


def test_static_lopsided_partition_without_clipping(two_rank_results):
    runs, results = two_rank_results
    check_against_reference(results[-1], runs[-1])
    assert results[-1]["partition"] == "0-0|1-8"


@pytest.fixture(scope="module")
def four_rank_results(tmp_path_factory):
    runs = [base(schedule=s, rebalance="every_n", balancer="test_cycle") for s in SCHEDULES]  # pp=2 x dp=2
    runs += [base(pp=4, schedule=s, rebalance="every_n", balancer="test_cycle", microbatches=4) for s in ("1f1b", "gpipe")]
    return runs, run_worker(tmp_path_factory.mktemp("pp2dp2"), 4, runs)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp2_dp2_rebalancing_every_step_matches_single_process(four_rank_results, schedule):
    runs, results = four_rank_results
    i = next(i for i, r in enumerate(runs) if r["pp"] == 2 and r["schedule"] == schedule)
    assert results[i]["dp"] == 2
    check_against_reference(results[i], runs[i])
    assert migrations(results[i]) == STEPS - 1


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pp4_rebalancing_every_step_matches_single_process(four_rank_results, schedule):
    runs, results = four_rank_results
    i = next(i for i, r in enumerate(runs) if r["pp"] == 4 and r["schedule"] == schedule)
    check_against_reference(results[i], runs[i])
    assert migrations(results[i]) == STEPS - 1
