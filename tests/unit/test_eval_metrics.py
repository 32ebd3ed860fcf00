"""The last stage's evaluation hook, single-process parts: which evaluation steps get a warning,
what the log recorder keeps, and which torchmetrics can be synchronised exactly from the last stage
(the multi-process behaviour: tests/distributed/test_equivalence.py and test_bad_input.py)."""
from __future__ import annotations

import lightning as L
import pytest
import torch
import torchmetrics
from torchmetrics.classification import MulticlassAccuracy

from lightning_dynmo.strategy.eval_metrics import LogRecorder, check_no_step_sync, metric_problems, metrics_of
from lightning_dynmo.strategy.setup_checks import skipped_eval_step_warning
from tests.support.workers.common import make_model


class EvalLogging(L.LightningModule):  # a user model as many are written: metrics in validation_step
    def __init__(self):
        super().__init__()
        self.acc = MulticlassAccuracy(4)

    def validation_step(self, batch, batch_idx):
        self.acc.update(self(batch[0]).argmax(-1), batch[1])
        self.log("val_acc", self.acc)

    test_step = validation_step


def test_evaluation_steps_with_logic_the_pipeline_skips_name_the_hook():
    for stage, step in (("val", "validation_step"), ("test", "test_step")):
        msg = skipped_eval_step_warning(EvalLogging(), stage)
        assert msg and f"EvalLogging.{step}" in msg and "pipeline_eval_step" in msg and "self.log" in msg
        assert f"logs {stage}_loss" in msg

    class WithHook(EvalLogging):
        def pipeline_eval_step(self, output, batch, batch_idx, stage):
            pass

    assert skipped_eval_step_warning(WithHook(), "val") is None
    assert skipped_eval_step_warning(make_model({"n_layer": 2}), "val") is None  # GPT defines the hook
    assert skipped_eval_step_warning(L.LightningModule(), "test") is None


def test_the_recorder_keeps_values_on_the_cpu_and_metrics_by_path():
    module = EvalLogging()
    recorder = LogRecorder(module, metrics_of(module))
    with recorder.recording():
        module.log("val_acc", module.acc, on_epoch=True)
        module.log_dict({"a": torch.tensor(2.0, requires_grad=True), "b": 3})
    assert "log" not in vars(module)  # LightningModule.log is back
    (n0, v0, k0), (n1, v1, _), (n2, v2, _) = recorder.calls
    assert (n0, v0, k0["on_epoch"]) == ("val_acc", ("metric", "acc"), True)
    assert n1 == "a" and v1[0] == "value" and not v1[1].requires_grad and v1[1].item() == 2.0
    assert (n2, v2) == ("b", ("value", 3))
    with pytest.raises(TypeError, match="not an attribute of the module"):
        recorder("stray", MulticlassAccuracy(4))


def test_only_metrics_whose_states_add_up_from_the_last_stage_are_accepted():
    exact = {"acc": MulticlassAccuracy(4), "mean": torchmetrics.MeanMetric(), "max": torchmetrics.MaxMetric(),
             "cat": torchmetrics.CatMetric()}
    assert metric_problems(exact) == []

    class Averaged(torchmetrics.Metric):
        def __init__(self):
            super().__init__()
            self.add_state("v", default=torch.tensor(0.0), dist_reduce_fx="mean")

        def update(self, x):
            self.v += x

        def compute(self):
            return self.v

    (problem,) = metric_problems({"avg": Averaged()})
    assert "avg (Averaged) reduces its state 'v' by 'dim_zero_mean'" in problem
    (problem,) = metric_problems({"m": torchmetrics.MeanMetric(sync_on_compute=False)})
    assert "sync_on_compute=False" in problem
    with pytest.raises(ValueError, match=r"s \(SumMetric\) has dist_sync_on_step=True"):
        check_no_step_sync({"s": torchmetrics.SumMetric(dist_sync_on_step=True), **exact})
