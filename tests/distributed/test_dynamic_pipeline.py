"""Dynamism callbacks under DynMoStrategy (2 gloo ranks via torchrun) equal single-process runs,
with a layer migration before every step (masks, frozen flags and exit counters move with layers),
and drive the strategy for real: under ``rebalance="on_event"`` each freezing/pruning request
becomes a decision; pruned layers run the sparse kernel inside the pipeline."""
from __future__ import annotations

import pytest
import torch

from tests.support.multiproc import ROOT, run_worker
from tests.support.workers.common import make_model

pytestmark = pytest.mark.slow
WORKER = ROOT / "tests" / "support" / "workers" / "dynamism_worker.py"
PRUNE = {"final_sparsity": 0.7, "start_step": 0, "n_steps": 3, "frequency": 2, "sparse_kernels": False}
MIGRATE = {"balancer": "test_shift", "rebalance": "every_n", "rebalance_interval": 1}
RUNS = {
    "pruning": (dict(steps=7, batch=8, pruning=PRUNE), MIGRATE),
    # every request moves a layer (the user balancer always shifts a boundary): freezing at step 2,
    # pruning at 3 and 5, tokens exit from step 4 on (requested after it)
    "composed": (dict(steps=7, batch=8, model="early_exit", freezing={"schedule": {"2": 2}},
                      early_exit={"schedule": {"4": 0.0}, "check_interval": 1}, pruning=dict(PRUNE, start_step=1)),
                 {"balancer": "test_shift", "rebalance": "on_event"}),
    # requests only: pruning at steps 3 and 5 (step 1 is the schedule's start: nothing pruned, no
    # request), freezing at steps 2 and 4
    "on_event": (dict(steps=6, batch=8, freezing={"schedule": {"2": 2, "4": 3}},
                      pruning=dict(PRUNE, start_step=1, n_steps=2)),
                 {"balancer": "partition_time", "rebalance": "on_event"}),
    "sparse_kernels": (dict(steps=5, batch=8, pruning=dict(PRUNE, final_sparsity=0.8, n_steps=2, sparse_kernels=True)),
                       MIGRATE),
}
# The single-process references train on the whole batch, not on the pipeline's micro-batches, and
# Adam turns fp32 rounding in near-zero gradients into ~1e-5 differences of the weights (the
# equivalence tests avoid this with a micro-batched reference): rtol 1e-4 plus these absolute
# slacks, about 3x the noise measured here; a lost Adam state or mask differs by ~1e-3.
RTOL = 1e-4
ATOL = {"weight": 5e-5, "exp_avg": 5e-7, "exp_avg_sq": 5e-10}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dyn")
    names = list(RUNS)
    pipe = run_worker(tmp / "pp2", 2, [dict(RUNS[n][0], pp=2, **RUNS[n][1]) for n in names], worker=WORKER)
    ref = run_worker(tmp / "ref", None, [RUNS[n][0] for n in names], worker=WORKER)
    return {n: (p, r) for n, p, r in zip(names, pipe, ref)}


def optimizer_order(cfg: dict) -> list[str]:
    """Parameter name of each index of the single-process optimizer state dict."""
    model = make_model(cfg)
    names = {id(q): n for n, q in model.named_parameters()}
    return [names[id(q)] for g in model.configure_optimizers()["optimizer"].param_groups for q in g["params"]]


def assert_same_state(p: dict, r: dict, cfg: dict, rtol: float = RTOL) -> None:
    """Weights and Adam state element-wise equal single-process training, except entries whose
    pruning mask differs (a tie at the threshold may flip on rounding noise; counted by callers)."""
    sp, sr = torch.load(p["state"]), torch.load(r["state"])
    assert sp.keys() == sr.keys()
    keep = {}
    for k in sr:
        if k.endswith("weight_mask"):
            keep[k.replace("weight_mask", "weight")] = sp[k] == sr[k]
    for k, v in sr.items():
        if torch.is_floating_point(v):
            m = keep.get(k, torch.ones_like(v, dtype=torch.bool))
            torch.testing.assert_close(sp[k][m].double(), v[m].double(), rtol=rtol, atol=ATOL["weight"], msg=k)
    op, orf = torch.load(p["optim"], weights_only=False), torch.load(r["optim"], weights_only=False)
    assert [g["params"] for g in op["param_groups"]] == [g["params"] for g in orf["param_groups"]]
    assert op["state"].keys() == orf["state"].keys()
    names = optimizer_order(cfg)
    for i, st in orf["state"].items():
        m = keep.get(names[i])
        for name in ("exp_avg", "exp_avg_sq"):
            a, b = op["state"][i][name], st[name]
            if m is not None and m.shape == b.shape:
                a, b = a[m], b[m]
            torch.testing.assert_close(a.double(), b.double(), rtol=rtol, atol=ATOL[name], msg=f"{i}.{name}")
        assert float(op["state"][i]["step"]) == float(st["step"])


def test_pruning_pp2_equals_single_process(results):
    p, r = results["pruning"]
    assert len(p["history"]) == 6 and all(h["applied"] for h in p["history"])  # a migration before every step
    hp, hr = p["callbacks"]["pruning"]["history"], r["callbacks"]["pruning"]["history"]
    assert [h["step"] for h in hp] == [h["step"] for h in hr] == [0, 2, 4, 6]
    for a, b in zip(hp, hr):
        assert a["sparsity"] == pytest.approx(b["sparsity"], abs=2e-4)
        assert a["threshold"] == pytest.approx(b["threshold"], rel=1e-4)
    assert hp[-1]["sparsity"] == pytest.approx(0.7, abs=1e-3)
    torch.testing.assert_close(torch.tensor(p["losses"]), torch.tensor(r["losses"]), rtol=1e-5, atol=0)
    sp, sr = torch.load(p["state"]), torch.load(r["state"])
    masks = [k for k in sp if k.endswith("weight_mask")]
    assert len(masks) == 4 * 6
    total = sum(sr[k].numel() for k in masks)
    differ = sum(int((sp[k] != sr[k]).sum()) for k in masks)
    assert differ <= 1e-3 * total  # ties at the threshold may flip on rounding noise; practically equal
    for k in masks:  # pruned weights stay zero on whichever rank the layer ended up
        assert torch.all(sp[k.replace("weight_mask", "weight")][~sp[k]] == 0)
    assert_same_state(p, r, RUNS["pruning"][0])  # weights and Adam state (moved with the layers) as single-process


def test_early_exit_freezing_pruning_compose_under_pipeline(results):
    p, r = results["composed"]
    assert p["callbacks"]["freezing"]["n_frozen"] == 2
    requested = [q["step"] for q in p["callbacks"]["early_exit"]["requests"]]
    requests = [q["step"] for q in r["callbacks"]["early_exit"]["requests"]]
    assert requested and requested[0] == 5 and requested == requests
    assert p["callbacks"]["early_exit"]["last_fractions"][2:7] == r["callbacks"]["early_exit"]["last_fractions"][2:7]
    # every callback's request reached the strategy and moved layers: a decision names each
    reasons = [h["reason"] for h in p["history"]]
    for what in ("freezing:", "pruning:", "early exit:"):
        assert any(what in r for r in reasons), reasons
    assert all(h["applied"] for h in p["history"])
    assert min(h["step"] for h in p["history"] if "early exit:" in h["reason"]) > requested[0]
    torch.testing.assert_close(torch.tensor(p["losses"]), torch.tensor(r["losses"]), rtol=1e-4, atol=1e-4)
    sp, sr = torch.load(p["state"]), torch.load(r["state"])
    for k in sp:
        torch.testing.assert_close(sp[k].float(), sr[k].float(), rtol=1e-4, atol=1e-4, msg=k)


def test_on_event_rebalances_after_each_callback_request(results):
    """The real strategy path of the callbacks: every freezing and pruning request (and nothing
    else) triggers a profiled step and a decision that names it."""
    p, r = results["on_event"]
    freezes = [h["step"] for h in p["callbacks"]["freezing"]["history"]]
    pruning = p["callbacks"]["pruning"]["history"]
    assert [h["step"] for h in pruning] == [1, 3, 5] and pruning[0]["sparsity"] == 0.0
    prunes = [h["step"] for h in pruning[1:]]  # the start of the schedule prunes nothing: no request
    assert freezes == [2, 4], freezes
    decisions = p["history"]
    assert all(h["reason"].startswith("event: ") for h in decisions), decisions
    # both callbacks request at the start of a step: that step is profiled, the next one decides
    events = {s: "freezing:" for s in freezes} | {s: "pruning:" for s in prunes}
    expected = {s + 1: what for s, what in events.items() if s + 1 < 6}
    assert [h["step"] for h in decisions] == sorted(expected), decisions
    for h in decisions:
        assert expected[h["step"]] in h["reason"], h
    torch.testing.assert_close(torch.tensor(p["losses"]), torch.tensor(r["losses"]), rtol=1e-5, atol=0)
    assert_same_state(p, r, RUNS["on_event"][0])


def test_sparse_kernels_under_the_pipeline(results):
    p, r = results["sparse_kernels"]
    # every pruned linear runs the sparse kernel, on whichever rank it lives
    assert sum(p["sparse_kernels_per_rank"]) == r["sparse_kernels_per_rank"][0] == 4 * 6
    assert min(p["sparse_kernels_per_rank"]) > 0
    assert all(h["applied"] for h in p["history"]) and len(p["history"]) == 4
    torch.testing.assert_close(torch.tensor(p["losses"]), torch.tensor(r["losses"]), rtol=1e-5, atol=0)
    assert_same_state(p, r, RUNS["sparse_kernels"][0])
