"""Sharded checkpoints (``checkpoint_format="dcp"``): every rank writes its own layers into a
directory and reads back only its own, onto any layout. A run saved by 2 stages x 2 replicas
resumes on 4 stages, that one on 2 stages (through ``ckpt_path="last"``), and that one, after
``consolidate_checkpoint``, in plain single-process Lightning: the losses stay on the curve of an
uninterrupted run. Bad checkpoints fail on every rank with the same message; rank 0's memory
while saving does not grow with the model."""
from __future__ import annotations

import os

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_dynmo import consolidate_checkpoint
from tests.support.multiproc import ROOT, run_worker
from tests.support.workers.common import make_loader, make_model

pytestmark = pytest.mark.slow
WORKER = ROOT / "tests" / "support" / "workers" / "dcp_worker.py"
# 48 samples, 8 per replica x 2 replicas (or 16 on one), unshuffled: three steps per epoch, and
# every checkpoint closes an epoch, so a resumed run sees the batches an uninterrupted one sees.
# The LM head is tied to the embedding (the first and the last stage hold a copy of one parameter).
BASE = {"n_samples": 48, "batch": 8, "tied": True}
STEPS = (3, 6, 9, 12)  # saved by pp2 x dp2, pp4 x dp1, pp2 x dp1; plain Lightning trains to 12
REL = 1e-5


def _on_curve(full: list[float], part: list[float], first: int) -> None:
    want = full[first:first + len(part)]
    assert len(part) == 3 and all(abs(a - b) <= REL * abs(b) for a, b in zip(part, want)), (part, want)


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dcp")
    four = run_worker(tmp / "four", 4, [
        dict(BASE, pp=2, steps=STEPS[3]),  # uninterrupted, 2 stages x 2 replicas
        dict(BASE, pp=2, steps=STEPS[0], ckpt_dir=str(tmp / "a")),
        dict(BASE, pp=4, steps=STEPS[1], ckpt_dir=str(tmp / "b"), resume=str(tmp / "a" / "last.ckpt")),
        dict(BASE, pp=4, steps=STEPS[0], ckpt_dir=str(tmp / "repacked"), repack_to=[1, 2]),  # released ranks save too
    ], worker=WORKER)
    b = four[2]["ckpt"]
    two = run_worker(tmp / "two", 2, [
        dict(BASE, pp=2, steps=STEPS[2], ckpt_dir=str(tmp / "b"), resume="last", poison_save=str(tmp / "nan.ckpt")),
        dict(BASE, pp=2, steps=STEPS[2], resume=b, damage="flip_shard"),
        dict(BASE, pp=2, steps=STEPS[2], resume=b, damage="missing_shard"),
        dict(BASE, pp=2, steps=STEPS[2], resume=b, n_embd=48),
        dict(BASE, pp=2, steps=STEPS[2], resume=b, n_layer=5, mlp_ratios=[1, 4, 2, 8, 1]),
        dict(BASE, pp=2, steps=STEPS[2], resume=b, optimizer_sgd=True),
        dict(BASE, pp=2, steps=STEPS[2], resume=str(tmp / "nan.ckpt")),
        dict(BASE, pp=2, steps=STEPS[1], resume=four[3]["ckpt"]),
    ], worker=WORKER)
    return tmp, four, two


def test_each_layout_resumes_the_previous_ones_checkpoint_on_the_curve(chain):
    _, four, two = chain
    full, a, b, c = four[0], four[1], four[2], two[0]
    assert (full["dp"], a["dp"], b["dp"], c["dp"]) == (2, 2, 1, 1)
    assert b["partition"].count("|") == 3 and c["partition"].count("|") == 1
    for run in (full, a, b, c):
        assert run["errors"] == [None] * len(run["errors"]), run["errors"]
    assert a["losses"] == full["losses"][:3]
    _on_curve(full["losses"], b["losses"], 3)
    _on_curve(full["losses"], c["losses"], 6)  # ckpt_path="last" found pp4's directory
    assert os.path.isdir(c["ckpt"]) and c["ckpt"] != b["ckpt"]


def test_a_run_that_repacked_saves_and_resumes_on_the_curve(chain):
    """4 stages packed onto 2 after step 1 (ranks 1 and 3 released), saved at step 3 by all 4
    ranks, resumed on 2 ranks."""
    _, four, two = chain
    repacked, resumed = four[3], two[7]
    assert repacked["released_ranks"] and repacked["errors"] == [None] * 4, repacked
    assert repacked["losses"] == pytest.approx(four[0]["losses"][:3], rel=REL)
    assert resumed["errors"] == [None, None], resumed["errors"]
    _on_curve(four[0]["losses"], resumed["losses"], 3)


def test_replicas_are_written_once(chain):
    """DCP deduplicates the replicas' equal entries: 2 stages x 2 replicas write as many shard
    bytes as 4 stages x 1 replica (the same model and optimizer state)."""
    _, four, _ = chain
    a, b = four[1]["distcp_bytes"], four[2]["distcp_bytes"]
    assert abs(a - b) <= 0.02 * b, (a, b)


def test_consolidated_checkpoint_resumes_in_plain_single_process_lightning(chain, tmp_path):
    _, four, two = chain
    out = tmp_path / "consolidated.ckpt"
    ckpt = consolidate_checkpoint(two[0]["ckpt"], out)
    assert ckpt["global_step"] == STEPS[2]
    model = make_model(BASE)
    model.load_state_dict(torch.load(out, weights_only=True)["state_dict"])  # strict: every key, every shape
    opt = model.configure_optimizers()["optimizer"]
    opt.load_state_dict(ckpt["optimizer_states"][0])  # torch's own index-keyed format
    assert all(float(st["step"]) == STEPS[2] for st in opt.state_dict()["state"].values())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        losses = []

        class Record(L.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))

        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=STEPS[3], logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                            callbacks=[Record()], default_root_dir=tmp_path)
        loader = DataLoader(make_loader(BASE, 1).dataset, batch_size=2 * BASE["batch"], shuffle=False, drop_last=True)
        trainer.fit(make_model(dict(BASE, seed=1)), ckpt_path=out, train_dataloaders=loader)
    finally:
        torch.set_num_threads(threads)
    _on_curve(four[0]["losses"], losses, 9)


BAD = {  # run index in the two-rank job -> what every rank's error must say
    1: ("__1_0.distcp", "is damaged", "CRC-32"),
    2: ("__0_0.distcp", "is missing"),
    3: ("size mismatch for", "from checkpoint"),
    4: ("Unexpected key(s) in state_dict", "layers.6."),
    5: ("another optimizer type", "SGD"),
    6: ("non-finite values", "state_dict."),
}


@pytest.mark.parametrize("run", sorted(BAD))
def test_a_bad_checkpoint_fails_on_every_rank_with_one_message(chain, run):
    _, _, two = chain
    errors = two[run]["errors"]
    assert errors[0] is not None and errors.count(errors[0]) == len(errors), errors  # the same on every rank
    assert "CheckpointError" in errors[0] and all(s in errors[0] for s in BAD[run]), errors[0]
    assert two[run]["losses"] == []  # failed before any step


def test_rank_zeros_memory_while_saving_does_not_grow_with_the_model(tmp_path):
    """4 stages of a ~110 MB model-and-Adam state: saving a DCP checkpoint grows rank 0's peak
    resident memory by less than a quarter of the full state (the limit set here: about what
    rank 0 holds), where the single-file format (the control, same run) grows it by more than
    the whole state."""
    res = run_worker(tmp_path, 4, [dict(pp=4, steps=1, n_samples=16, batch=8, n_embd=384, save_memory=True)],
                     worker=WORKER)[0]
    full, growth = res["full_state_bytes"], res["save_rss_growth"]
    limit = full / 4
    assert full > 100e6, full
    assert growth["dcp"] < limit, (growth, full)
    assert growth["single"] > full, (growth, full)
