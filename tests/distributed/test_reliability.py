"""Issue 16 end to end: no silent wrong training, clear errors on every rank, and jobs that
survive a lost rank.

Most cases share one 2-rank torchrun launch (``reliability_worker.py`` records each case's
exception per rank); the tied-embedding equivalence runs go through ``pipeline_worker.py``; the
lost-rank and killed-launcher cases need launches of their own.
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_dynmo import available_schedules
from lightning_dynmo.plan.schedules import get_schedule
from tests.support import multiproc
from tests.support.multiproc import ROOT, Finished, alive, run, run_worker, torchrun, worker_env, write_spec
from tests.support.workers.common import FreezeThenUnfreeze, LossRecorder, make_loader, make_model

pytestmark = pytest.mark.slow
WORKER = ROOT / "tests" / "support" / "workers" / "reliability_worker.py"
SCHEDULES = available_schedules()


def launch(tmp: Path, nproc: int, runs: list[dict], extra: tuple = (),
           timeout: int = 300) -> tuple[Finished, list[dict] | None]:
    """One job; with ``extra`` torchrun arguments (restarts) on the torchrun command line itself."""
    spec, out = write_spec(tmp, runs)
    cmd = torchrun(nproc, WORKER, str(spec))
    if extra:
        cmd[3:3] = list(extra)
        proc = run(cmd, timeout, tmp / "worker.log")
    else:
        proc = multiproc.launch(cmd, timeout, tmp / "worker.log")
    results = json.loads(out.read_text())["runs"] if out.is_file() else None
    return proc, results


def _single_process_losses(cfg: dict, steps: int, ckpt_path: str | None = None, callbacks=()) -> list[float]:
    """Per-step losses of plain single-process Lightning on the workers' model and loader."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rec = LossRecorder()
        L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                  gradient_clip_val=cfg.get("clip", 1.0), callbacks=[rec, *callbacks]).fit(
            make_model(cfg), train_dataloaders=make_loader(cfg, cfg.get("batch", 8)), ckpt_path=ckpt_path)
    finally:
        torch.set_num_threads(threads)
    return rec.losses


def _fit_and_save(cfg: dict, path: Path) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
        trainer.fit(make_model(cfg), train_dataloaders=make_loader(cfg, 8))
        trainer.save_checkpoint(path)
    finally:
        torch.set_num_threads(threads)


def _flip_bytes_inside(path: Path, entry: str) -> bytes:
    """The file's bytes with 4 bytes inverted in the middle of zip entry ``entry`` (stored, not
    compressed, as torch.save writes it): a valid archive structure, changed tensor values."""
    import zipfile

    data = bytearray(path.read_bytes())
    info = zipfile.ZipFile(path).getinfo(entry)
    head = info.header_offset
    name_len = int.from_bytes(data[head + 26:head + 28], "little")
    extra_len = int.from_bytes(data[head + 28:head + 30], "little")
    start = head + 30 + name_len + extra_len + info.file_size // 2
    data[start:start + 4] = bytes(b ^ 0xFF for b in data[start:start + 4])
    return bytes(data)


BASE_CKPT = {"n_layer": 4}
TIED_CKPT = {"n_layer": 4, "tied": True}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """A valid 4-layer checkpoint and damaged variants of it."""
    tmp = tmp_path_factory.mktemp("ckpts")
    paths = {name: tmp / f"{name}.ckpt" for name in
             ("valid", "six_layers", "other_shape", "optim_count", "optim_shape", "sgd_state", "nan_weight",
              "inf_optim", "random")}
    _fit_and_save(BASE_CKPT, paths["valid"])
    _fit_and_save({"n_layer": 6}, paths["six_layers"])
    _fit_and_save({"n_layer": 4, "mlp_ratios": [1, 4, 2, 4]}, paths["other_shape"])
    paths["tied"] = tmp / "tied.ckpt"
    _fit_and_save(TIED_CKPT, paths["tied"])

    def variant(name, edit):
        ck = torch.load(paths["valid"], weights_only=True)
        edit(ck)
        torch.save(ck, paths[name])

    def drop_last_param(ck):
        opt = ck["optimizer_states"][0]
        last = opt["param_groups"][-1]["params"].pop()
        opt["state"].pop(last, None)

    variant("optim_count", drop_last_param)

    def sgd_state(ck):  # what SGD(momentum=0.9) saves for the same parameters
        opt = ck["optimizer_states"][0]
        sgd = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1,
                              momentum=0.9).state_dict()["param_groups"][0]
        opt["param_groups"] = [{**sgd, "params": g["params"]} for g in opt["param_groups"]]
        opt["state"] = {i: {"momentum_buffer": st["exp_avg"].clone()} for i, st in opt["state"].items()}

    variant("sgd_state", sgd_state)
    variant("optim_shape", lambda ck: ck["optimizer_states"][0]["state"][1].update(exp_avg=torch.zeros(3)))
    variant("nan_weight", lambda ck: ck["state_dict"]["layers.2.attn.qkv.weight"].view(-1)[5].fill_(float("nan")))
    variant("inf_optim", lambda ck: ck["optimizer_states"][0]["state"][3]["exp_avg_sq"].view(-1)[0].fill_(float("inf")))
    paths["random"].write_bytes(os.urandom(4096))
    paths["flipped_bytes"] = tmp / "flipped_bytes.ckpt"
    paths["flipped_bytes"].write_bytes(_flip_bytes_inside(paths["valid"], "archive/data/5"))
    return {k: str(v) for k, v in paths.items()}


BAD_CHECKPOINTS = [
    ("six_layers", ["Unexpected key(s)", "layers.7.", "layers.8."]),
    ("other_shape", ["size mismatch", "layers.4.mlp.fc.weight"]),
    ("optim_count", ["optimizer", "parameters"]),
    ("optim_shape", ["optimizer", "exp_avg", "[3]"]),
    ("sgd_state", ["another optimizer type", "AdamW", "'momentum'", "'betas'", "saved with"]),
    ("nan_weight", ["non-finite", "layers.2.attn.qkv.weight"]),
    ("inf_optim", ["non-finite", "exp_avg_sq"]),
    ("random", ["is not a checkpoint"]),
    ("flipped_bytes", ["is damaged", "'archive/data/5'", "a tensor's storage", "CRC-32"]),
]


def _view_partition(schedule: str) -> list[int]:
    # view model with 4 blocks: [Emb, V, B, V, B, V, B, V, B, V, Norm, Head]; stages end on a view layer
    return [0, 2, 4, 6, 12] if get_schedule(schedule).multi else [0, 4, 12]


ZERO_BUBBLE = [s for s in SCHEDULES if get_schedule(s).cost_schedule == "zero_bubble"]
# 30 samples in batches of 8: the 4th batch of each epoch holds 6, which microbatches=4 does not divide
PARTIAL = dict(n_layer=2, steps=5, n_samples=30, drop_last=False, microbatches=4)
# the whole first stage (layers 0-1 of 7) frozen before the first step, unfrozen by hand at step 2
UNFREEZE = dict(n_layer=4, steps=5, partition=[0, 2, 7], rebalance="never",
                unfreeze={"n": 2, "freeze_at": 0, "unfreeze_at": 2})
REPACK_RANK0 = dict(n_layer=2, steps=5, rebalance="never")
INVALIDATE = dict(n_layer=2, steps=4, rebalance="never", invalidate={"step": 2, "rank": 1})
RESTART = dict(case="restart", n_layer=2, steps=6, batch=8, n_samples=24, ckpt_every=3, kill_at=4, resume="last",
               balancer="partition_time", rebalance="every_n", rebalance_interval=2, save_state=True, late_start=4)


def _cases(checkpoints: dict[str, str]) -> list[dict]:
    runs = [dict(case="view", model="view", n_layer=4, schedule=s, partition=_view_partition(s), steps=2,
                 rebalance="never") for s in SCHEDULES]
    runs += [
        dict(case="nonfinite_error", model="nan_loss", n_layer=2, steps=4),
        dict(case="nonfinite_skip", model="nan_loss", n_layer=2, steps=4, on_nonfinite="skip"),
        dict(case="balancer_setup", n_layer=2, steps=2, balancer="rank_dependent_setup"),
        dict(case="balancer_later", n_layer=2, steps=3, balancer="rank_dependent_later", rebalance="every_n",
             rebalance_interval=1),
        dict(case="vector_loss", model="vector_loss", n_layer=2, steps=2),
        dict(case="detached_loss", model="detached_loss", n_layer=2, steps=2),
        *[dict(case=f"profile_{s}", n_layer=4, steps=2, schedule=s, rebalance="on_event") for s in ZERO_BUBBLE],
        dict(case="short_setup", n_layer=2, steps=2, balancer="one_layer_short"),
        dict(case="short_later", n_layer=2, steps=3, balancer="one_layer_short_later", rebalance="every_n",
             rebalance_interval=1),
        dict(case="bare_partition", n_layer=2, steps=2, balancer="bare_partition"),
        dict(PARTIAL, case="partial_last_batch"),
        dict(PARTIAL, case="partial_unrunnable", n_samples=25),
        dict(case="augment", n_layer=2, steps=4, augment=True, dropout=0.1),
        dict(UNFREEZE, case="unfreeze"),
        dict(case="finetune", n_layer=4, steps=4, n_samples=16, partition=[0, 2, 7], rebalance="never"),
        dict(REPACK_RANK0, case="repack_rank0"),
        dict(INVALIDATE, case="invalidate_one_rank"),
        dict(case="warn_training_step", model="step_logging", n_layer=2, steps=2),
        dict(case="hook", model="hook", n_layer=2, steps=3),
        dict(case="request_under_never", n_layer=2, steps=3, rebalance="never"),
        dict(case="order", n_layer=2, steps=4, n_samples=64),
        dict(case="fit_twice", n_layer=2, steps=2),
        dict(RESTART, case="restart_reference", resume=None),
    ]
    runs += [dict(case=f"ckpt_{name}", n_layer=4, steps=2, resume=checkpoints[name]) for name, _ in BAD_CHECKPOINTS]
    runs += [dict(TIED_CKPT, case="ckpt_tied_resume", steps=3, resume=checkpoints["tied"], save_state=True)]
    return runs


@pytest.fixture(scope="module")
def cases(tmp_path_factory, checkpoints):
    runs = _cases(checkpoints)
    proc, results = launch(tmp_path_factory.mktemp("cases"), 2, runs)
    assert results is not None, (proc.stdout[-3000:], proc.stderr[-6000:])
    return {r["case"] + (f"_{r['schedule']}" if r["case"] == "view" else ""): res for r, res in zip(runs, results)}


def _errors(res: dict) -> list[str | None]:
    return [r["error"] for r in res["per_rank"]]


def _assert_fails_everywhere(res: dict, *needles: str) -> None:
    errors = _errors(res)
    for rank, err in enumerate(errors):
        assert err is not None, f"rank {rank} trained on silently: {res['per_rank'][rank]['losses']}"
        for needle in needles:
            assert needle in err, f"rank {rank}: {needle!r} not in {err!r}"


# ---------------------------------------------------------------------------------- item 6
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_stage_ending_in_a_view_works_under_every_schedule(cases, schedule):
    res = cases[f"view_{schedule}"]
    assert _errors(res) == [None, None], _errors(res)
    losses = res["per_rank"][0]["losses"]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(res["reference_loss"], rel=1e-5)


# ---------------------------------------------------------------------------------- item 3
def test_a_non_finite_training_loss_stops_every_rank_naming_the_step(cases):
    _assert_fails_everywhere(cases["nonfinite_error"], "non-finite", "step 2", "on_nonfinite")


def test_on_nonfinite_skip_skips_the_step_and_keeps_training(cases):
    res = cases["nonfinite_skip"]
    assert _errors(res) == [None, None], _errors(res)
    losses = res["per_rank"][0]["losses"]
    assert math.isnan(losses[2]) and all(math.isfinite(x) for i, x in enumerate(losses) if i != 2), losses
    assert res["per_rank"][0]["global_step"] == 4 and len(losses) == 4


# ---------------------------------------------------------------------------------- item 4
@pytest.mark.parametrize("when", ["setup", "later"])
def test_a_non_deterministic_balancer_fails_on_every_rank(cases, when):
    _assert_fails_everywhere(cases[f"balancer_{when}"], "rank_dependent_", "not deterministic")


# ---------------------------------------------------------------------------------- item 5
def test_a_non_scalar_pipeline_loss_names_the_fix(cases):
    _assert_fails_everywhere(cases["vector_loss"], "pipeline_loss", "scalar", "[32]")


# ------------------------------------------------------------------- issue 26, item 2
def test_a_pipeline_loss_that_needs_no_grad_fails_on_every_rank(cases):
    """One process raises on ``loss.backward()``; the pipeline used to train nothing."""
    _assert_fails_everywhere(cases["detached_loss"], "DetachedLossGPT.pipeline_loss", "does not require grad",
                             ".detach()")


# ------------------------------------------------------------------- issue 26, item 5
@pytest.mark.parametrize("schedule", ZERO_BUBBLE)
def test_zero_bubble_profiles_the_first_stages_backward(cases, schedule):
    """torch runs the first stage's whole backward in its weight pass (its input, token ids,
    needs no gradient); its layers must not look free to the balancers and the simulator."""
    res = cases[f"profile_{schedule}"]
    assert _errors(res) == [None, None], _errors(res)
    costs = res["per_rank"][0]["costs"]
    # (the embedding and the first block sit on the first stage; they used to report exactly 0.0;
    # how large a time is measured on a shared machine is too noisy to assert)
    assert all(b > 0 for b in costs["backward"]), costs


# ------------------------------------------------------------------- issue 26, item 10
@pytest.mark.parametrize("case,needles", [
    ("short_setup", ["'one_layer_short'", "(4 layers in 2 stages)", "5 layers in 2 stages"]),
    ("short_later", ["'one_layer_short_later'", "problem.num_layers"]),
    ("bare_partition", ["'bare_partition'", "returned Partition, not a BalanceResult", "wrap it"]),
])
def test_a_balancer_result_of_the_wrong_kind_or_size_fails_on_every_rank_naming_it(cases, case, needles):
    _assert_fails_everywhere(cases[case], "BalancerResultError", *needles)


# ------------------------------------------------------------------- issue 26, item 11
def test_a_partial_last_batch_trains_like_one_process(cases):
    """It runs as fewer micro-batches (3 of 2 samples: the mean loss over its 6 samples); it used
    to fail at that step."""
    res = cases["partial_last_batch"]
    assert _errors(res) == [None, None], _errors(res)
    reference = _single_process_losses(PARTIAL, PARTIAL["steps"])
    assert res["per_rank"][0]["losses"] == pytest.approx(reference, rel=1e-5)


def test_a_partial_last_batch_no_schedule_can_run_fails_before_the_first_step(cases):
    res = cases["partial_unrunnable"]  # 1 sample left: 1F1B on 2 ranks needs 2 micro-batches
    _assert_fails_everywhere(res, "PartialBatchError", "holds 1 samples (8 in the others)", "drop_last=True")
    assert all(r["losses"] == [] for r in res["per_rank"]), res


# ------------------------------------------------------------------- issue 26, item 1
def test_batches_that_drift_apart_after_the_first_step_stop_every_rank(cases):
    """A dataset augmenting with the global RNG, dropout on: the ranks' RNGs drift apart after
    step 0, so stage 0's inputs and the last stage's targets came from different draws."""
    res = cases["augment"]
    _assert_fails_everywhere(res, "PipelineBatchMismatchError", "different batches (step 1)", "global RNG",
                             "torch.Generator().manual_seed")
    assert all(len(r["losses"]) == 1 for r in res["per_rank"]), res  # step 0 agreed and trained


# ------------------------------------------------------------------- issue 26, item 7
def test_a_repack_requested_on_rank_0_only_is_agreed_and_packs(cases):
    """Requests are agreed like rebalance requests (it used to hang: rank 0 packed alone)."""
    res = cases["repack_rank0"]
    assert _errors(res) == [None, None], _errors(res)
    assert [r["pipeline_ranks"] for r in res["per_rank"]] == [1, 1]
    reference = _single_process_losses(REPACK_RANK0, REPACK_RANK0["steps"])
    assert res["per_rank"][0]["losses"] == pytest.approx(reference, rel=1e-5)


def test_stages_dropped_on_one_rank_are_rebuilt_on_every_rank(cases):
    """One rank forgets its stages (GradualPruning compressing only its layers): it used to
    rediscover the shape table alone, sending objects where its neighbour sent activations, and
    gloo aborted every rank (at_scale pruning, 8 stages x 2 replicas, on a 16-core machine)."""
    res = cases["invalidate_one_rank"]
    assert _errors(res) == [None, None], _errors(res)
    reference = _single_process_losses(INVALIDATE, INVALIDATE["steps"])
    assert res["per_rank"][0]["losses"] == pytest.approx(reference, rel=1e-5)


# ------------------------------------------------------------------- issue 26, item 8
def test_unfreezing_a_frozen_stage_by_hand_trains_like_one_process(cases):
    """The stages were built while stage 0 was frozen (it sent no gradient); it used to fail in
    torch's stage backward on one rank and hang the other."""
    res = cases["unfreeze"]
    assert _errors(res) == [None, None], _errors(res)
    reference = _single_process_losses(UNFREEZE, UNFREEZE["steps"],
                                       callbacks=[FreezeThenUnfreeze(**UNFREEZE["unfreeze"])])
    assert res["per_rank"][0]["losses"] == pytest.approx(reference, rel=1e-5)


def test_a_param_group_added_mid_run_is_refused_on_every_rank(cases):
    res = cases["finetune"]  # BaseFinetuning.unfreeze_and_add_param_group at epoch 1 (step 2)
    _assert_fails_everywhere(res, "OptimizerGroupsChangedError", "unfreeze_and_add_param_group", "configure_optimizers",
                             "requires_grad_(True)")
    assert all(len(r["losses"]) == 2 for r in res["per_rank"]), res


# ---------------------------------------------------------------------------------- item 9
def test_skipped_training_step_warns_once_and_the_loss_hook_runs(cases):
    warned = [w for w in cases["warn_training_step"]["per_rank"][0]["warnings"] if "training_step" in w]
    assert len(warned) == 1 and "on_pipeline_train_loss" in warned[0] and "self.log" in warned[0], warned
    hook = cases["hook"]
    assert _errors(hook) == [None, None]
    for rank in hook["per_rank"]:
        assert not [w for w in rank["warnings"] if "training_step" in w]
        assert [b for b, _ in rank["hook_calls"]] == [0, 1, 2]
        assert [loss for _, loss in rank["hook_calls"]] == pytest.approx(rank["losses"], rel=1e-6)


# ---------------------------------------------------------------------------------- item 0
def test_a_second_fit_on_the_split_module_refuses_on_every_rank(cases):
    res = cases["fit_twice"]
    assert all(r["global_step"] == 2 for r in res["per_rank"]), res  # the first fit trained
    _assert_fails_everywhere(res, "already split", "fresh module", "ckpt_path")


def test_a_request_under_never_warns_once_naming_the_option(cases):
    res = cases["request_under_never"]
    assert _errors(res) == [None, None]
    warned = [w for w in res["per_rank"][0]["warnings"] if "request_rebalance" in w]
    assert len(warned) == 1 and "rebalance='never'" in warned[0] and "rebalance='auto'" in warned[0], warned


# ---------------------------------------------------------------------------------- item 9b
def test_one_replica_sees_the_loaders_own_order(cases):
    res = cases["order"]
    expected = [x[:, 0].tolist() for x, _ in make_loader({"n_samples": 64}, 8)][:4]
    for rank in res["per_rank"]:
        assert rank["order"] == expected


# ---------------------------------------------------------------------------------- items 2, 3, 8
@pytest.mark.parametrize("name,needles", BAD_CHECKPOINTS, ids=[n for n, _ in BAD_CHECKPOINTS])
def test_a_bad_checkpoint_is_refused_on_every_rank_naming_the_entry(cases, name, needles):
    _assert_fails_everywhere(cases[f"ckpt_{name}"], *needles)


# ---------------------------------------------------------------------------------- item 1
def test_a_tied_checkpoint_resumes_on_the_pipeline_like_in_one_process(cases, checkpoints):
    """A single-process checkpoint of the tied GPT (both names of the tied parameter, one
    optimizer slot) resumes on 2 stages, where the embedding and the head live on different ranks,
    and continues with the losses of a single-process resume."""
    res = cases["ckpt_tied_resume"]
    assert _errors(res) == [None, None], _errors(res)
    reference = _single_process_losses(TIED_CKPT, 3, ckpt_path=checkpoints["tied"])
    assert res["per_rank"][0]["losses"] == pytest.approx(reference, rel=1e-5)
    state = torch.load(res["state"])
    assert torch.equal(state["layers.0.wte.weight"], state["layers.6.lm_head.weight"])


def _tied_reference(cfg: dict, dp: int):
    """Single-process training of the tied GPT: per-step losses of plain Lightning, and the final
    weights / Adam state of training on the pipeline's micro-batches (gradients summed over
    micro-batches, / m, averaged over replicas, clipped by torch's clip_grad_norm_)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rec = LossRecorder()
        L.Trainer(accelerator="cpu", devices=1, max_steps=cfg["steps"], logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                  gradient_clip_val=cfg.get("clip"), callbacks=[rec]).fit(
            make_model(cfg), train_dataloaders=make_loader(cfg, cfg["batch"] * dp, reference=True, dp=dp))
        model = make_model(cfg)
        conf = model.configure_optimizers()
        opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
        m = cfg["microbatches"]
        loader = iter(make_loader(cfg, cfg["batch"] * dp, reference=True, dp=dp))
        for _ in range(cfg["steps"]):
            x, y = next(loader)
            replicas = []
            for r in range(dp):  # summed in the pipeline's order: micro-batches, / m, then replicas, / dp
                acc = None
                for xm, ym in zip(torch.tensor_split(x[r::dp], m), torch.tensor_split(y[r::dp], m)):
                    opt.zero_grad(set_to_none=True)
                    model.pipeline_loss(model(xm), ym).backward()
                    grads = [p.grad for p in model.parameters()]
                    acc = grads if acc is None else [a + g for a, g in zip(acc, grads)]
                replicas.append([a / m for a in acc])
            for i, p in enumerate(model.parameters()):
                g = replicas[0][i]
                for other in replicas[1:]:
                    g = g + other[i]
                p.grad = g / dp if dp > 1 else g
            if cfg.get("clip"):
                torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], cfg["clip"])
            opt.step()
            sched.step()
    finally:
        torch.set_num_threads(threads)
    return rec.losses, model.state_dict(), opt.state_dict()


# fp32 rounding of the tied gradient's other summation order, amplified by Adam over 5 steps (measured:
# <= 1e-5); a wrong tied gradient (counted twice, lost, scaled twice) is off by tens of percent
TIED_TOL = 5e-5


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)


@pytest.fixture(scope="module")
def tied_results(tmp_path_factory):
    base = dict(steps=5, batch=8, microbatches=4, clip=0.3, tied=True, rebalance="every_n", balancer="test_cycle")
    two = [dict(base, pp=2, schedule=s) for s in ("1f1b", "interleaved_1f1b", "zbv")]
    four = [dict(base, pp=2, schedule="1f1b"), dict(base, pp=4, schedule="gpipe")]
    tmp = tmp_path_factory.mktemp("tied")
    return [(two, run_worker(tmp / "two", 2, two)), (four, run_worker(tmp / "four", 4, four))]


@pytest.mark.parametrize("job,index", [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)],
                         ids=["pp2-1f1b", "pp2-interleaved", "pp2-zbv", "pp2xdp2-1f1b", "pp4-gpipe"])
def test_tied_embedding_gpt_matches_single_process(tied_results, job, index):
    """GPT-2's tied embedding/LM head under a migration before every step (the head and the
    embedding meet on one rank and part again): the same losses as single-process training, and
    the same final weights and Adam state up to fp32 rounding. (The tied gradient is summed per
    owner and then over the owners, not per micro-batch, so agreement is to rounding, measured
    relative to each tensor's largest entry.) Gradient clipping is on and triggers every step."""
    runs, results = tied_results[job]
    res, cfg = results[index], runs[index]
    ref_losses, ref_state, ref_optim = _tied_reference(cfg, res["dp"])
    for step, (a, b) in enumerate(zip(res["losses"], ref_losses)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: pipeline loss {a} != single-process {b}"
    assert sum(1 for r in res["history"] if r.get("applied")) == cfg["steps"] - 1
    state = torch.load(res["state"])
    assert set(state) == set(ref_state)  # both names of the tied parameter, as in one process
    head = f"layers.{len(make_model(cfg).layers) - 1}.lm_head.weight"
    assert torch.equal(state["layers.0.wte.weight"], state[head])  # the copies stayed identical
    for k, v in ref_state.items():
        assert _rel_err(state[k], v) <= TIED_TOL, (k, _rel_err(state[k], v))
    optim = torch.load(res["optim"], weights_only=False)
    assert [g["params"] for g in optim["param_groups"]] == [g["params"] for g in ref_optim["param_groups"]]
    assert set(optim["state"]) == set(ref_optim["state"])  # one optimizer slot for the tied parameter
    for i, st in ref_optim["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            assert _rel_err(optim["state"][i][name], st[name]) <= TIED_TOL, (i, name)
        assert float(optim["state"][i]["step"]) == float(st["step"])


# ---------------------------------------------------------------------------------- item 13
def test_a_lost_rank_restarts_and_resumes_from_the_last_checkpoint(tmp_path, cases):
    proc, results = launch(tmp_path, 2, [RESTART], extra=("--max-restarts", "1"), timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert results is not None
    resumed = results[0]
    assert resumed["restart_count"] == "1", out[-4000:]  # written by the second attempt
    assert [r["error"] for r in resumed["per_rank"]] == [None, None]
    assert len(resumed["per_rank"][0]["losses"]) == 3  # the second attempt ran steps 3..5 only
    ref = cases["restart_reference"]
    ref_losses = ref["per_rank"][0]["losses"]
    assert resumed["per_rank"][0]["losses"] == pytest.approx(ref_losses[3:], rel=1e-6)
    got, want = torch.load(resumed["state"]), torch.load(ref["state"])
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=0, msg=k)


def test_no_rank_outlives_a_killed_launcher(tmp_path):
    tmp_path.mkdir(parents=True, exist_ok=True)
    spec, out = tmp_path / "spec.json", tmp_path / "result.json"
    spec.write_text(json.dumps({"out": str(out), "runs": [dict(case="crawl", n_layer=2, steps=10_000, n_samples=64)]}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", str(WORKER),
           str(spec)]
    launcher = subprocess.Popen(cmd, cwd=ROOT, env=worker_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids: list[int] = []
    try:
        deadline = time.time() + 90
        while time.time() < deadline and len(pids) < 2:
            pids = [int((tmp_path / f"pid{r}").read_text()) for r in (0, 1) if (tmp_path / f"pid{r}").is_file()]
            time.sleep(0.2)
        assert len(pids) == 2, "the ranks did not start training"
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        deadline = time.time() + 20
        while time.time() < deadline and any(alive(p) for p in pids):
            time.sleep(0.2)
        assert not [p for p in pids if alive(p)], "ranks outlived their launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for p in pids:  # clean up what this test started, by pid
            if alive(p):
                os.kill(p, signal.SIGKILL)


# ------------------------------------------------------------------- issue 26, item 6
def test_trainer_test_and_validate_after_a_repack_equal_single_process(tmp_path):
    """After ``request_repack(1)`` at step 2 rank 1 is released; ``trainer.test`` and then
    ``trainer.validate`` on the same trainer used to hang (the kept rank in shape discovery on
    the unpacked group, the released rank in the loss exchange)."""
    from tests.distributed.test_equivalence import base, check_evaluation

    cfg = base(steps=4, request_repack=[2, 1], evaluate={"val_batches": 2, "test": True, "validate": True},
               timeout=20)
    res = run_worker(tmp_path, 2, [cfg], timeout=300)[0]
    assert [h["ranks_after"] for h in res["history"] if h.get("kind") == "repack"] == [1], res["history"]
    assert res["released_per_rank"] == [False, True]
    check_evaluation(res, cfg)  # validation inside fit and trainer.test, against one process
    assert "validate_error" not in res, res["validate_error"]
    assert res["validate_metrics"]["val_loss"] == pytest.approx(res["metrics"]["val_loss"], rel=1e-6)
