"""``dp_sharding="fsdp"`` under mixed and half precision, pp2 x dp2 on 4 CPU ranks (gloo), one
torchrun job: each precision under fsdp against the same precision under ``replicate`` (which
``test_real_models.py`` holds equal to single-process Lightning), with a migration before every
step and gradients clipped by the global norm.

* ``bf16-mixed``, ``16-mixed``: autocast over fp32 parameters; the shards, the gradients FSDP
  reduce-scatters and the optimizer state stay fp32, so fsdp computes what replicate computes.
* ``16-mixed`` with an overflow on replica 0 only: a gradient entry set to inf on the ranks of
  data-parallel replica 0 (under fsdp each replica holds a different shard, so only replica 0's
  inf check can see it). Every rank must skip that step and back off the same scale, as under
  replicate, where the replicas' averaged gradient carries the inf to both.
* ``bf16-true``: bf16 parameters, sharded in bf16.
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.distributed.test_real_models import MIGRATE, WORKER, base
from tests.support.multiproc import run_worker

pytestmark = pytest.mark.slow
OVERFLOW = {"inf_at": [2, "layers.0.wte.weight"], "inf_replica": 0}
CASES = {
    "bf16-mixed": ({"precision": "bf16-mixed"}, 1e-5),
    "16-mixed_overflow_on_one_replica": ({"precision": "16-mixed", **OVERFLOW}, 1e-5),
    "bf16-true": ({"precision": "bf16-true"}, 1e-2),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    # "single": both modes' states gathered whole onto rank 0 (fsdp's default is a dcp directory)
    specs = [base(dp_sharding=mode, checkpoint_format="single", **MIGRATE, **cfg) for cfg, _ in CASES.values()
             for mode in ("fsdp", "replicate")]
    results = iter(run_worker(tmp_path_factory.mktemp("fsdp_precision"), 4, specs, worker=WORKER, timeout=420))
    return {name: {mode: next(results) for mode in ("fsdp", "replicate")} for name in CASES}


@pytest.mark.parametrize("name", list(CASES))
def test_fsdp_trains_as_replicate_in_each_precision(runs, name):
    fsdp, replicate = runs[name]["fsdp"], runs[name]["replicate"]
    rtol = CASES[name][1]
    assert fsdp["applied"] >= 1 and fsdp["applied"] == replicate["applied"]  # layers moved between stages
    assert len(fsdp["losses"]) == len(replicate["losses"]) > 0
    for a, b in zip(fsdp["losses"], replicate["losses"]):
        assert math.isfinite(a) and abs(a - b) <= rtol * abs(b), (name, fsdp["losses"], replicate["losses"])
    state, ref = torch.load(fsdp["state"]), torch.load(replicate["state"])
    assert state.keys() == ref.keys()
    for key, v in ref.items():
        if torch.is_floating_point(v):
            assert state[key].dtype == v.dtype, key
            scale = v.float().abs().max().clamp_min(1e-12)
            assert float((state[key].float() - v.float()).abs().max() / scale) <= 10 * rtol, (name, key)


def test_an_overflow_on_one_replicas_shard_is_skipped_by_every_rank(runs):
    for mode in ("fsdp", "replicate"):
        scales = [r["scales"] for r in runs["16-mixed_overflow_on_one_replica"][mode]["per_rank"]]
        assert all(s == scales[0] for s in scales), (mode, scales)
        step = OVERFLOW["inf_at"][0]
        assert scales[0][step] == scales[0][step - 1] / 2, (mode, scales[0])  # skipped once, backed off once
