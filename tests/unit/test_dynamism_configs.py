"""The recipe's ``dynamism`` and ``experiment`` config groups compose, name importable model
classes and build their callbacks (no training; the distributed smoke runs are in
tests/distributed/test_recipe_dynamism.py)."""
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import lightning_dynmo  # noqa: F401  (registers the structured config dynmo_options)
from lightning_dynmo.cli.dynamism import build_callbacks, model_class

CONF = str(Path(__file__).resolve().parents[2] / "conf")
CASES = {
    "none": ("GPT", []),
    "freezing": ("GPT", ["LayerFreezing"]),
    "early_exit": ("EarlyExitGPT", ["EarlyExit"]),
    "pruning": ("GPT", ["GradualPruning"]),
    "moe": ("MoEGPT", ["MoELoadMonitor"]),
    "mod": ("MoDGPT", ["MixtureOfDepths"]),
    "mod_moe": ("MoDGPT", ["MixtureOfDepths", "MoELoadMonitor"]),
    "sparse_attention": ("GPT", ["SparseAttentionMonitor"]),
}


def _cfg(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="train_gpt", overrides=list(overrides))


@pytest.mark.parametrize("case", sorted(CASES))
def test_dynamism_group(case):
    from lightning_dynmo.models import GPTConfig

    cfg = _cfg(f"dynamism={case}")
    cls, extra = model_class(cfg)
    assert cls.__name__ == CASES[case][0]
    assert [type(c).__name__ for c in build_callbacks(cfg)] == CASES[case][1]
    model = cls(config=GPTConfig.preset("tiny").to_dict(), seed=0, **extra)  # the recipe's call
    assert len(model.pipeline_layers()) == 4 + 3


@pytest.mark.parametrize("case", sorted(CASES))
def test_experiment_configs_scale_the_paper(case):
    cfg = _cfg(f"experiment={case}")
    assert cfg.dynamism.name == case
    # paper appendix A scaled: head dim 32, micro-batch 2, micro-batches = 4 x stages
    m, s, d = cfg.model.overrides, cfg.strategy, cfg.data
    assert m.n_embd // m.n_head == 32 and d.batch_size // s.microbatches == 2
    assert s.microbatches == 4 * s.pipeline_parallel and s.balancer == "partition_time"
    assert cfg.trainer.max_steps == 300


def test_overrides_reach_the_callbacks_and_bad_input_is_named():
    cfg = _cfg("dynamism=pruning", "dynamism.callbacks.pruning.final_sparsity=0.5")
    assert build_callbacks(cfg)[0].final_sparsity == 0.5
    assert build_callbacks(_cfg("dynamism=moe", "dynamism.callbacks.load_monitor=null")) == []
    with pytest.raises(ValueError, match="cannot import"):
        model_class(_cfg("dynamism=moe", "dynamism.model_class=lightning_dynmo.models.NoSuchGPT"))
    with pytest.raises(ValueError, match="unknown dynamism key"):
        model_class(_cfg("dynamism=moe", "+dynamism.bogus=1"))


@pytest.mark.parametrize("group", ["dynamism", "experiment"])
def test_sparse_attention_config_builds_a_hash_sparse_gpt(group):
    from lightning_dynmo.models import SparseAttentionBlock
    from recipes.train_gpt import build_model

    cfg = _cfg(f"{group}=sparse_attention", "model=tiny")
    model = build_model(cfg)
    blocks = model.pipeline_layers()[1:-2]
    assert blocks and all(isinstance(b, SparseAttentionBlock) for b in blocks)
    assert model.config.hash_redraw and model.config.block_size == cfg.data.block_size
