"""``dp_sharding``: its values, the Hydra key, and what ``fsdp`` refuses at setup (the refusals
that need processes are in tests/distributed/test_bad_input.py)."""
from __future__ import annotations

import typing

import pytest

import torch
from torch import nn

from lightning_dynmo.runtime.fsdp import check_expert_shard_optimizers, check_fsdp_composition
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
    check_fsdp_composition(precision=precision)


@pytest.mark.parametrize("kw, reason", [
    ({"precision": "16-true"}, "precision='16-true' .supported under fsdp: 32-true"),
])
def test_fsdp_refuses_what_it_cannot_shard_naming_the_reason(kw, reason):
    args = {"precision": "32-true", **kw}
    with pytest.raises(ValueError, match=f"dp_sharding='fsdp' cannot be combined with {reason}"):
        check_fsdp_composition(**args)


def _adamw(**kw) -> torch.optim.AdamW:
    return torch.optim.AdamW([nn.Parameter(torch.zeros(2))], lr=1e-3, **kw)


@pytest.mark.parametrize("kw, device", [({}, "cpu"), (dict(foreach=False), "cpu"), (dict(foreach=False), "cuda"),
                                        (dict(foreach=False, fused=False), "cuda")])
def test_fsdp_with_expert_shards_steps_optimizers_one_tensor_at_a_time(kw, device):
    check_expert_shard_optimizers([_adamw(**kw)], torch.device(device))


@pytest.mark.parametrize("kw, device, fix", [({}, "cuda", "Pass foreach=False to AdamW"),
                                             (dict(foreach=True), "cpu", "Pass foreach=False to AdamW"),
                                             (dict(fused=True), "cpu", "Pass foreach=False and fused=False")])
def test_fsdp_with_expert_shards_refuses_foreach_and_fused_kernels(kw, device, fix):
    """They would fail at the first step: an FSDP shard (DTensor) and an expert shard (a plain
    tensor) in one kernel call (measured: "got mixed torch.Tensor and DTensor")."""
    with pytest.raises(ValueError, match=f"cannot step AdamW .optimizer 0, param group 0. .*{fix}"):
        check_expert_shard_optimizers([_adamw(**kw)], torch.device(device))
