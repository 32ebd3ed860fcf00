"""Reliability, the single-process parts: defaults, policy hysteresis and cooldown, plot throttling,
checkpoint file checks, tied-parameter detection, the skipped-training_step warning and the
recipe's checks before launch."""
from __future__ import annotations

import importlib.util
import os
import random
import re
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn

from lightning_dynmo import DynMoStrategy
from lightning_dynmo.plan.balancers import get_balancer
from lightning_dynmo.plan.partition import Partition
from lightning_dynmo.plan.policy import Decision, RebalancePolicy
from lightning_dynmo.protocol import PipelineProtocolError
from tests.support.options import make_policy
from tests.support.workers.common import make_model

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------- item 0
def test_defaults_are_dynamic():
    s = DynMoStrategy()
    assert s.pipeline.rebalancer.policy.rebalance == "auto"
    assert s.pipeline.rebalancer.balancer == "partition_time"
    assert s.options.on_nonfinite == "error"


def test_a_request_under_never_warns_once_naming_the_option():
    s = DynMoStrategy(rebalance="never")
    with pytest.warns(UserWarning, match=r"rebalance='never'.*rebalance='auto'"):
        s.pipeline.request_rebalance("LayerFreezing froze 3 layers")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s.pipeline.request_rebalance("again")  # once is enough


def test_requests_under_other_modes_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DynMoStrategy(rebalance="on_event").pipeline.request_rebalance("x")


# ---------------------------------------------------------------------------------- item 11
def _simulate(policy: RebalancePolicy, imbalances, applied_when=lambda step: False) -> list[int]:
    """Drive the policy like the rebalancer: profile at step s, decide before step s+1."""
    decisions, pending = [], None
    for step, imb in enumerate(imbalances):
        if pending is not None:
            decisions.append(step)
            policy.decided(step, applied=applied_when(step))
            pending = None
        if policy.profile_reason(step):
            pending = step
        policy.observe_busy([1.0 + imb / 2, 1.0 - imb / 2])  # imbalance (max - min) / mean = imb
    return decisions


def test_auto_near_the_threshold_decides_once_not_every_cooldown():
    rng = random.Random(0)
    hovering = [0.1 + rng.uniform(-0.02, 0.02) for _ in range(100)]
    policy = make_policy(rebalance="auto", imbalance_threshold=0.1, rebalance_cooldown=10)
    decisions = _simulate(policy, hovering)
    assert 1 <= len(decisions) <= 2, decisions


def test_a_refused_decision_starts_the_cooldown():
    policy = make_policy(rebalance="auto", imbalance_threshold=0.1, rebalance_cooldown=10, rebalance_hysteresis=0.0)
    decisions = _simulate(policy, [0.5] * 40)
    assert decisions and all(b - a >= 10 for a, b in zip(decisions, decisions[1:])), decisions


def test_auto_rearms_after_the_imbalance_falls_and_fires_when_it_grows():
    policy = make_policy(rebalance="auto", imbalance_threshold=0.1, rebalance_cooldown=2, rebalance_hysteresis=0.5)
    trace = [0.12] * 20 + [0.01] * 20 + [0.12] * 20
    decisions = _simulate(policy, trace)
    assert len([d for d in decisions if d < 20]) == 1
    assert len([d for d in decisions if d >= 40]) == 1, decisions  # re-armed below threshold x (1 - h)
    policy = make_policy(rebalance="auto", imbalance_threshold=0.1, rebalance_cooldown=2, rebalance_hysteresis=0.5)
    decisions = _simulate(policy, [0.12] * 20 + [0.4] * 20)
    assert 1 <= len([d for d in decisions if d >= 20]) <= 2, decisions  # grew beyond refused x (1 + h)


def test_applied_decisions_keep_the_plain_cooldown():
    policy = make_policy(rebalance="auto", imbalance_threshold=0.1, rebalance_cooldown=5)
    decisions = _simulate(policy, [0.5] * 30, applied_when=lambda step: True)
    assert len(decisions) >= 4 and all(b - a >= 5 for a, b in zip(decisions, decisions[1:])), decisions


def test_events_still_trigger_at_once():
    policy = make_policy(rebalance="auto", imbalance_threshold=0.1, rebalance_cooldown=50)
    policy.decided(3, applied=False)
    policy.request("freeze")
    assert policy.profile_reason(4).startswith("event")


def test_hysteresis_is_validated():
    with pytest.raises(ValueError, match="hysteresis"):
        make_policy(rebalance_hysteresis=-0.1)
    with pytest.raises(ValueError, match="hysteresis"):
        DynMoStrategy(rebalance_hysteresis=1.5)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_profile_steps_is_validated(bad):
    with pytest.raises((ValueError, TypeError), match="profile_steps"):
        DynMoStrategy(profile_steps=bad)


# ---------------------------------------------------------------------------------- item 12
def test_plots_only_applied_decisions_at_most_once_per_interval(tmp_path, monkeypatch):
    from lightning_dynmo import plotting
    from lightning_dynmo.plan.cost_model import CostModel, LayerCosts
    from lightning_dynmo.strategy.recorder import DecisionRecorder

    drawn = []
    monkeypatch.setattr(plotting, "save_rebalance_figure", lambda path, *a, **k: drawn.append(os.path.basename(path)))

    class Module:
        def log(self, *a, **k):
            pass

    rec = DecisionRecorder(plot=True, plot_interval=10)
    costs = LayerCosts.from_params([10, 20, 30, 40])
    model = CostModel(microbatches=4)
    p, q = Partition((0, 2, 4)), Partition((0, 3, 4))
    events = [{"rank": 0, "stage": 0, "kind": "F", "mb": 0, "start": 0.0, "end": 1.0}]
    for step in range(30):
        applied = step % 3 != 1
        d = Decision(step=step, reason="every 1 steps", before=str(p), applied=applied, why="")
        rec.record(Module(), d, p, str(tmp_path), True, costs, model, events, p, q if applied else None)
    assert drawn == ["rebalance_step000000.png", "rebalance_step000011.png", "rebalance_step000021.png"], drawn
    assert len((tmp_path / "rebalance_history.jsonl").read_text().splitlines()) == 30  # every decision recorded


def test_plot_interval_is_validated():
    with pytest.raises(ValueError, match="plot_interval"):
        DynMoStrategy(plot_interval=0)


# ---------------------------------------------------------------------------------- items 3, 8
def _tiny_checkpoint(path: Path, **edits) -> dict:
    model = make_model({"n_layer": 2})
    ck = {"state_dict": model.state_dict(), "optimizer_states": [], "epoch": 0, "global_step": 0,
          "pytorch-lightning_version": L.__version__}
    ck.update(edits)
    torch.save(ck, path)
    return ck


def test_random_bytes_are_not_a_checkpoint(tmp_path):
    path = tmp_path / "junk.ckpt"
    path.write_bytes(os.urandom(2048))
    with pytest.raises(Exception, match=r"junk.ckpt is not a checkpoint") as err:
        DynMoStrategy().load_checkpoint(path)
    assert "weights_only=False" not in str(err.value)


def test_a_truncated_or_empty_checkpoint_says_so(tmp_path):
    good = tmp_path / "good.ckpt"
    torch.save({"state_dict": {"w": torch.ones(64, 64)}}, good)
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(Exception, match=r"cut.ckpt is truncated or damaged: it starts as a torch.save archive"):
        DynMoStrategy().load_checkpoint(cut)
    empty = tmp_path / "empty.ckpt"
    empty.write_bytes(b"")
    with pytest.raises(Exception, match=r"empty.ckpt is not a checkpoint: it is an empty file"):
        DynMoStrategy().load_checkpoint(empty)


@pytest.mark.parametrize("entry", ["good/data/3", "good/data.pkl"])  # torch.save names entries after the file
def test_flipped_bytes_inside_a_checkpoint_are_refused_naming_the_entry(tmp_path, entry):
    """torch.load does not check the zip CRCs, so this file loads (wrong values)."""
    from tests.distributed.test_reliability import _flip_bytes_inside

    good, bad = tmp_path / "good.ckpt", tmp_path / "bad.ckpt"
    _tiny_checkpoint(good)
    bad.write_bytes(_flip_bytes_inside(good, entry))
    with pytest.raises(Exception, match=rf"bad.ckpt is damaged: archive entry '{entry}'.*CRC-32"):
        DynMoStrategy().load_checkpoint(bad)


def test_checkpoints_load_with_weights_only_true(tmp_path, monkeypatch):
    path = tmp_path / "ok.ckpt"
    _tiny_checkpoint(path)
    seen = []
    real = torch.load

    def spy(*a, **k):
        seen.append(k.get("weights_only"))
        return real(*a, **k)

    monkeypatch.setattr(torch, "load", spy)
    ck = DynMoStrategy().load_checkpoint(path)
    assert seen == [True] and "state_dict" in ck


def test_a_pickled_object_is_refused(tmp_path):
    path = tmp_path / "code.ckpt"
    torch.save({"state_dict": {}, "evil": Path("/")}, path)  # not a tensor/primitive: needs full unpickling
    with pytest.raises(Exception, match="weights_only"):
        DynMoStrategy().load_checkpoint(path)


@pytest.mark.parametrize("where", ["state_dict", "optimizer"])
def test_non_finite_checkpoint_tensors_are_refused_by_name(tmp_path, where):
    path = tmp_path / "nan.ckpt"
    sd = make_model({"n_layer": 2}).state_dict()
    if where == "state_dict":
        sd["layers.1.mlp.fc.weight"][0, 0] = float("inf")
        _tiny_checkpoint(path, state_dict=sd)
        name = "state_dict['layers.1.mlp.fc.weight']"
    else:
        opt = {"state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.full((3,), float("nan"))}}, "param_groups": []}
        _tiny_checkpoint(path, optimizer_states=[opt])
        name = "optimizer_states[0]['state'][0]['exp_avg']"
    with pytest.raises(Exception, match="non-finite") as err:
        DynMoStrategy().load_checkpoint(path)
    assert name in str(err.value)


def test_nonfinite_option_is_validated():
    for ok in ("error", "skip", "ignore"):
        DynMoStrategy(on_nonfinite=ok)
    with pytest.raises(ValueError, match="on_nonfinite"):
        DynMoStrategy(on_nonfinite="maybe")


def test_nonfinite_loss_check_names_the_step():
    from lightning_dynmo.strategy.nonfinite import NonFiniteLossError, check_loss

    assert check_loss(torch.tensor(1.5), 7, "error") is True
    with pytest.raises(NonFiniteLossError, match=r"step 7.*on_nonfinite"):
        check_loss(torch.tensor(float("nan")), 7, "error")
    with pytest.warns(UserWarning, match="step 8"):
        assert check_loss(torch.tensor(float("inf")), 8, "skip") is False
    assert check_loss(torch.tensor(float("nan")), 9, "ignore") is True


# ---------------------------------------------------------------------------------- item 1
def test_tied_parameters_are_found_with_their_users():
    from lightning_dynmo.runtime.tied import find_tied_parameters

    model = make_model({"n_layer": 2, "tied": True})
    tied = find_tied_parameters(model.pipeline_layers(), "layers")
    assert len(tied) == 1
    (t,) = tied
    assert t.canonical == "layers.0.wte.weight"
    assert t.fqns == ("layers.0.wte.weight", "layers.4.lm_head.weight")
    assert t.layers == (0, 4)
    assert find_tied_parameters(make_model({"n_layer": 2}).pipeline_layers(), "layers") == []


def test_a_buffer_shared_by_two_layers_is_refused():
    from lightning_dynmo.runtime.tied import find_tied_parameters

    layers = nn.ModuleList([nn.BatchNorm1d(3), nn.BatchNorm1d(3)])
    layers[1].running_mean = layers[0].running_mean
    with pytest.raises(PipelineProtocolError, match="buffer.*running_mean"):
        find_tied_parameters(layers, "layers")


# ---------------------------------------------------------------------------------- item 9
def test_training_step_with_logic_the_pipeline_skips_is_named():
    from lightning_dynmo.strategy.setup_checks import skipped_training_step_warning

    class StepLogging(L.LightningModule):  # a user model as many are written: logging in training_step
        def training_step(self, batch, batch_idx):
            loss = self.pipeline_loss(self(batch[0]), batch[1])
            self.log("my_metric", loss)
            return loss

    msg = skipped_training_step_warning(StepLogging())
    assert msg and "StepLogging.training_step" in msg and "on_pipeline_train_loss" in msg and "self.log" in msg

    class WithHook(StepLogging):
        def on_pipeline_train_loss(self, loss, batch, batch_idx):
            pass

    assert skipped_training_step_warning(WithHook()) is None
    # GPT keeps its per-step logging in the hook, so it is silent too
    assert skipped_training_step_warning(make_model({"n_layer": 2})) is None

    class NoTrainingStep(L.LightningModule):
        pass

    assert skipped_training_step_warning(NoTrainingStep()) is None


def test_a_layer_normalising_by_batch_statistics_is_named():
    from lightning_dynmo.strategy.setup_checks import batch_statistics_warning

    layers = nn.ModuleList([nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), nn.LayerNorm(4)])
    msg = batch_statistics_warning(layers)
    assert msg and msg.startswith("layer 1 (1: BatchNorm1d)") and "micro-batch" in msg and "LayerNorm" in msg
    assert batch_statistics_warning(nn.ModuleList([nn.Linear(4, 4), nn.LayerNorm(4), nn.GroupNorm(2, 4)])) is None
    layers.eval()  # frozen statistics (a fine-tuned model in eval mode) mix no samples
    assert batch_statistics_warning(layers) is None


# ---------------------------------------------------------------------------------- item 7
def _recipe():
    spec = importlib.util.spec_from_file_location("train_gpt_recipe", ROOT / "recipes" / "train_gpt.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="train_gpt", overrides=overrides)


def test_recipe_refuses_unknown_model_keys():
    recipe = _recipe()
    cfg = _compose(["model=tiny", "+model.n_layer=8"])
    with pytest.raises(ValueError, match=r"unknown model key.*n_layer.*use \+model.overrides.n_layer=\.\.\."):
        recipe.check_config_keys(cfg)
    # the hint is what Hydra takes (model.overrides.n_layer=8, without +, is "not in struct")
    cfg = _compose(["model=tiny", "+model.overrides.n_layer=8"])
    recipe.check_config_keys(cfg)
    assert cfg.model.overrides.n_layer == 8
    with pytest.raises(ValueError, match=r"use model.overrides.head_chunks=\.\.\."):  # in the yaml: no +
        recipe.check_config_keys(_compose(["model=tiny", "+model.head_chunks=2"]))
    cfg = _compose(["model=tiny", "+model.overrides.n_layers=8"])
    with pytest.raises(ValueError, match=r"n_layers.*valid"):
        recipe.check_config_keys(cfg)



@pytest.mark.parametrize("override, says", [
    ("+foo=1", r"unknown key\(s\) \['foo'\]: nothing reads them; the top level takes checkpoint, ckpt_path"),
    ("+checkpoint.every_n_steps=2",
     r"\['checkpoint.every_n_steps'\].*checkpoint takes .*checkpoint.every_n_train_steps"),
])
def test_recipe_refuses_added_keys_nothing_reads(override, says):
    """Hydra accepts any `+key=...`; a typo there used to train on with the default (found by an
    independent check: +checkpoint.every_n_steps=2 kept checkpointing every 100 steps)."""
    with pytest.raises(ValueError, match=says):
        _recipe().check_config_keys(_compose(["model=tiny", override]))
    _recipe().check_config_keys(_compose(["model=tiny", "dynamism=freezing", "experiment=moe"]))


def test_recipe_refuses_more_stages_than_layers():
    recipe = _recipe()
    cfg = _compose(["model=tiny", "strategy.pipeline_parallel=8", "trainer.devices=8", "strategy.microbatches=8"])
    model = recipe.build_model(cfg)
    strategy = recipe.build_strategy(cfg)
    with pytest.raises(ValueError, match="cannot split 7 layers into 8 pipeline stages"):
        recipe.check_compatible(cfg, strategy, model)


def test_recipe_warns_when_validation_has_no_batches():
    recipe = _recipe()
    cfg = _compose(["model=tiny", "data.block_size=32", "data.val_fraction=0.0002", "data.batch_size=8"])
    model, data, strategy = recipe.build_model(cfg), recipe.build_data(cfg), recipe.build_strategy(cfg)
    with pytest.warns(UserWarning, match="validation has zero batches"):
        recipe.check_compatible(cfg, strategy, model, data)


def test_recipe_uses_one_run_dir_per_torchrun_job(monkeypatch):
    recipe = _recipe()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc123")
    assert recipe.run_stamp() == "torchrun-abc123"
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert recipe.run_stamp() != "torchrun-abc123"


def test_recipe_uses_one_run_dir_per_slurm_job_across_requeues(monkeypatch):
    """srun starts every task itself (a per-second stamp could differ between ranks) and a
    requeued job keeps its id: its run dir holds the checkpoint the requeue signal saved."""
    recipe = _recipe()
    for k in [k for k in os.environ if k.startswith("SLURM_") or k == "TORCHELASTIC_RUN_ID"]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert "slurm" not in recipe.run_stamp()  # an salloc shell, not an srun task
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_JOB_NAME", "train_gpt")
    assert recipe.run_stamp() == "slurm-4242"
    monkeypatch.setenv("SLURM_STEP_ID", "2")
    assert recipe.run_stamp() == "slurm-4242-step2"
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "4240")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert recipe.run_stamp() == "slurm-4240_3"
    monkeypatch.setenv("SLURM_JOB_NAME", "bash")  # an interactive srun shell: Lightning's SLURM detection says no
    assert "slurm" not in recipe.run_stamp()


# ---------------------------------------------------------------------------------- item 9b
def test_one_replica_keeps_the_loader_and_seeds_a_global_rng_shuffle(monkeypatch):
    from torch.utils.data import DataLoader, RandomSampler, SequentialSampler, TensorDataset

    from lightning_dynmo.strategy.launcher import seeded_loader_for_one_replica

    ds = TensorDataset(torch.arange(32))
    plain = DataLoader(ds, batch_size=4, shuffle=False)
    assert seeded_loader_for_one_replica(plain) is plain
    own = DataLoader(ds, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))
    assert seeded_loader_for_one_replica(own) is own  # its own generator: the same order on every rank
    monkeypatch.setenv("PL_GLOBAL_SEED", "7")
    orders = []
    for _ in range(2):  # two "ranks" whose global RNGs differ
        torch.manual_seed(len(orders))
        loader = seeded_loader_for_one_replica(DataLoader(ds, batch_size=4, shuffle=True))
        assert isinstance(loader.sampler, RandomSampler) and loader.sampler.generator is not None
        orders.append([b[0].tolist() for b in loader])
    assert orders[0] == orders[1] and orders[0] != [b[0].tolist() for b in plain]
    assert isinstance(plain.sampler, SequentialSampler)


def test_a_weight_pass_is_shared_by_forward_time_where_no_input_gradient_was_timed():
    """A stage whose layers timed no input-gradient backward must not hand its
    weight-gradient time to nobody (every layer looked free to the balancers)."""
    from lightning_dynmo.runtime.profiler import PipelineProfiler

    prof = PipelineProfiler(torch.device("cpu"))
    prof.register_stage(0, range(0, 2))
    prof.fwd.update({0: 1.0, 1: 3.0})
    prof.fwd_calls.update({0: 1, 1: 1})
    prof.wgt[0] = 8.0
    times = prof.layer_times()
    assert times[0] == (1.0, 2.0) and times[1] == (3.0, 6.0)


def test_every_balancer_result_is_checked_naming_the_balancer():
    """A wrong-size partition or a bare Partition fails where the balancer is called (not deep in
    placement with IndexError / AttributeError)."""
    from lightning_dynmo import (
        BalancerResultError, BalanceProblem, BalanceResult, CostModel, LayerCosts, register_balancer)
    from lightning_dynmo.plan.balancers import unregister_balancer

    problem = BalanceProblem(LayerCosts.from_params([1, 2, 3, 4]), 2, CostModel(4))
    outputs = {"t_bare": Partition((0, 2, 4)),
               "t_short": BalanceResult(Partition((0, 1, 3)), 1, 0.0, 0.0, "short"),
               "t_three": BalanceResult(Partition((0, 1, 2, 4)), 1, 0.0, 0.0, "three"),
               "t_ok": BalanceResult(Partition((0, 3, 4)), 1, 0.0, 0.0, "ok")}
    for name, out in outputs.items():
        register_balancer(name, override=True)(lambda p, out=out: out)
    try:
        for name, needle in [("t_bare", "returned Partition, not a BalanceResult"), ("t_short", "3 layers in 2 stages"),
                             ("t_three", "4 layers in 3 stages")]:
            with pytest.raises(BalancerResultError, match=f"balancer '{name}'.*{re.escape(needle)}"):
                get_balancer(name)(problem)
        assert get_balancer("t_ok")(problem) is outputs["t_ok"]
    finally:
        for name in outputs:
            unregister_balancer(name)


def test_infeasible_partition_error_formats_without_a_capacity():
    from lightning_dynmo import InfeasiblePartitionError

    err = InfeasiblePartitionError(None, None, 4, 2)
    assert str(err).startswith("no partition of 4 layers into 2 stages fits the memory capacity: raise memory_capacity")
    assert "1e+06 bytes per stage" in str(InfeasiblePartitionError(1e6, 2e6, 4, 2))


def test_the_batch_digest_sees_a_reordered_batch_and_stale_gradness_is_found():
    """The per-step checks of strategy/step_guard.py."""
    from lightning_dynmo.runtime.tensor_specs import TensorSpec
    from lightning_dynmo.strategy.step_guard import batch_digest, stale_gradness

    x = torch.arange(32).reshape(4, 8)
    assert batch_digest(x) == batch_digest(x.clone())
    assert batch_digest(x) != batch_digest(x[[1, 0, 2, 3]])  # same values, other order
    layers = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    for p in layers[0].parameters():
        p.requires_grad_(False)
    built_frozen = [(TensorSpec((1, 2), torch.float32, False),), (TensorSpec((1, 2), torch.float32, True),)]
    assert not stale_gradness(layers, [0, 1], built_frozen) and not stale_gradness(layers, [0], None)
    for p in layers[0].parameters():
        p.requires_grad_(True)  # unfrozen by hand: layer 0's output now needs a gradient
    assert stale_gradness(layers, [0], built_frozen) and not stale_gradness(layers, [1], built_frozen)
    # two tensors through a layer that takes one: the second passes through with its own grad-ness
    class TakesOne(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            return self.lin(x)

    two = nn.ModuleList([TakesOne()])
    built = [(TensorSpec((1, 2), torch.float32, True), TensorSpec((1,), torch.int64, False))]
    assert not stale_gradness(two, [0], built, first_arity=2)
    two[0].lin.weight.requires_grad_(False), two[0].lin.bias.requires_grad_(False)
    assert stale_gradness(two, [0], built, first_arity=2)
