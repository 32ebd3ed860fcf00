"""Bad options and modules fail at construction, before any process starts, naming the fix."""
from __future__ import annotations

import lightning as L
import pytest

from lightning_dynmo import DynMoStrategy
from lightning_dynmo.protocol import PipelineProtocolError, pipeline_layers_of


def test_unknown_schedule_lists_valid_ones():
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'.*1f1b.*gpipe.*interleaved_1f1b"):
        DynMoStrategy(schedule="pipedream")


def test_unknown_balancer_lists_valid_ones():
    with pytest.raises(ValueError, match="diffusion_time.*partition_time.*uniform"):
        DynMoStrategy(balancer="magic")


def test_1f1b_with_fewer_microbatches_than_stages():
    with pytest.raises(ValueError, match="at least as many micro-batches as pipeline ranks.*microbatches=2 < pipeline_parallel=4"):
        DynMoStrategy(pipeline_parallel=4, schedule="1f1b", microbatches=2)
    DynMoStrategy(pipeline_parallel=4, schedule="gpipe", microbatches=2)  # GPipe has no such limit


@pytest.mark.parametrize("kw", [{"pipeline_parallel": 0}, {"microbatches": -1}, {"rebalance": "sometimes"},
                                {"rebalance_interval": 0}, {"memory_capacity": -5}, {"virtual_stages": 2},
                                {"timeout": 0}, {"repack": "sometimes"}, {"repack_tolerance": 2.0}])
def test_nonsense_options_are_rejected(kw):
    with pytest.raises(ValueError):
        DynMoStrategy(**kw)


def test_devices_not_divisible_by_pipeline_parallel_fails_before_launch():
    with pytest.raises(ValueError, match="multiple of pipeline_parallel"):
        L.Trainer(strategy=DynMoStrategy(pipeline_parallel=2), accelerator="cpu", devices=3)


def test_module_without_protocol_names_what_is_missing():
    class Plain(L.LightningModule):
        pass

    with pytest.raises(PipelineProtocolError, match="does not define pipeline_layers and pipeline_loss"):
        pipeline_layers_of(Plain())


def test_every_consumer_is_built_from_the_validated_options():
    """The constructor's options are validated once into PipelineOptions; the rebalancer's policy,
    budget, recorder and re-pack target come from it (no second copy of the raw values)."""
    s = DynMoStrategy(rebalance="every_n", rebalance_interval=7, imbalance_threshold=0.2, rebalance_horizon=300,
                      rebalance_cooldown=3, rebalance_hysteresis=0.25, profile_steps=2, overhead_budget=0.5,
                      repack="auto", repack_tolerance=0.1, plot=False, plot_interval=9, balancer="diffusion_time")
    o, r = s.options, s.rebalancer
    assert r.options is o and r.balancer == "diffusion_time" and r.controller.repack == "auto"
    p = r.policy
    assert (p.mode, p.interval, p.threshold, p.horizon, p.cooldown, p.hysteresis, p.profile_steps) == \
        ("every_n", 7, 0.2, 300, 3, 0.25, 2)
    assert (r.controller.budget.fraction, r.controller.budget.window) == (0.5, 300)
    assert (r.recorder.plot, r.recorder.plot_interval) == (False, 9)
    with pytest.raises(ValueError, match="overhead_budget"):
        DynMoStrategy(overhead_budget=-1)
    with pytest.raises(ValueError, match="hysteresis"):
        DynMoStrategy(rebalance_hysteresis=1.5)
