"""Pruned layers in CSR storage and frozen layers under pp=2 x dp=2 (4 gloo ranks): a layer
migration before every step moves CSR-stored layers (values, gradients, Adam moments, int32
pattern); the data-parallel all-reduce carries exactly the trainable gradients (kept values of
CSR layers, nothing of frozen layers); losses equal a single-process masked-dense run; the
checkpoint is the dense single-process format and resumes on 4 stages (and in one process) on
the same curve."""
from __future__ import annotations

import pytest
import torch

from lightning_dynmo.dynamic.pruning import sparse_kernels_available
from lightning_dynmo.strategy.dcp_checkpoint import consolidate_checkpoint
from tests.support.multiproc import ROOT, run_worker
from tests.support.workers.common import make_model

pytestmark = pytest.mark.slow
WORKER = ROOT / "tests" / "support" / "workers" / "sparse_worker.py"
# prunes at steps 1 (0 %), 3 (78.75 %) and 5 (90 %); the embedding and block 1 freeze at step 4
PRUNE = {"final_sparsity": 0.9, "start_step": 1, "n_steps": 2, "frequency": 2, "sparse_kernels": False}
BASE = dict(steps=7, batch=8, n_layer=4, pruning=PRUNE, freezing={"schedule": {"4": 2}})
MIGRATE = {"balancer": "test_shift", "rebalance": "every_n", "rebalance_interval": 1}
# Egeria-style: every 2 steps, plateau always reached: the embedding freezes after step 4, then
# one layer per evaluation; references ride with migrating layers, replicas agree on plasticity
EGERIA = dict(steps=9, batch=8, n_layer=4, pruning=None,
              freezing={"criterion": "reference", "threshold": 1e9, "interval": 2, "max_frozen": 4, "max_per_event": 1})


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sparse")
    ckpt, ckpt_fsdp = str(tmp / "pp2dp2.ckpt"), str(tmp / "pp2dp2_fsdp.ckpt")
    pipe = run_worker(tmp / "pipe", 4, [
        dict(BASE, pp=2, save=ckpt, **MIGRATE),
        dict(BASE, pp=4, steps=9, resume=ckpt),  # another stage count, dp=1
        dict(EGERIA, pp=2, **MIGRATE),
        FSDP_KERNELS(save=ckpt_fsdp),
    ], worker=WORKER, timeout=300)
    ref = run_worker(tmp / "ref", None, [
        dict(BASE, pruning=dict(PRUNE, storage_density=None), ref_dp=2),  # masked dense, global batch
        dict(BASE, steps=9, resume=ckpt),
        dict(EGERIA, ref_dp=2),
    ], worker=WORKER, timeout=300)
    # (fsdp saves DCP by default: each rank its shards, the CSR values' dense rows; made one file here)
    return pipe, ref, torch.load(ckpt, weights_only=False), consolidate_checkpoint(ckpt_fsdp, tmp / "fsdp.ckpt")


def FSDP_KERNELS(**kw) -> dict:
    """The pp2 x dp2 run under ``dp_sharding="fsdp"`` with the CSR kernel on every CSR-stored Linear
    (after the all-gather of its values shard)."""
    return dict(BASE, pp=2, dp_sharding="fsdp", pruning=dict(PRUNE, sparse_kernels=True), count_kernels=True,
                **MIGRATE, **kw)


def test_csr_training_under_pp2_dp2_equals_masked_dense(results):
    (a, _, _, _), (ref, _, _), _, _ = results
    assert a["dp"] == 2 and sum(h["applied"] for h in a["history"]) >= 5  # layers moved before (almost) every step
    assert sum(a["compressed_per_rank"]) == 2 * 16  # every pruned linear of both replicas is CSR-stored
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
    assert a["sparsity"] == pytest.approx(ref["sparsity"], abs=1e-4) and a["sparsity"] == pytest.approx(0.9, abs=2e-3)
    assert a["memory"]["ratio"] < 0.15 and ref["memory"]["ratio"] == pytest.approx(1.0)


def gradients_and_presence_mask_only(sent: list, grads: list) -> bool:
    """The data-parallel exchange is the gradients plus the presence mask of
    runtime/gradients.py (one float32 per trainable parameter of the stage: a few hundred bytes
    here, where one frozen or dense tensor sent by mistake adds thousands)."""
    extra = [s - g for s, g in zip(sent, grads)]
    return len(sent) == len(grads) and all(0 <= e <= 4 * 64 and e % 4 == 0 for e in extra)


def test_data_parallel_exchange_carries_only_trainable_kept_values(results):
    (a, _, _, _), _, _, _ = results
    sent, grads = a["sent"], a["grads"]
    assert gradients_and_presence_mask_only(sent, grads), (sent, grads)  # CSR kept values, no frozen parameters
    assert a["frozen_with_grad"] == [0.0] * len(sent)
    assert sent[3] < 0.5 * sent[0]  # 78.75 % sparse
    assert sent[4] < sent[3]  # the embedding and block 1 froze: they left the exchange
    assert sent[-1] / sent[0] < 0.2, sent


def test_checkpoint_is_dense_and_resumes_on_four_stages(results):
    (_, b, _, _), (_, ref_b, _), ckpt, _ = results
    sd = ckpt["state_dict"]
    masks = [k for k in sd if k.endswith("weight_mask")]
    assert len(masks) == 16
    for k in masks:
        w = sd[k[: -len("_mask")]]
        assert w.shape == sd[k].shape and torch.all(w[~sd[k]] == 0)
    model = make_model(BASE)  # single-process optimizer order: every moment has its dense parameter's shape
    params = [p for g in model.configure_optimizers()["optimizer"].param_groups for p in g["params"]]
    states = ckpt["optimizer_states"][0]["state"]
    frozen = sum(1 for layer in model.pipeline_layers()[:2] for _ in layer.parameters())
    assert len(states) == len(params) - frozen  # the frozen embedding and block 1 hold none
    for i, st in states.items():
        assert st["exp_avg"].shape == st["exp_avg_sq"].shape == params[i].shape
    assert b["dp"] == 1 and b["compressed_per_rank"] and sum(b["compressed_per_rank"]) == 16
    assert len(b["losses"]) == len(ref_b["losses"]) == 2
    torch.testing.assert_close(torch.tensor(b["losses"]), torch.tensor(ref_b["losses"]), rtol=1e-5, atol=0)


def test_egeria_freezing_with_migrations_decides_as_one_process(results):
    (_, _, c, _), (_, _, ref_c), _, _ = results
    assert c["freezing"] == ref_c["freezing"] == [[5, 1], [7, 2], [9, 3]]
    assert sum(h["applied"] for h in c["history"]) >= 5  # layers (and their references) moved meanwhile
    assert gradients_and_presence_mask_only(c["sent"], c["grads"]), (c["sent"], c["grads"])
    assert c["sent"][-1] < c["sent"][5] < c["sent"][0]  # frozen layers leave the exchange
    torch.testing.assert_close(torch.tensor(c["losses"]), torch.tensor(ref_c["losses"]), rtol=1e-5, atol=0)


@pytest.mark.skipif(not sparse_kernels_available(), reason="the sparse-kernel extension is not built")
def test_csr_values_sharded_under_fsdp_train_on_the_kernel_as_replicate(results):
    """Under fsdp every CSR-stored Linear runs the CSR kernel on its all-gathered values (the
    replicas agreed on it), with freezing and a migration before every step; losses follow
    ``replicate``'s masked-dense-equal curve (the kernel sums in another order), the pruned
    state at rest is the values' half per replica, and the DCP checkpoint, made one file, is the
    dense format with ``replicate``'s masks."""
    (a, _, _, f), _, ckpt, ckpt_fsdp = results
    assert f["dp"] == 2 and sum(h["applied"] for h in f["history"]) >= 5
    assert sum(f["compressed_per_rank"]) == 2 * 16  # every CSR-stored Linear of both replicas on the kernel
    torch.testing.assert_close(torch.tensor(f["losses"]), torch.tensor(a["losses"]), rtol=1e-5, atol=0)
    assert f["sparsity"] == pytest.approx(a["sparsity"], abs=1e-4)
    assert f["memory"]["stored"] == pytest.approx(a["memory"]["stored"], rel=1e-6)  # the shards add up to one copy
    sd, ref = ckpt_fsdp["state_dict"], ckpt["state_dict"]
    assert sd.keys() == ref.keys()
    for k, v in ref.items():
        if k.endswith("weight_mask"):
            assert torch.equal(sd[k], v), k
        elif torch.is_floating_point(v):
            torch.testing.assert_close(sd[k], v, rtol=1e-4, atol=1e-6, msg=k)
    states, ref_states = (c["optimizer_states"][0]["state"] for c in (ckpt_fsdp, ckpt))
    assert states.keys() == ref_states.keys()
    for i, st in ref_states.items():
        assert st["exp_avg"].shape == states[i]["exp_avg"].shape, i  # dense moments, as replicate writes them
