"""``DynMoStrategy`` under Lightning's own command line (``LightningCLI``, jsonargparse): its options,
read from the signature made of ``PipelineOptions``, are flags, with the strategy's own checks and help."""
from __future__ import annotations

import inspect
import re
import sys
from dataclasses import fields
from datetime import timedelta
from enum import Enum

import pytest
from lightning.pytorch.cli import LightningCLI

from lightning_dynmo import DynMoStrategy
from lightning_dynmo.data import ByteTextDataModule
from lightning_dynmo.models import GPT
from lightning_dynmo.plan.partition import Partition
from lightning_dynmo.plan.policy import Rebalance
from lightning_dynmo.strategy.options import DpSharding, PipelineOptions

CLASS = "--trainer.strategy=lightning_dynmo.DynMoStrategy"
SMALL = ["--model.config=tiny", "--data.block_size=32", "--trainer.accelerator=cpu", "--trainer.devices=2",
         "--trainer.logger=false", "--trainer.enable_checkpointing=false"]


def cli(monkeypatch, *args: str) -> LightningCLI:
    monkeypatch.setattr(sys, "argv", ["cli_gpt.py"])  # the args below are the whole command line
    return LightningCLI(GPT, ByteTextDataModule, run=False, save_config_callback=None, args=[*SMALL, *args])


def cli_exit(monkeypatch, capsys, *args: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_:
        cli(monkeypatch, *args)
    out = capsys.readouterr()
    return exit_.value.code, out.out + out.err


def test_signature_lists_every_option_with_its_default():
    sig = inspect.signature(DynMoStrategy)
    keyword_only = [p for p in sig.parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert [p.name for p in keyword_only] == [f.name for f in fields(PipelineOptions)]
    for p, f in zip(keyword_only, fields(PipelineOptions)):
        assert p.default == (f.default.value if isinstance(f.default, Enum) else f.default), f.name
    assert list(sig.parameters)[:5] == ["accelerator", "parallel_devices", "cluster_environment", "checkpoint_io",
                                        "precision_plugin"]
    # the signature's defaults are the options' defaults
    explicit = DynMoStrategy(**{p.name: p.default for p in keyword_only}).options
    assert explicit == DynMoStrategy().options
    assert "pipeline_parallel: Ranks per pipeline" in DynMoStrategy.__init__.__doc__


def test_unknown_option_still_names_the_closest():
    with pytest.raises(TypeError, match="unknown option 'pipline_parallel'; did you mean 'pipeline_parallel'"):
        DynMoStrategy(pipline_parallel=2)


def test_cli_sets_the_strategy_options(monkeypatch):
    c = cli(monkeypatch, CLASS, "--trainer.strategy.pipeline_parallel=2", "--trainer.strategy.schedule=gpipe",
            "--trainer.strategy.rebalance=never", "--trainer.strategy.timeout=30",
            "--trainer.strategy.partition=[0,3,7]", "--trainer.strategy.link_bandwidth=[3.6e11,4.5e10]",
            "--trainer.strategy.dp_sharding=fsdp", "--trainer.strategy.plot=false")
    s = c.trainer.strategy
    assert type(s) is DynMoStrategy
    o = s.options
    assert o.pipeline_parallel == 2 and o.schedule.name == "gpipe" and o.rebalance is Rebalance.NEVER
    assert o.timeout == timedelta(seconds=30) and o.partition == Partition((0, 3, 7))
    assert o.link_bandwidth == (3.6e11, 4.5e10) and o.dp_sharding is DpSharding.FSDP and o.plot is False
    assert s.pipeline.rebalancer.policy.rebalance is Rebalance.NEVER  # built from the same options
    # the rest at PipelineOptions' defaults
    assert o.microbatches is None and o.balancer == "partition_time" and o.expert_parallel == 1


def test_cli_strategy_by_registered_name(monkeypatch):
    s = cli(monkeypatch, "--trainer.strategy=dynmo").trainer.strategy
    assert type(s) is DynMoStrategy and s.options == PipelineOptions()


@pytest.mark.parametrize("flag, message", [
    ("--trainer.strategy.pipeline_parallel=0", "pipeline_parallel must be a positive integer or one of ['auto']"),
    ("--trainer.strategy.schedule=nosuch", "unknown schedule 'nosuch'; valid schedules: 1f1b, dualpipev, gpipe"),
    ("--trainer.strategy.repack_tolerance=1.5", "repack_tolerance must be in [0, 1), got 1.5"),
])
def test_cli_bad_value_gives_the_strategy_error(monkeypatch, flag, message):
    """The value has the option's type, so jsonargparse builds the strategy, whose own check refuses it."""
    with pytest.raises(ValueError, match=re.escape(message)):
        cli(monkeypatch, CLASS, flag)


def test_cli_mode_outside_its_values_is_refused(monkeypatch, capsys):
    code, out = cli_exit(monkeypatch, capsys, CLASS, "--trainer.strategy.rebalance=sometimes")
    assert code != 0 and "'auto', 'on_event', 'every_n', 'never'" in out, out[-3000:]


def test_cli_help_lists_the_options(monkeypatch, capsys):
    code, out = cli_exit(monkeypatch, capsys, "--trainer.strategy.help", "lightning_dynmo.DynMoStrategy")
    assert code == 0
    for f in fields(PipelineOptions):
        assert f"--trainer.strategy.{f.name} " in out, f.name
    assert "Ranks per pipeline" in out and "When to rebalance" in out  # the field docstrings


def test_cli_config_file_round_trip(monkeypatch, capsys, tmp_path):
    """``--print_config`` writes every option at its value; the file read back builds the same strategy."""
    flags = [CLASS, "--trainer.strategy.pipeline_parallel=2", "--trainer.strategy.on_nonfinite=skip"]
    code, out = cli_exit(monkeypatch, capsys, *flags, "--print_config")
    assert code == 0 and "pipeline_parallel: 2" in out and "on_nonfinite: skip" in out and "rebalance: auto" in out
    config = tmp_path / "run.yaml"
    config.write_text(out)
    monkeypatch.setattr(sys, "argv", ["cli_gpt.py"])
    from_file = LightningCLI(GPT, ByteTextDataModule, run=False, save_config_callback=None,
                             args=["--config", str(config)])
    assert from_file.trainer.strategy.options == cli(monkeypatch, *flags).trainer.strategy.options
