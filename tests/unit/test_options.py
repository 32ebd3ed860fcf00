"""Bad options and modules fail at construction, before any process starts, naming the fix."""
from __future__ import annotations

import lightning as L
import pytest
from lightning.pytorch.callbacks import (EMAWeightAveraging, LearningRateMonitor, ModelCheckpoint, ModelPruning,
                                         StochasticWeightAveraging, WeightAveraging)

from lightning_dynmo import DynMoStrategy
from lightning_dynmo.models import GPT, GPTConfig
from lightning_dynmo.plan.policy import Rebalance
from lightning_dynmo.protocol import PipelineProtocolError, pipeline_layers_of
from lightning_dynmo.strategy.setup_checks import check_fit


def test_unknown_schedule_lists_valid_ones():
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'.*1f1b.*gpipe.*interleaved_1f1b"):
        DynMoStrategy(schedule="pipedream")


def test_unknown_balancer_lists_valid_ones():
    with pytest.raises(ValueError, match="diffusion_time.*partition_time.*uniform"):
        DynMoStrategy(balancer="magic")


def test_1f1b_with_fewer_microbatches_than_stages():
    with pytest.raises(ValueError,
                       match="at least as many micro-batches as pipeline ranks.*microbatches=2 < pipeline_parallel=4"):
        DynMoStrategy(pipeline_parallel=4, schedule="1f1b", microbatches=2)
    DynMoStrategy(pipeline_parallel=4, schedule="gpipe", microbatches=2)  # GPipe has no such limit


def test_dualpipev_needs_two_microbatches_per_rank_and_two_stages_per_rank():
    with pytest.raises(ValueError, match="'dualpipev' needs at least 2 micro-batches per pipeline rank: got "
                                         "microbatches=3 < 2 x pipeline_parallel=4"):
        DynMoStrategy(pipeline_parallel=2, schedule="dualpipev", microbatches=3)
    strategy = DynMoStrategy(pipeline_parallel=2, schedule="dualpipev", microbatches=5)  # not a multiple of 2: fine
    assert strategy.options.virtual_stages == 2 and strategy.options.schedule.v_shape
    with pytest.raises(ValueError, match="'dualpipev' needs exactly 2 stages per rank, got virtual_stages=3"):
        DynMoStrategy(schedule="dualpipev", virtual_stages=3)


@pytest.mark.parametrize("kw", [{"pipeline_parallel": 0}, {"microbatches": -1}, {"rebalance": "sometimes"},
                                {"rebalance_interval": 0}, {"memory_capacity": -5}, {"virtual_stages": 2},
                                {"timeout": 0}, {"repack": "sometimes"}, {"repack_tolerance": 2.0}])
def test_nonsense_options_are_rejected(kw):
    with pytest.raises(ValueError):
        DynMoStrategy(**kw)


@pytest.mark.parametrize("kw, says", [
    ({"plot": "no"}, r"plot must be True or False.*got 'no'"),  # bool("no") was True: plots on
    ({"memory_capacity": "1GB"}, r"memory_capacity must be a positive number of bytes.*got '1GB'"),
    ({"partition": "0,3"}, r"partition must be the stage boundaries.*\(0, 3, 7\).*got '0,3'"),
    ({"timeout": -1}, r"timeout must be a positive number of seconds or a timedelta, got -1$"),
    ({"process_group_backend": "bogus"}, r"process_group_backend must be None .*'gloo'.*'cpu:gloo,cuda:nccl'"),
    ({"pipeline_parallel": 2, "repack": 5}, r"repack=5 can never apply.*pipeline_parallel=2; use a number below 2"),
    ({"pipeline_parallel": 2, "repack": 2}, r"repack=2 can never apply"),
])
def test_options_an_independent_check_found_accepted_are_refused_with_the_fix(kw, says):
    """Each was accepted (plot='no' meant plot=True, repack=5 on 2 ranks trained on with one INFO
    line) or failed later with a raw TypeError or torch's AssertionError."""
    with pytest.raises(ValueError, match=says):
        DynMoStrategy(**kw)


@pytest.mark.parametrize("kw", [{"process_group_backend": "gloo"}, {"process_group_backend": "cpu:gloo,cuda:nccl"},
                                {"partition": [0, 3, 7]}, {"memory_capacity": 8e9}, {"plot": False},
                                {"pipeline_parallel": 4, "repack": 2}])
def test_their_valid_neighbours_still_pass(kw):
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
    o, r = s.options, s.pipeline.rebalancer
    assert r.options is o and r.balancer == "diffusion_time" and r.controller.repack == "auto"
    p = r.policy
    assert (p.rebalance, p.rebalance_interval, p.imbalance_threshold, p.rebalance_horizon, p.rebalance_cooldown,
            p.rebalance_hysteresis, p.profile_steps) == ("every_n", 7, 0.2, 300, 3, 0.25, 2)
    assert p.rebalance is Rebalance.EVERY_N  # the option's string became the one enum member
    assert (r.controller.budget.overhead_budget, r.controller.budget.window) == (0.5, 300)
    assert (r.recorder.plot, r.recorder.plot_interval) == (False, 9)
    with pytest.raises(ValueError, match="overhead_budget"):
        DynMoStrategy(overhead_budget=-1)
    with pytest.raises(ValueError, match="hysteresis"):
        DynMoStrategy(rebalance_hysteresis=1.5)


# ---- link_bandwidth: one rate, or (intra_node, inter_node) mapped onto the stage boundaries ----
@pytest.mark.parametrize("bad", [-1.0, 0, float("nan"), float("inf"), "fast", True, (1e9,), (1e9, 2e9, 3e9),
                                 (1e9, -2.0), ("1e9", 2e9), [1e9, float("nan")], {"intra": 1e9}])
def test_bad_link_bandwidth_names_the_option_and_the_fix(bad):
    with pytest.raises(ValueError, match=r"link_bandwidth must be None, bytes/s .* pair \(intra_node, inter_node\)"):
        DynMoStrategy(link_bandwidth=bad)


def test_link_bandwidth_reaches_the_cost_model():
    from lightning_dynmo.plan.layout import PipelineLayout
    from lightning_dynmo.plan.schedules import get_schedule
    from lightning_dynmo.plan.topology import Topology

    assert DynMoStrategy().options.link_bandwidth is None
    assert DynMoStrategy(link_bandwidth=4.5e10).options.link_bandwidth == 4.5e10
    s = DynMoStrategy(link_bandwidth=[3.6e11, 4.5e10])
    assert s.options.link_bandwidth == (3.6e11, 4.5e10)
    # 8 ranks on 2 nodes of 4, one pipeline: only the boundary between ranks 3 and 4 is inter-node
    layout = PipelineLayout(Topology(8, 8, ranks_per_node=4), get_schedule("1f1b"), 1, global_rank=0)
    assert s.pipeline.rebalancer.cost_model(layout, None).bandwidth == (3.6e11,) * 3 + (4.5e10,) + (3.6e11,) * 3
    assert DynMoStrategy().pipeline.rebalancer.cost_model(layout, None).bandwidth is None
    assert DynMoStrategy(link_bandwidth=2e10).pipeline.rebalancer.cost_model(layout, None).bandwidth == 2e10
    # re-packed onto 4 ranks: all on node 0, one rate
    assert layout.boundary_bandwidth((3.6e11, 4.5e10), 4) == 3.6e11
    # two replicas of 4 ranks, one per node: no boundary crosses nodes
    two = PipelineLayout(Topology(8, 4, ranks_per_node=4), get_schedule("1f1b"), 1, global_rank=5)
    assert two.boundary_bandwidth((3.6e11, 4.5e10)) == 3.6e11
    # pipelines of 4 on nodes of 3: a boundary crossing nodes in any replica is inter-node
    three = PipelineLayout(Topology(8, 4, ranks_per_node=3), get_schedule("1f1b"), 1, global_rank=0)
    assert three.boundary_bandwidth((2.0, 1.0)) == (2.0, 1.0, 1.0)  # ranks 5|6 (replica 1), 2|3 (replica 0)
    # pipelines of 3 on nodes of 4: replica 1 (ranks 3, 4, 5) crosses between its stages 0 and 1
    odd = PipelineLayout(Topology(6, 3, ranks_per_node=4), get_schedule("1f1b"), 1, global_rank=0)
    assert odd.boundary_bandwidth((2.0, 1.0)) == (1.0, 2.0)
    # interleaved: 2 ranks x 2 virtual stages on 2 nodes of 1: every boundary crosses nodes
    inter = PipelineLayout(Topology(2, 2, ranks_per_node=1), get_schedule("interleaved_1f1b"), 2, global_rank=0)
    assert inter.boundary_bandwidth((2.0, 1.0)) == 1.0
    assert PipelineLayout(Topology(4, 4), get_schedule("1f1b"), 1, 0).boundary_bandwidth((2.0, 1.0)) == 2.0  # one node


def test_checkpoint_format_is_single_or_dcp_by_dp_sharding_and_reaches_the_hydra_config():
    from lightning_dynmo.strategy.hydra_config import structured_config
    from lightning_dynmo.strategy.options import CheckpointFormat

    assert DynMoStrategy().options.checkpoint_format is CheckpointFormat.SINGLE
    assert DynMoStrategy(dp_sharding="fsdp").options.checkpoint_format is CheckpointFormat.DCP  # sharded saves sharded
    single = DynMoStrategy(dp_sharding="fsdp", checkpoint_format="single")
    assert single.options.checkpoint_format is CheckpointFormat.SINGLE
    assert DynMoStrategy(checkpoint_format="dcp").options.checkpoint_format is CheckpointFormat.DCP
    with pytest.raises(ValueError, match="checkpoint_format must be one of single, dcp, got 'sharded'"):
        DynMoStrategy(checkpoint_format="sharded")
    assert structured_config()().checkpoint_format is None  # resolved by dp_sharding


class _EveryOtherStep(WeightAveraging):
    """A user's own averaging (the pattern Lightning's docs show): refused like Lightning's."""

    def should_update(self, step_idx=None, epoch_idx=None):
        return step_idx is not None and step_idx % 2 == 0


@pytest.mark.parametrize("callback", [EMAWeightAveraging(), WeightAveraging(), _EveryOtherStep(),
                                      StochasticWeightAveraging(swa_lrs=1e-2)], ids=lambda c: type(c).__name__)
def test_weight_averaging_callbacks_are_refused_at_fit_setup(callback):
    """Each keeps an averaged copy of the whole module and zips it with the module's parameters: under the
    pipeline a rank holds only its layers (the zip pairs the wrong tensors) and layers move between ranks."""
    model = GPT(GPTConfig.preset("tiny"), seed=0)
    name = type(callback).__name__
    with pytest.raises(ValueError, match=rf"^rank 3: DynMoStrategy cannot train with {name}: it keeps an averaged copy "
                                         r"of the whole module.*layers move between ranks.*not supported yet"):
        check_fit(model, pipeline_layers_of(model), 3, [ModelCheckpoint(), callback])


def test_model_pruning_is_refused_naming_gradual_pruning_and_other_callbacks_pass():
    model = GPT(GPTConfig.preset("tiny"), seed=0)
    with pytest.raises(ValueError, match=r"ModelPruning: .*Use lightning_dynmo.callbacks.GradualPruning"):
        check_fit(model, pipeline_layers_of(model), 0, [ModelPruning("l1_unstructured")])
    check_fit(model, pipeline_layers_of(model), 0, [ModelCheckpoint(), LearningRateMonitor()])
