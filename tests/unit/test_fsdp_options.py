"""``dp_sharding``: its values, the Hydra key, and what ``fsdp`` refuses at setup (the refusals
that need processes are in tests/distributed/test_bad_input.py)."""
from __future__ import annotations

import typing

import pytest

from lightning_dynmo.runtime.fsdp import check_fsdp_composition
from lightning_dynmo.strategy.hydra_config import config_type
from lightning_dynmo.strategy.options import DpSharding, PipelineOptions


def test_dp_sharding_values():
    assert PipelineOptions().dp_sharding is DpSharding.REPLICATE
    assert PipelineOptions(dp_sharding="fsdp").dp_sharding is DpSharding.FSDP
    with pytest.raises(ValueError, match="dp_sharding must be one of replicate, fsdp, got 'zero3'"):
        PipelineOptions(dp_sharding="zero3")


def test_hydra_types_dp_sharding_as_a_string():
    assert config_type(typing.get_type_hints(PipelineOptions)["dp_sharding"]) is str


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed", "bf16-true"])
def test_fsdp_accepts_plain_models_in_the_tested_precisions(precision):
    check_fsdp_composition(tied=False, expert_parallel=1, precision=precision, pruning=False)


def test_fsdp_accepts_tied_parameters():
    """Sharded like the other parameters (runtime/fsdp_tied.py; trained in tests/distributed/test_fsdp.py)."""
    check_fsdp_composition(tied=True, expert_parallel=1, precision="32-true", pruning=False)


@pytest.mark.parametrize("kw, reason", [
    ({"expert_parallel": 2}, "expert_parallel=2 .experts are already split over the replicas"),
    ({"precision": "16-true"}, "precision='16-true' .supported under fsdp: 32-true"),
    ({"pruning": True}, "gradual pruning"),
])
def test_fsdp_refuses_what_it_cannot_shard_naming_the_reason(kw, reason):
    args = dict(tied=False, expert_parallel=1, precision="32-true", pruning=False)
    args.update(kw)
    with pytest.raises(ValueError, match=f"dp_sharding='fsdp' cannot be combined with {reason}"):
        check_fsdp_composition(**args)
