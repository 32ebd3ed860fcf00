"""One source per option: the dataclass, the strategy's signature, the Hydra config and
docs/options.md must agree; each test fails on a drift and says how to fix it."""
from __future__ import annotations

import dataclasses
import inspect
from enum import Enum
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf

import lightning_dynmo  # noqa: F401  (registers the structured config dynmo_options)
from lightning_dynmo import DynMoStrategy
from lightning_dynmo.strategy.options import PipelineOptions
from lightning_dynmo.strategy.options_doc import field_docs, markdown

ROOT = Path(__file__).resolve().parents[2]
FIELDS = [f.name for f in dataclasses.fields(PipelineOptions)]
#: the recipe's departures from the defaults: the whole of conf/strategy/dynmo.yaml besides its defaults list
RECIPE_OVERRIDES = {"pipeline_parallel": 2, "microbatches": 4}


def _recipe_strategy(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="train_gpt", overrides=list(overrides)).strategy


def test_docs_options_md_is_generated_from_the_dataclass():
    page = (ROOT / "docs" / "options.md").read_text()
    assert page == markdown(), \
        "docs/options.md is stale: python -m lightning_dynmo.strategy.options_doc > docs/options.md"


def test_every_option_has_a_docstring_and_a_default():
    docs = field_docs()
    assert sorted(docs) == sorted(FIELDS), f"fields without a docstring: {sorted(set(FIELDS) - set(docs))}"
    assert all(f.default is not dataclasses.MISSING for f in dataclasses.fields(PipelineOptions))


def test_the_strategy_signature_repeats_no_option():
    """Defaults are written once: DynMoStrategy takes the options through **options only (its visible
    signature lists them, made from the dataclass: tests/unit/test_cli.py)."""
    code = DynMoStrategy.__init__.__code__
    written = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    assert not set(written) & set(FIELDS), "DynMoStrategy.__init__ names an option: take it through **options"
    assert code.co_flags & inspect.CO_VARKEYWORDS
    visible = inspect.signature(DynMoStrategy.__init__).parameters
    assert [n for n, p in visible.items() if p.kind is p.KEYWORD_ONLY] == FIELDS
    assert DynMoStrategy().options == PipelineOptions()
    with pytest.raises(TypeError, match="unknown option 'rebalance_threshold'; did you mean 'imbalance_threshold'"):
        DynMoStrategy(rebalance_threshold=0.2)


def test_hydra_config_has_every_option_at_its_default():
    cfg = OmegaConf.to_container(_recipe_strategy())
    assert cfg.pop("_target_") == "lightning_dynmo.DynMoStrategy"
    assert list(cfg) == FIELDS, "the structured config dynmo_options is not the dataclass's field list"
    for f in dataclasses.fields(PipelineOptions):
        default = f.default.value if isinstance(f.default, Enum) else f.default
        assert cfg[f.name] == RECIPE_OVERRIDES.get(f.name, default), f.name
    yaml = OmegaConf.load(ROOT / "conf" / "strategy" / "dynmo.yaml")
    assert {k: v for k, v in yaml.items() if k != "defaults"} == RECIPE_OVERRIDES, \
        "conf/strategy/dynmo.yaml holds only the recipe's overrides (defaults live in PipelineOptions)"


def test_hydra_config_builds_the_same_options():
    strategy = instantiate(_recipe_strategy("strategy.rebalance=never", "strategy.link_bandwidth=[3.6e11,4.5e10]",
                                            "strategy.timeout=30"), _convert_="all")
    assert strategy.options == PipelineOptions(rebalance="never", link_bandwidth=(3.6e11, 4.5e10), timeout=30,
                                               **RECIPE_OVERRIDES)
    with pytest.raises(Exception, match="rebalance must be one of auto, on_event, every_n, never, got 'sometimes'"):
        instantiate(_recipe_strategy("strategy.rebalance=sometimes"), _convert_="all")
