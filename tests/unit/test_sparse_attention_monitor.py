"""SparseAttentionMonitor: logs per-layer block densities of hash-sparse attention and asks a
pipeline strategy to rebalance from the load counters when the density profile shifts."""
from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_dynmo import SparseAttentionMonitor
from lightning_dynmo.models import GPT, GPTConfig
from tests.unit.test_moe import PipelineLikeStrategy

CFG = GPTConfig.preset("tiny", block_size=128, attention=("hash_sparse", "dense", "hash_sparse", "hash_sparse"),
                       attention_block=16, nb_hash=(1, 1, 2, 4))
SPARSE_LAYERS = {1, 3, 4}  # pipeline indices (layer 0 is the embedding)


def fit(monitor: SparseAttentionMonitor, steps: int = 3, strategy=None):
    data = torch.randint(0, 256, (4 * steps, 129), generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=4)
    model = GPT(CFG, seed=0, warmup_steps=0)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, strategy=strategy or "auto", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[monitor])
    trainer.fit(model, loader)
    return trainer, model


def test_logs_each_sparse_layer_and_requests_a_rebalance():
    monitor, strategy = SparseAttentionMonitor(shift_threshold=0.05), PipelineLikeStrategy()
    trainer, model = fit(monitor, strategy=strategy)
    metrics = trainer.logged_metrics
    assert set(monitor.last_stats) == SPARSE_LAYERS
    for i in SPARSE_LAYERS:  # the last step's window, as the block measured it
        block = model.pipeline_layers()[i]
        assert float(metrics[f"attn/block_density_L{i}"]) == pytest.approx(block.density_stats())
        assert float(metrics[f"attn/load_L{i}"]) == pytest.approx(block.relative_work(block.density_stats()))
    assert "attn/block_density_L2" not in metrics  # a dense layer
    densities = [monitor.last_stats[i]["density"] for i in sorted(SPARSE_LAYERS)]
    assert densities[0] == 1.0 and 0 < densities[2] < densities[1] < 1  # one bucket is dense; more, sparser
    assert float(metrics["attn/block_density_spread"]) == pytest.approx(max(densities) - min(densities))
    # the first measurement moved away from the dense baseline 1.0: one request at step 1
    assert strategy.requests and strategy.requests[0].startswith("attn: block density of layer")
    assert monitor.requests[0]["step"] == 1
    assert monitor.baseline.keys() == SPARSE_LAYERS
    state = monitor.state_dict()
    again = SparseAttentionMonitor()
    again.load_state_dict(state)
    assert again.baseline == monitor.baseline and again.requests == monitor.requests


def test_a_shift_below_the_threshold_requests_nothing_and_interval_spaces_checks():
    monitor, strategy = SparseAttentionMonitor(shift_threshold=0.99, check_interval=2), PipelineLikeStrategy()
    fit(monitor, steps=2, strategy=strategy)
    assert not strategy.requests and not monitor.requests
    assert set(monitor.last_stats) == SPARSE_LAYERS  # measured at step 1 (the first of every two)


def test_plain_lightning_logs_without_requests():
    monitor = SparseAttentionMonitor()
    trainer, _ = fit(monitor, steps=1)
    assert "attn/block_density_L1" in trainer.logged_metrics and not monitor.requests


def test_bad_input():
    with pytest.raises(TypeError, match="attention='hash_sparse'"):
        SparseAttentionMonitor().setup(None, GPT(GPTConfig.preset("tiny")), "fit")
    with pytest.raises(ValueError, match="shift_threshold"):
        SparseAttentionMonitor(shift_threshold=0)
    with pytest.raises(ValueError, match="check_interval"):
        SparseAttentionMonitor(check_interval=0)
