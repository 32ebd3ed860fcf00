"""The notebook/test way of launching: Lightning's spawn launcher with ``strategy="dynmo_spawn"``."""
from __future__ import annotations

import lightning as L
import pytest
import torch

import lightning_dynmo  # noqa: F401  (registers the strategy names)
from lightning_dynmo.data import ByteTextDataModule
from lightning_dynmo.models import GPT, GPTConfig

pytestmark = pytest.mark.slow


def test_spawned_pipeline_trains_and_returns_to_the_main_process(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny"), seed=0)
    dm = ByteTextDataModule(block_size=32, batch_size=8)
    trainer = L.Trainer(strategy="dynmo_spawn", accelerator="cpu", devices=2, max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=2, val_check_interval=3, default_root_dir=tmp_path)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer.fit(model, dm)
    loss = float(trainer.callback_metrics["val_loss"])
    # the main process gets the whole trained model back, not only rank 0's layers: validating it
    # in this process gives exactly the loss the spawned pipeline computed on the same batches
    single = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                       enable_model_summary=False, limit_val_batches=2)
    assert single.validate(model, dm, verbose=False)[0]["val_loss"] == pytest.approx(loss, rel=1e-5)
    after = model.state_dict()
    assert set(after) == set(before)
    changed = [k for k in before if k.startswith("layers.") and not torch.equal(before[k], after[k])]
    last = len(model.pipeline_layers()) - 1
    assert any(k.startswith("layers.0.") for k in changed) and any(k.startswith(f"layers.{last}.") for k in changed)
