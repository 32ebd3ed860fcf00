"""Layers that pass two tensors: a 2-rank pipeline with a migration before every step equals
single-process training, under every schedule (the toy model: tests/support/two_stream.py). Its
layers also count in a buffer the rows their training forward saw: the pipeline runs each
micro-batch's forward once, and no other forward changes a buffer (the shape discovery used to
add one: BatchNorm's running statistics took an extra update)."""
from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_dynmo import available_schedules
from tests.support.multiproc import ROOT, run_named
from tests.support.two_stream import TwoStreamLM
from tests.support.workers.common import LossRecorder, two_stream_loader

pytestmark = [pytest.mark.slow, pytest.mark.compat]  # compat: also on the lowest torch (CI)
WORKER = ROOT / "tests" / "support" / "workers" / "tuple_worker.py"
STEPS, BATCH = 4, 8
RUNS = {s: {"schedule": s, "steps": STEPS, "batch": BATCH} for s in available_schedules()}
RUNS["checkpointed"] = {"schedule": "1f1b", "steps": STEPS, "batch": BATCH, "activation_checkpointing": True}


@pytest.fixture(scope="module")
def reference():
    rec = LossRecorder()
    model = TwoStreamLM(count_rows=True)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[rec])
    trainer.fit(model, train_dataloaders=two_stream_loader(BATCH))
    return rec.losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_named(tmp_path_factory.mktemp("tuple"), 2, RUNS, worker=WORKER)


@pytest.mark.parametrize("name", list(RUNS))
def test_two_tensor_layers_match_single_process(results, reference, name):
    res = results[name]
    want_losses, want_state = reference
    torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(want_losses), rtol=1e-5, atol=0)
    assert sum(1 for h in res["history"] if h.get("applied")) == STEPS - 1, res["history"]
    state = torch.load(res["state"])
    assert state.keys() == want_state.keys()
    counting = not RUNS[name].get("activation_checkpointing", False)
    for k, v in want_state.items():
        if k.endswith("rows_seen"):
            assert int(state[k]) == (int(v) if counting else 0) and int(v) == STEPS * BATCH, (k, state[k], v)
            continue
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-7, msg=lambda m: f"{k}: {m}")
