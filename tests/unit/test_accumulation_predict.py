"""The pure parts of gradient accumulation and prediction (strategy/accumulation.py,
strategy/predict.py); the distributed tests compare both with single-process Lightning."""
from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

from lightning_dynmo.runtime.step_stats import StepStats
from lightning_dynmo.strategy.accumulation import AccumulationWindow, combine
from lightning_dynmo.strategy.predict import predict_inputs, skipped_predict_step_warning


def stats(busy, wall, loads, profiled=False, loss=1.0) -> StepStats:
    return StepStats(torch.tensor(loss), profiled, list(busy), list(wall), list(loads))


def test_a_window_sums_seconds_averages_loads_and_keeps_the_last_loss():
    got = combine([stats([1.0, 2.0], [3.0, 3.0], [0.5, None, 1.0], loss=5.0),
                   stats([2.0, 1.0], [4.0, 4.0], [1.0, None, None], profiled=True, loss=7.0)])
    assert got.rank_busy == [3.0, 3.0] and got.rank_wall == [7.0, 7.0]
    assert got.layer_load == [0.75, None, 1.0]
    assert got.profiled and float(got.loss) == 7.0


def test_a_batch_before_a_repack_is_left_out_of_the_seconds():
    got = combine([stats([1.0, 1.0], [1.0, 1.0], []), stats([5.0], [6.0], [])])
    assert got.rank_busy == [5.0] and got.rank_wall == [6.0]


def test_window_positions_follow_lightnings_rules():
    w = AccumulationWindow()
    assert w.begin_batch(0, 1) and w.last  # no accumulation: every batch opens and closes its window
    assert w.begin_batch(4, 2) and not w.last  # a window's first batch runs outside optimizer_step
    assert not w.begin_batch(5, 2)
    with w.closing():
        assert w.last  # its closure runs inside optimizer_step
    assert not w.last


def test_running_sum_leaves_grad_during_a_batch_and_is_added_back():
    w = AccumulationWindow()
    p = nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([1.0, 2.0])
    w.begin_batch(0, 2)
    w.set_aside([p])  # a window's first batch: the last window's gradients are dropped
    assert p.grad is None
    p.grad = torch.tensor([0.5, 0.5])  # the first batch's
    w.add_batch()
    assert torch.equal(p.grad, torch.tensor([0.5, 0.5]))
    w.begin_batch(1, 2)
    w.set_aside([p])
    assert p.grad is None
    p.grad = torch.tensor([0.25, 1.0])
    w.add_batch()
    assert torch.equal(p.grad, torch.tensor([0.75, 1.5]))


def test_losses_are_divided_by_k_for_backward_and_reported_whole():
    w = AccumulationWindow()
    w.begin_batch(0, 4)
    fn = w.scaled(lambda out, tgt: (out - tgt).square().mean())
    loss = fn(torch.tensor([3.0]), torch.tensor([1.0]))
    assert float(loss) == 1.0
    assert [float(v) for v in w.batch_losses([loss])] == [4.0]
    ints = w.scaled(lambda out, tgt: (out - tgt).sum())
    assert ints(torch.tensor([3]), torch.tensor([1])).dtype == torch.int64  # left for the engine to name


def test_a_nonfinite_batch_skips_the_whole_window():
    w = AccumulationWindow()
    w.begin_batch(0, 2)
    assert w.note(stats([1.0], [1.0], []), apply=False) is None  # mid-window: nothing for the rebalancer
    w.begin_batch(1, 2)
    with w.closing():
        assert w.note(stats([1.0], [1.0], []), apply=True) is not None
    assert not w.apply
    w.begin_batch(2, 2)
    assert w.apply  # a new window starts clean


def test_predict_batches_may_carry_targets_or_not():
    x = torch.zeros(2, 3)
    assert predict_inputs(x) is x and predict_inputs([x]) is x and predict_inputs((x, x + 1)) is x
    with pytest.raises(TypeError, match="inputs, \\(inputs,\\) or \\(inputs, targets\\)"):
        predict_inputs({"x": x})


def test_a_predict_step_without_pipeline_predict_is_named():
    class Own(L.LightningModule):
        def predict_step(self, batch, batch_idx):
            return batch

    class Hooked(Own):
        def pipeline_predict(self, output, batch, batch_idx):
            return output

    assert "Own.predict_step is not called" in skipped_predict_step_warning(Own())
    assert skipped_predict_step_warning(Hooked()) is None
    assert skipped_predict_step_warning(L.LightningModule()) is None
