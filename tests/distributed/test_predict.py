"""``trainer.predict`` through the pipeline equals single-process ``trainer.predict`` of the same
weights: after a fit that migrated layers and an explicit ``rebalance_to``, with the module's
``pipeline_predict`` hook (a dict per batch) and without it (the logits), with batches that carry
targets and batches that do not, a partial last batch, and two data-parallel replicas (each rank
returns its replica's predictions, as under DDP). ``trainer.validate`` on the same trainer
afterwards still equals single-process validation, and restores a checkpoint (``ckpt_path``).
"""
from __future__ import annotations

import lightning as L
import pytest
import torch

from tests.support.evaluation import eval_loader
from tests.support.multiproc import ROOT, run_named_pairs
from tests.support.prediction import GPTLogits, GPTPredict, predict_loader
from tests.support.workers.common import make_model

pytestmark = pytest.mark.slow
WORKER = ROOT / "tests" / "support" / "workers" / "predict_worker.py"
RTOL, ATOL = 1e-5, 1e-6

TWO_RANK_RUNS = {
    # fit with a migration before every step, then one more by rebalance_to, then predict + validate
    "after_migrations": {"pp": 2, "steps": 3, "batch": 8, "rebalance": "every_n", "balancer": "test_cycle",
                         "rebalance_to": [0, 5, 9], "n": 30, "validate": True},
    # predict without fit, no hook, input-only batches, an interleaved schedule
    "logits_interleaved": {"pp": 2, "steps": 0, "batch": 8, "schedule": "interleaved_1f1b", "hook": False,
                           "targets": False, "n": 24},
}
FOUR_RANK_RUNS = {
    # 31 samples: replica 0 gets 16 (4 full batches), replica 1 gets 15 (a partial last batch)
    "dp2": {"pp": 2, "steps": 2, "batch": 4, "rebalance": "every_n", "balancer": "test_cycle", "n": 31},
}


def single_process_predictions(cfg: dict, state_path: str, batch: int) -> list:
    cls = GPTPredict if cfg.get("hook", True) else GPTLogits
    model = cls(**make_model(cfg).hparams)
    model.load_state_dict(torch.load(state_path))
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False)
    return trainer.predict(model, predict_loader(cfg, batch, cfg["n"], with_targets=cfg.get("targets", True)))


def single_process_val_loss(cfg: dict, state_path: str) -> float:
    model = GPTPredict(**make_model(cfg).hparams)
    model.load_state_dict(torch.load(state_path))
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False)
    return float(trainer.validate(model, eval_loader(cfg, cfg["batch"]), verbose=False)[0]["val_loss"])


def assert_same_prediction(got, want, what: str) -> None:
    if isinstance(want, dict):
        assert set(got) == set(want), what
        for key in want:
            assert_same_prediction(got[key], want[key], f"{what}[{key!r}]")
    elif isinstance(want, torch.Tensor) and want.is_floating_point():
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got, want), what
    else:
        assert got == want, what


def concat(predictions: list):
    """One batch-major prediction from a list of per-batch ones (``batch_idx`` dropped)."""
    first = predictions[0]
    if isinstance(first, dict):
        return {k: torch.cat([p[k] for p in predictions]) for k in first if k != "batch_idx"}
    return torch.cat(predictions)


def every_row(prediction, rows):
    return {k: v[rows] for k, v in prediction.items()} if isinstance(prediction, dict) else prediction[rows]


@pytest.fixture(scope="module")
def two_rank(tmp_path_factory):
    return run_named_pairs(tmp_path_factory.mktemp("predict2"), 2, TWO_RANK_RUNS, worker=WORKER)


@pytest.fixture(scope="module")
def four_rank(tmp_path_factory):
    return run_named_pairs(tmp_path_factory.mktemp("predict4"), 4, FOUR_RANK_RUNS, worker=WORKER)


@pytest.mark.parametrize("name", list(TWO_RANK_RUNS))
def test_every_rank_returns_the_single_process_predictions(two_rank, name):
    cfg, res = two_rank[name]
    want = single_process_predictions(cfg, res["state"], cfg["batch"])
    per_rank = torch.load(res["predictions"], weights_only=False)
    assert len(want) == -(-cfg["n"] // cfg["batch"])  # the last batch is partial where n is no multiple
    for rank, got in enumerate(per_rank):
        assert len(got) == len(want), (rank, len(got), len(want))
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_prediction(g, w, f"rank {rank}, batch {i}")
    assert res["warned"] == (not cfg.get("hook", True))  # a predict_step without pipeline_predict is named


def test_predict_after_migrations_uses_the_moved_layers(two_rank):
    cfg, res = two_rank["after_migrations"]
    assert sum(h["applied"] for h in res["history"]) == cfg["steps"] - 1
    assert res["partition"] == "0-4|5-8"  # the explicit rebalance_to after fit


def test_validate_after_predict_equals_single_process(two_rank):
    cfg, res = two_rank["after_migrations"]
    assert res["val_loss"] == pytest.approx(single_process_val_loss(cfg, res["state"]), rel=RTOL)


def test_validate_from_a_checkpoint_after_fit_restores_the_weights(two_rank):
    """``trainer.validate(model, ckpt_path=...)`` after fit: the module then holds placeholders for
    the other rank's layers, and the whole-model checkpoint used to be refused on every rank
    ("Unexpected key(s)"). The weights are disturbed before, so only the load gives the loss back."""
    _, res = two_rank["after_migrations"]
    assert abs(res["val_loss_disturbed"] - res["val_loss"]) > 0.1, (res["val_loss_disturbed"], res["val_loss"])
    assert res["val_loss_from_checkpoint"] == pytest.approx(res["val_loss"], rel=RTOL)


def test_two_replicas_return_their_replicas_predictions(four_rank):
    """Each rank returns the batches its replica loaded (samples r, r + 2, ...), as under DDP; the
    two ranks of a pipeline return the same list, and together the replicas cover every sample."""
    cfg, res = four_rank["dp2"]
    assert res["dp"] == 2
    full = concat(single_process_predictions(cfg, res["state"], cfg["batch"]))
    per_rank = torch.load(res["predictions"], weights_only=False)
    pp, dp = cfg["pp"], res["dp"]
    for rank, got in enumerate(per_rank):
        replica = rank // pp
        rows = torch.arange(replica, cfg["n"], dp)
        assert len(got) == -(-len(rows) // cfg["batch"]), (rank, len(got))
        assert_same_prediction(concat(got), every_row(full, rows), f"rank {rank}")
        assert [p["batch_idx"] for p in got] == list(range(len(got)))
