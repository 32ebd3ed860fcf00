"""``dp_sharding="fsdp"`` composed with the rest of the product, pp2 x dp2 on 4 CPU ranks (gloo),
one torchrun job: each feature under fsdp against the same feature under ``replicate`` (which the
other distributed tests hold equal to single-process training), or against single-process
training directly.

* layer freezing (``LayerFreezing``): a whole stage frozen and one layer of the other; frozen
  shards carry no optimizer state;
* repack: the 2-rank pipelines packed onto 1 rank after step 1 (the leaving layers are gathered
  over their replicas and sharded again on the receiving rank);
* meta-device init (``trainer.init_module(empty_init=True)``);
* a parameter that gets a gradient on one replica and not the other (the MoE / early-exit / MoD
  hazard): FSDP units reduce-scatter zeros for it, so the replicas' collectives match (no hang)
  and the update is replicate's (an absent gradient averages as zero).
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.distributed.test_accumulation import base, check_accumulation
from tests.distributed.test_equivalence import assert_close
from tests.support.multiproc import run_worker

pytestmark = pytest.mark.slow
REL = 1e-5
STEPS = 2  # freezing and the repack act after step 1


def both(**kw) -> dict[str, dict]:
    return {mode: base(dp_sharding=mode, accumulate=1, steps=STEPS, **kw) for mode in ("fsdp", "replicate")}


PAIRS = {
    "freeze": both(partition=[0, 4, 9], freeze={"1": 5}),  # from step 1: stage 0 whole, and layer 4 of stage 1
    "repack": both(repack_to=[1, 1]),
    "unused_on_one_replica": both(starve=[2, "mlp"]),
}
META = base(dp_sharding="fsdp", accumulate=1, steps=STEPS, meta=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    specs = [cfg for pair in PAIRS.values() for cfg in pair.values()] + [META]
    results = iter(run_worker(tmp_path_factory.mktemp("fsdp_comp"), 4, specs, timeout=300))
    out = {name: {mode: next(results) for mode in pair} for name, pair in PAIRS.items()}
    out["meta"] = next(results)
    return out


def _same_training(fsdp: dict, replicate: dict) -> None:
    assert fsdp["dp"] == replicate["dp"] == 2
    assert len(fsdp["losses"]) == len(replicate["losses"]) > 0
    for a, b in zip(fsdp["losses"], replicate["losses"]):
        assert math.isfinite(a) and abs(a - b) <= REL * abs(b), (fsdp["losses"], replicate["losses"])
    state, ref = torch.load(fsdp["state"]), torch.load(replicate["state"])
    assert state.keys() == ref.keys()
    for key, v in ref.items():
        if torch.is_floating_point(v):
            assert_close(state[key], v, f"weight {key}", "weight")


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_feature_under_fsdp_trains_as_under_replicate(runs, name):
    _same_training(runs[name]["fsdp"], runs[name]["replicate"])


def test_frozen_shards_carry_no_optimizer_state(runs):
    fsdp = runs["freeze"]["fsdp"]
    frozen = fsdp["frozen_per_rank"]  # per global rank: (frozen params, of them with optimizer state, sharded)
    assert all(n > 0 for n, _, _ in frozen), frozen  # both stages hold frozen layers
    assert all(with_state == 0 for _, with_state, _ in frozen), frozen
    assert all(sharded == n for n, _, sharded in frozen), frozen  # still FSDP shards
    # the frozen front takes no step: its weights are the initial ones in both modes (checked above)


def test_repacked_fsdp_pipeline_releases_ranks_and_keeps_every_layer_sharded(runs):
    fsdp = runs["repack"]["fsdp"]
    assert fsdp["strategy_released_ranks_per_rank"] == [[1, 3]] * 4, fsdp["strategy_released_ranks_per_rank"]  # global ranks
    local = fsdp["local_param_numel_per_rank"]  # ranks 0 and 2 (the replicas of pp rank 0) hold the model, halved
    assert local[1] == local[3] == 0 and local[0] > 0 and abs(local[0] - local[2]) <= 0.1 * local[0], local


def test_meta_device_init_under_fsdp_matches_single_process(runs):
    res = runs["meta"]
    check_accumulation(res, META, replica_averages=0, close=assert_close)
