"""The dynamism cases not covered elsewhere under ``dp_sharding="fsdp"``, pp2 x dp2 on 4 CPU ranks
(gloo), a layer migration before every step, one torchrun job (tests/support/workers/cases_worker.py
runs each case with its own worker): each case under fsdp against the same case under
``replicate`` on the same layout (fp32 rounding) and against single-process training on the
global batch (losses, weights, Adam state: keys, step counts and moments).

* early exit driven by the ``EarlyExit`` callback, which sets the exit threshold on the blocks
  at every step: a block that migrates must arrive with the threshold (and counters) the
  callback left on it, as the callbacks' other settings (MoD's annealed capacity) must; against
  ``replicate`` only (the callback through the pipeline against one process:
  test_dynamic_pipeline.py);
* dynamic sparse attention (hash-bucketed block-sparse layers with their own bucket counts,
  ``SparseAttentionMonitor`` asking for rebalances);
* mixture of depths (``MoDGPT``, predictor routing, the ``MixtureOfDepths`` callback annealing the
  capacity and asking for rebalances);
* MoE with a dropless router under ``expert_parallel=2`` (the capacity-limited router under
  fsdp + EP is test_moe_expert_parallel.py's);
* ``bf16-mixed``: MoE with the capacity-limited router under ``expert_parallel=2`` and MoD with
  expert-choice routing, against ``replicate`` in ``bf16-mixed``.

The other cases under fsdp: layer freezing and gradual pruning in test_fsdp_composition.py, early
exit against one process (layers no token reaches) in test_fsdp.py, the capacity router under EP in
test_moe_expert_parallel.py, experts without tokens in test_fsdp_moe.py.
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.distributed.test_accumulation import check_accumulation
from tests.distributed.test_equivalence import assert_close, migrations
from tests.distributed.test_moe_pipeline import MOE
from tests.support.multiproc import ROOT, run_worker

pytestmark = pytest.mark.slow
WORKER = ROOT / "tests" / "support" / "workers" / "cases_worker.py"
STEPS = 3
MIGRATE = dict(pp=2, schedule="1f1b", microbatches=4, rebalance="every_n", rebalance_interval=1)
SPARSE = {"attention": ["hash_sparse", "dense", "hash_sparse", "hash_sparse", "dense", "hash_sparse"],
          "attention_block": 16, "nb_hash": [2, 1, 4, 3, 1, 2]}
MOD_CALLBACK = {"capacity": 1.0, "final_capacity": 0.25, "anneal_steps": 2, "drift": 0.1}
CASES = {
    # the EarlyExit callback sets the threshold on the blocks at every step (the model starts
    # without one): on the first step 56 % of the tokens leave after block 1, fewer later
    "early_exit_callback": dict(worker="pipeline", early_exit_gpt={"exit_layers": [1, 3]},
                                early_exit={"threshold": 0.99, "check_interval": 1, "drift": 0.05},
                                batch=8, clip=0.3, accumulate=1, balancer="test_cycle"),
    "sparse_attention": dict(worker="pipeline", gpt=SPARSE, block=64, sparse_monitor={"shift_threshold": 0.02},
                             batch=8, clip=0.2, accumulate=1, balancer="test_cycle"),
    "mod": dict(worker="mod", mod={"routing": "predictor", "capacity": 0.25, "every": 2, "predictor_loss_coeff": 0.1},
                callback=MOD_CALLBACK, batch=8, clip=0.3, balancer="test_shift"),
    "moe_dropless_ep2": dict(worker="moe", moe=dict(MOE, capacity_factor=None), expert_parallel=2, n_layer=4,
                             batch=8, clip=0.3, balancer="test_shift"),
}
BF16 = {
    "moe_capacity_ep2_bf16": dict(CASES["moe_dropless_ep2"], moe=MOE, precision="bf16-mixed"),
    "mod_bf16": dict(CASES["mod"], mod=dict(CASES["mod"]["mod"], routing="expert_choice"), precision="bf16-mixed"),
}
SINGLE_PROCESS = ["mod", "moe_dropless_ep2"]  # their workers' own references (sparse attention: in-process)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp_dynamism")
    cases = dict(CASES, **BF16)
    specs = [dict(cfg, **MIGRATE, steps=STEPS, dp_sharding=mode) for cfg in cases.values()
             for mode in ("fsdp", "replicate")]
    runs = iter(run_worker(tmp / "pp2dp2", 4, specs, worker=WORKER, timeout=600))
    out = {name: {mode: next(runs) for mode in ("fsdp", "replicate")} for name in cases}
    refs = run_worker(tmp / "ref", None, [dict(CASES[n], steps=STEPS, dp=2) for n in SINGLE_PROCESS], worker=WORKER)
    for name, ref in zip(SINGLE_PROCESS, refs):
        out[name]["one_process"] = ref
    return out


def _states(res: dict) -> tuple[dict, dict]:
    return torch.load(res["state"]), torch.load(res["optim"], weights_only=False)


def _same(res: dict, ref: dict, close, *, rtol: float) -> None:
    """Losses to ``rtol``; weights and Adam state (keys, step counts, moments) by ``close``."""
    assert len(res["losses"]) == len(ref["losses"]) == STEPS
    for a, b in zip(res["losses"], ref["losses"]):
        assert math.isfinite(a) and abs(a - b) <= rtol * abs(b), (res["losses"], ref["losses"])
    (state, optim), (state_ref, optim_ref) = _states(res), _states(ref)
    assert state.keys() == state_ref.keys()
    for key, v in state_ref.items():
        if torch.is_floating_point(v):
            assert state[key].dtype == v.dtype, key
            close(state[key], v, f"weight {key}", "weight")
    assert optim["state"].keys() == optim_ref["state"].keys()
    for i, st in optim_ref["state"].items():
        assert float(optim["state"][i]["step"]) == float(st["step"]), i
        for name in ("exp_avg", "exp_avg_sq"):
            close(optim["state"][i][name], st[name], f"optimizer state {i}.{name}", name)


def _moved_every_step(res: dict) -> None:
    assert migrations(res) == STEPS - 1, res["history"]


def _relative(tol: float):
    """Agreement to ``tol`` of each tensor's largest entry: fp32 rounding (summed per shard under
    fsdp, per replica under replicate), which Adam amplifies in near-zero entries."""
    def close(a: torch.Tensor, b: torch.Tensor, what: str, kind: str) -> None:
        err = (a.double() - b.double()).abs().max().item() / max(b.double().abs().max().item(), 1e-30)
        assert err <= tol, (what, err)
    return close


# measured after 3 steps: fp32 up to 5.8e-7 (MoE, MoD; the others bitwise), bf16-mixed up to 4.1e-5
# (MoE's moments: autocast rounds the reordered fp32 sums again)
TOL = {"fp32": 1e-5, "bf16": 2e-4}


@pytest.mark.parametrize("name", list(CASES) + list(BF16))
def test_case_under_fsdp_trains_as_under_replicate(results, name):
    fsdp, rep = results[name]["fsdp"], results[name]["replicate"]
    _moved_every_step(fsdp)
    _moved_every_step(rep)
    _same(fsdp, rep, _relative(TOL["bf16" if name in BF16 else "fp32"]), rtol=1e-6)


def test_sparse_attention_under_fsdp_equals_one_process(results):
    cfg = dict(CASES["sparse_attention"], **MIGRATE, steps=STEPS, dp_sharding="fsdp")
    res = results["sparse_attention"]["fsdp"]
    assert res["dp"] == 2
    check_accumulation(res, cfg, replica_averages=0, close=assert_close)  # losses, norms, weights, Adam state
    seen = res["monitor"]["last_stats"]
    assert sorted(seen, key=int) == ["1", "3", "4", "6"], seen  # every sparse layer, whichever rank holds it


def _close_to_one_process(a: torch.Tensor, b: torch.Tensor, what: str, kind: str) -> None:
    """test_moe_pipeline.py's and test_mod_pipeline.py's tolerance: one process differentiates the
    whole batch at once, the pipeline micro-batch by micro-batch, and Adam amplifies that fp32
    rounding where a gradient is near zero (``replicate`` is as far)."""
    scale = 1e-3 * b.abs().max().item() if kind != "weight" else 1e-4
    torch.testing.assert_close(a, b, rtol=1e-3 if kind != "weight" else 1e-4, atol=scale, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("name", SINGLE_PROCESS)
def test_case_under_fsdp_equals_one_process(results, name):
    _same(results[name]["fsdp"], results[name]["one_process"], _close_to_one_process, rtol=1e-5)


def test_early_exit_callback_exits_the_same_tokens_under_fsdp(results):
    """The threshold the callback set reaches the blocks that migrate (and their counters the
    measurement): the same active fractions and rebalance requests as ``replicate``; tokens did
    exit (56 % after block 1 on the first step)."""
    fsdp, rep = (results["early_exit_callback"][m]["early_exit"] for m in ("fsdp", "replicate"))
    assert fsdp == rep
    assert "1.00 -> 0.44" in fsdp["requests"][0]["reason"], fsdp["requests"]


def test_mod_routes_as_in_one_process(results):
    fsdp, ref = results["mod"]["fsdp"], results["mod"]["one_process"]
    assert fsdp["callback"]["last_fractions"] == pytest.approx(ref["callback"]["last_fractions"], nan_ok=True)
    assert fsdp["callback"]["requests"] and any("mod:" in h["reason"] for h in fsdp["history"])


def test_each_replica_holds_half_of_the_experts_and_shards_the_rest(results):
    for name in ("moe_dropless_ep2", "moe_capacity_ep2_bf16"):
        fsdp = results[name]["fsdp"]
        rows = fsdp["expert_rows_per_rank"]
        assert all(n == MOE["num_experts"] // 2 for r in rows for n in r.values()), rows
        kinds = fsdp["dtensor_params_per_rank"]  # per rank: parameter name -> FSDP shard
        for per_rank in kinds:
            assert all(not d for n, d in per_rank.items() if ".experts." in n)
            assert any(d for n, d in per_rank.items() if ".experts." not in n)
