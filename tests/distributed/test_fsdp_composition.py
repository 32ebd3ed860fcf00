"""``dp_sharding="fsdp"`` composed with the rest of the product, pp2 x dp2 on 4 CPU ranks (gloo),
one torchrun job: each feature under fsdp against the same feature under ``replicate`` (which the
other distributed tests hold equal to single-process training), or against single-process
training directly.

* layer freezing (``LayerFreezing``): a whole stage frozen and one layer of the other; frozen
  shards carry no optimizer state;
* repack: the 2-rank pipelines packed onto 1 rank after step 1 (the leaving layers are gathered
  over their replicas and sharded again on the receiving rank);
* meta-device init (``trainer.init_module(empty_init=True)``), of a dense and of a pruned GPT;
* a parameter that gets a gradient on one replica and not the other (the MoE / early-exit / MoD
  hazard): FSDP units reduce-scatter zeros for it, so the replicas' collectives match (no hang)
  and the update is replicate's (an absent gradient averages as zero);
* gradual pruning with a pruning event at every step and a migration before every step: masks
  sharded like their weights, the threshold counted over the shards, layers CSR-stored from the
  second pruning step on (their values sharded); equal to ``replicate`` (CSR-stored alike) and to
  single-process training with masked dense layers (losses, weights, masks, thresholds, Adam
  state). The pruned fsdp run saves a DCP checkpoint (masks and moments as dense row shards) and
  resumes from it, training on as ``replicate`` does from its single-file checkpoint.
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.distributed.test_accumulation import accumulated_reference, assert_close_tied, base, check_accumulation
from tests.distributed.test_dynamic_pipeline import optimizer_order
from tests.distributed.test_equivalence import migrations
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
# prunes at every step: 30 % of the initial weights at step 0, then 58 %, 69 % and 70 %
PRUNE = {"final_sparsity": 0.7, "initial_sparsity": 0.3, "start_step": 0, "n_steps": 3, "frequency": 1,
         "sparse_kernels": False}
PRUNED = {mode: base(dp_sharding=mode, accumulate=1, steps=4, partition=[0, 6, 9], rebalance="every_n",
                     balancer="test_cycle",  # a migration before every step after the first
                     # the default storage_density: CSR-stored from 58 % on (density 0.42 <= 0.5)
                     pruning=PRUNE,
                     save_ckpt=True, checkpoint_format="dcp" if mode == "fsdp" else "single")
          for mode in ("fsdp", "replicate")}
RESUMED_STEPS = 6
# built on the meta device, made prunable there by GradualPruning.setup, materialised in shards
META_PRUNED = dict(PRUNED["fsdp"], meta=True, save_ckpt=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp_comp")
    pairs = dict(PAIRS, pruning=PRUNED)
    specs = [cfg for pair in pairs.values() for cfg in pair.values()] + [META, META_PRUNED]
    # each pruned run resumed from its checkpoint (the worker's ckpt<index>/last.ckpt)
    resumed = {mode: dict(cfg, steps=RESUMED_STEPS, save_ckpt=False,
                          resume=str(tmp / f"ckpt{specs.index(cfg)}" / "last.ckpt")) for mode, cfg in PRUNED.items()}
    results = iter(run_worker(tmp, 4, specs + list(resumed.values()), timeout=420))
    out = {name: {mode: next(results) for mode in pair} for name, pair in pairs.items()}
    out["meta"] = next(results)
    out["meta_pruned"] = next(results)
    out["pruning_resumed"] = {mode: next(results) for mode in resumed}
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
    released = fsdp["strategy_released_ranks_per_rank"]
    assert released == [[1, 3]] * 4, released  # global ranks
    local = fsdp["local_param_numel_per_rank"]  # ranks 0 and 2 (the replicas of pp rank 0) hold the model, halved
    assert local[1] == local[3] == 0 and local[0] > 0 and abs(local[0] - local[2]) <= 0.1 * local[0], local


def test_meta_device_init_under_fsdp_matches_single_process(runs):
    res = runs["meta"]
    check_accumulation(res, META, replica_averages=0, close=assert_close)


def test_a_model_pruned_from_the_meta_device_under_fsdp_matches_single_process(runs):
    """Masks made on the meta device (GradualPruning.setup runs before the strategy materialises
    the model) are allocated as shards and start all-kept; the run is the one built on real
    tensors: one process's weights, Adam state, thresholds and masks."""
    res, ref = runs["meta_pruned"], runs["pruning"]["fsdp"]
    check_accumulation(res, META_PRUNED, replica_averages=0, close=assert_close)
    assert [h["threshold"] for h in res["pruning"]["history"]] == [h["threshold"] for h in ref["pruning"]["history"]]
    _same_masks_and_moments(res, ref, META_PRUNED)


def test_gradual_pruning_under_fsdp_equals_replicate_and_one_process(runs):
    """Sharded masks (each rank holds its weight rows' mask rows) while dense-stored, then sharded
    CSR values; the same thresholds as ``replicate`` and one process (the first bit for bit: it
    ranks the initial weights), the same masks and Adam state, through a migration before every
    step."""
    fsdp, rep = runs["pruning"]["fsdp"], runs["pruning"]["replicate"]
    cfg = PRUNED["fsdp"]
    assert migrations(fsdp) == migrations(rep) == cfg["steps"] - 1
    _same_training(fsdp, rep)
    _halves_of_replicate(fsdp, rep)
    history = []
    check_accumulation(fsdp, cfg, replica_averages=0, close=assert_close)  # weights and Adam state
    accumulated_reference(cfg, fsdp["dp"], history)
    hf, hr = fsdp["pruning"]["history"], rep["pruning"]["history"]
    assert [h["step"] for h in hf] == [h["step"] for h in hr] == [h["step"] for h in history] == [0, 1, 2, 3]
    assert hf[0]["threshold"] == hr[0]["threshold"] == history[0]["threshold"]
    for a, b, c in zip(hf, hr, history):
        assert a["threshold"] == b["threshold"], (hf, hr)
        assert a["threshold"] == pytest.approx(c["threshold"], rel=1e-6) and a["sparsity"] == b["sparsity"]
        assert a["densities"] == b["densities"]
    assert hf[-1]["sparsity"] == pytest.approx(0.7, abs=1e-3)
    _same_masks_and_moments(fsdp, rep, cfg)
    # the pruned layers' state over all ranks (fsdp: the replicas' shards added) is replicate's
    # CSR state at 30 % density; the pattern is whole on both replicas (twice replicate's per stage)
    mem, mem_ref = fsdp["pruning_memory"], rep["pruning_memory"]
    assert mem["stored"] == pytest.approx(mem_ref["stored"], rel=1e-9) and mem["ratio"] < 0.35, (mem, mem_ref)
    assert mem["index"] == 2 * mem_ref["index"] > 0, (mem, mem_ref)


def _halves_of_replicate(fsdp: dict, rep: dict) -> None:
    """The same Linears CSR-stored in both modes, most of them; under fsdp each replica holds about
    half of its stage's values (per global rank: CSR Linears, of them DTensor shards, local values)
    and of the masks of those left dense-stored."""
    for key in ("csr_per_rank", "masks_per_rank"):
        got, ref = fsdp[key], rep[key]
        assert all(sharded == n for n, sharded, _ in got) and all(sharded == 0 for _, sharded, _ in ref), (got, ref)
        for stage in (0, 1):  # global ranks `stage` and `2 + stage` are the stage's replicas
            assert got[stage][0] == got[2 + stage][0] == ref[stage][0], (key, got, ref)
            a, b = got[stage][2], got[2 + stage][2]
            assert a + b == ref[stage][2] and abs(a - b) <= 0.1 * (a + b), (key, got, ref)
    csr = fsdp["csr_per_rank"]
    assert csr[0][0] + csr[1][0] >= 4 * 6 // 2, csr  # of the 24 pruned Linears


def test_pruned_fsdp_run_resumes_from_its_dcp_checkpoint_as_replicate_does(runs):
    """DCP wrote each mask and moment as the replicas' row chunks of its dense form; loading read
    them back into shards, and two more steps (masks kept, pruned weights staying zero) equal ``replicate``
    resumed from its single-file checkpoint."""
    import torch.distributed.checkpoint as dcp

    fsdp, rep = runs["pruning_resumed"]["fsdp"], runs["pruning_resumed"]["replicate"]
    saved = dcp.FileSystemReader(runs["pruning"]["fsdp"]["ckpt"]).read_metadata().state_dict_metadata
    masks = [k for k in saved if k.endswith("weight_mask")]
    assert len(masks) == 4 * 6 and all(len(saved[k].chunks) == 2 for k in masks)  # one chunk per replica
    moments = [k for k in saved if k.endswith(".exp_avg") and "mlp" in k]
    assert moments and all(len(saved[k].chunks) == 2 for k in moments), moments
    assert len(fsdp["losses"]) == len(rep["losses"]) == RESUMED_STEPS - PRUNED["fsdp"]["steps"]
    _same_training(fsdp, rep)
    _halves_of_replicate(fsdp, rep)  # (resumed dense, compressed again at the start)
    assert fsdp["pruning"]["sparsity"] == rep["pruning"]["sparsity"] == pytest.approx(0.7, abs=1e-3)
    # six steps: the clipping norm's fp32 rounding (summed per shard under fsdp) grows in Adam's
    # near-zero moments past the element-wise slack (one of 2048 entries, 1.4e-10 against 1e-10)
    _same_masks_and_moments(fsdp, rep, PRUNED["fsdp"], close=assert_close_tied)


def _same_masks_and_moments(fsdp: dict, rep: dict, cfg: dict, close=assert_close) -> None:
    state, ref = torch.load(fsdp["state"]), torch.load(rep["state"])
    keys = [k for k in ref if k.endswith("weight_mask")]
    assert len(keys) == 4 * 6
    for k in keys:
        assert torch.equal(state[k], ref[k]), k
        assert torch.all(state[k[: -len("_mask")]][~state[k]] == 0), k  # pruned weights are zero
    optim, optim_ref = (torch.load(r["optim"], weights_only=False)["state"] for r in (fsdp, rep))
    assert optim.keys() == optim_ref.keys()
    names = optimizer_order(cfg)
    for i, st in optim_ref.items():
        for name in ("exp_avg", "exp_avg_sq"):
            close(optim[i][name], st[name], f"{names[i]}.{name}", name)
        assert float(optim[i]["step"]) == float(st["step"])
