"""Sharded checkpoints (``checkpoint_format="dcp"``): every rank writes its own layers into a
directory and reads back only its own, onto any layout. A run saved by 2 stages x 2 replicas
resumes on 4 stages, that one on 2 stages (through ``ckpt_path="last"``), and that one, after
``consolidate_checkpoint``, in plain single-process Lightning: the losses stay on the curve of an
uninterrupted run. The same chain starts from ``dp_sharding="fsdp"`` (the same tied model, each
end sharded over its stage's replicas): each replica writes its DTensor shards, and a sharded run
reads back only its shards. A GPT with a vocabulary-chunked head (``checkpoint_merges()``) takes a chain
of its own, changing the chunk count at every leg: each rank writes its chunks' rows of the one head matrix.
Bad checkpoints fail on every rank with the same message; rank 0's memory while saving does not grow with
the model."""
from __future__ import annotations

import os

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

import torch.distributed.checkpoint as dcp

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
FSDP = dict(BASE, fsdp=True)  # checkpoint_format left to its default: dcp under fsdp
REL = 1e-5
# the head in 3 chunks (all on the last stage), then 4 over 4 stages (the first chunk on stage 2, the others
# on stage 3), then 16 over 2 sharded stages (4 on the first): rows of one [64, 32] head matrix throughout
CHUNKED = {"n_samples": 48, "batch": 8}
HEAD_CHUNKS = (3, 4, 16)


def _chunks(k: int) -> dict:
    return dict(CHUNKED, gpt={"head_chunks": k})


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
        # 4-8: the fsdp chain (pp2 x dp2 fsdp -> pp4 x dp1 -> pp2 x dp2 fsdp / pp2 x dp1, below), and fsdp's "single"
        dict(FSDP, pp=2, steps=STEPS[3]),  # uninterrupted
        dict(FSDP, pp=2, steps=STEPS[0], ckpt_dir=str(tmp / "fa")),
        dict(FSDP, fsdp=False, pp=4, steps=STEPS[1], ckpt_dir=str(tmp / "fb"), resume=str(tmp / "fa" / "last.ckpt")),
        dict(FSDP, pp=2, steps=STEPS[2], resume=str(tmp / "fb" / "last.ckpt"), probe_load=True),  # whole -> shards
        dict(FSDP, pp=2, steps=STEPS[0], ckpt_dir=str(tmp / "fs"), format="single"),
        # 9-12: the chunked head's chain: pp2 x dp2 fsdp -> pp4 x dp1 -> pp2 x dp2 fsdp (consolidated: below)
        dict(_chunks(HEAD_CHUNKS[0]), fsdp=True, pp=2, steps=STEPS[3]),  # uninterrupted
        dict(_chunks(HEAD_CHUNKS[0]), fsdp=True, pp=2, steps=STEPS[0], ckpt_dir=str(tmp / "ca")),
        dict(_chunks(HEAD_CHUNKS[1]), pp=4, steps=STEPS[1], ckpt_dir=str(tmp / "cb"),
             resume=str(tmp / "ca" / "last.ckpt")),
        dict(_chunks(HEAD_CHUNKS[2]), fsdp=True, pp=2, steps=STEPS[2], ckpt_dir=str(tmp / "cc"),
             resume=str(tmp / "cb" / "last.ckpt")),
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
        dict(FSDP, fsdp=False, pp=2, steps=STEPS[2], ckpt_dir=str(tmp / "fc"), resume=four[6]["ckpt"]),  # 8: replicate
        dict(FSDP, fsdp=False, pp=2, steps=STEPS[1], resume=four[8]["ckpt"]),  # fsdp's single file, resumed
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
    _on_curve(four[0]["losses"], _plain_lightning_losses(two[0]["ckpt"], BASE, tmp_path), 9)


def _plain_lightning_losses(directory, cfg: dict, tmp_path) -> list[float]:
    """Consolidate the DCP ``directory`` (saved at step 9) and train on from it to step 12 in one plain
    Lightning process."""
    out = tmp_path / "consolidated.ckpt"
    ckpt = consolidate_checkpoint(directory, out)
    assert ckpt["global_step"] == STEPS[2]
    model = make_model(cfg)
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
        loader = DataLoader(make_loader(cfg, 1).dataset, batch_size=2 * cfg["batch"], shuffle=False, drop_last=True)
        trainer.fit(make_model(dict(cfg, seed=1)), ckpt_path=out, train_dataloaders=loader)
    finally:
        torch.set_num_threads(threads)
    return losses


def test_fsdp_chain_resumes_on_the_curve_through_every_layout(chain, tmp_path):
    """pp2 x dp2 fsdp saves (dcp, its default) -> pp4 x dp1 resumes and saves -> pp2 x dp2 fsdp and
    pp2 x dp1 replicate resume it -> the latter's checkpoint, consolidated, in plain Lightning."""
    _, four, two = chain
    full, a, b, d, c = four[4], four[5], four[6], four[7], two[8]
    for run in (full, a, b, d, c):
        assert run["errors"] == [None] * len(run["errors"]), run["errors"]
    assert (full["dp"], a["dp"], b["dp"], d["dp"], c["dp"]) == (2, 2, 1, 2, 1)
    assert os.path.isdir(a["ckpt"]) and os.path.isdir(b["ckpt"])  # dcp: the default under fsdp
    assert a["losses"] == full["losses"][:3]
    _on_curve(full["losses"], b["losses"], 3)
    _on_curve(full["losses"], d["losses"], 6)
    _on_curve(full["losses"], c["losses"], 6)
    _on_curve(full["losses"], _plain_lightning_losses(c["ckpt"], FSDP, tmp_path), 9)


def test_fsdp_writes_each_replicas_shards(chain):
    """The fsdp save holds every weight and Adam moment as two row chunks (one per replica, each
    written by the rank that holds it), where the pp4 x dp1 save of the same model holds one."""
    _, four, _ = chain

    def chunks(path) -> dict[str, int]:
        md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        return {k: len(m.chunks) for k, m in md.items() if (".weight" in k or k.endswith(".exp_avg"))
                and hasattr(m, "chunks") and len(m.size) == 2}

    sharded, whole = chunks(four[5]["ckpt"]), chunks(four[6]["ckpt"])
    assert sharded.keys() == whole.keys() and len(sharded) > 10
    assert set(sharded.values()) == {2} and set(whole.values()) == {1}, (sharded, whole)


def test_fsdp_resume_reads_only_each_replicas_shards(chain):
    """Loading the pp4 x dp1 checkpoint (whole tensors) into pp2 x dp2 fsdp: every rank's weights and
    moments come back as DTensor shards, and each rank reads about half of its stage's elements."""
    _, four, _ = chain
    probe = four[7]["probe_load"]
    for rank in probe:
        assert rank["entries"] > 0 and rank["sharded"] >= 0.9 * rank["entries"], probe  # biases of 1 row? all split
        assert 0.45 <= rank["read_numel"] / rank["whole_numel"] <= 0.55, probe


def test_single_format_still_works_under_fsdp(chain):
    """checkpoint_format="single" under fsdp gathers one file; pp2 x dp1 replicate resumes it on the curve."""
    _, four, two = chain
    saved, resumed = four[8], two[9]
    assert saved["errors"] == [None] * 4 and os.path.isfile(saved["ckpt"]), saved
    assert resumed["errors"] == [None, None], resumed["errors"]
    _on_curve(four[4]["losses"], resumed["losses"], 3)


def test_chunked_head_resumes_on_the_curve_under_other_layouts_and_chunk_counts(chain, tmp_path):
    """pp2 x dp2 fsdp with 3 chunks saves -> pp4 x dp1 with 4 resumes and saves -> pp2 x dp2 fsdp with 16
    resumes and saves -> consolidated, an unchunked GPT in plain Lightning trains on: all on the curve."""
    _, four, _ = chain
    full, a, b, c = four[9:13]
    for run in (full, a, b, c):
        assert run["errors"] == [None] * len(run["errors"]), run["errors"]
    assert (a["dp"], b["dp"], c["dp"]) == (2, 1, 2)
    assert b["partition"] == "0-2|3-5|6-8|9-11" and c["partition"] == "0-11|12-23", (b, c)  # chunks on two stages
    assert a["losses"] == full["losses"][:3]
    _on_curve(full["losses"], b["losses"], 3)
    _on_curve(full["losses"], c["losses"], 6)
    _on_curve(full["losses"], _plain_lightning_losses(c["ckpt"], CHUNKED, tmp_path), 9)


def test_chunked_head_is_one_matrix_in_the_checkpoint_whatever_the_chunks(chain):
    """Every save holds the head as one [64, 32] tensor (weights and moments; Adam's step once), as
    the unchunked model names it, in one chunk per head chunk and replica shard; the keys do not
    depend on the chunk count."""
    _, four, _ = chain
    head = "layers.8.lm_head.weight"  # 6 blocks: embedding, blocks 1-6, final norm, head
    keys = []
    for run, k, dp in zip(four[10:13], HEAD_CHUNKS, (2, 1, 2)):
        md = dcp.FileSystemReader(run["ckpt"]).read_metadata().state_dict_metadata
        keys.append(set(md))
        heads = {key: m for key, m in md.items() if "lm_head" in key}
        assert set(heads) == {f"state_dict.{head}", *(f"optimizer_0.state.{head}.{e}"
                                                      for e in ("exp_avg", "exp_avg_sq", "step"))}, heads
        for key, m in heads.items():
            want = ((), 1) if key.endswith(".step") else ((64, 32), k * dp)
            assert (tuple(m.size), len(m.chunks)) == want, (key, m)
    assert keys[0] == keys[1] == keys[2]


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
