"""Which torch can shard stages: ``dp_sharding="fsdp"`` needs FSDP2's unused-parameter guard, which
torch 2.10 and 2.11 lack (``set_reduce_scatter_unused_params``). Marked ``compat`` so CI checks it
on those torches too (scripts/test_lowest_torch.sh): there setup must refuse with the reason and the
fix instead of failing inside FSDP at the first layer (``AttributeError`` on every rank, as it did);
where the guard exists, the check passes and the fsdp tests train."""
from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from lightning_dynmo.runtime.fsdp import check_fsdp_composition, missing_fsdp_capability

pytestmark = pytest.mark.compat


def test_fsdp_is_refused_with_the_fix_exactly_where_torch_lacks_the_guard():
    has_guard = hasattr(FSDPModule, "set_reduce_scatter_unused_params")
    assert (missing_fsdp_capability() is None) == has_guard
    plain = dict(precision="32-true")
    if has_guard:
        check_fsdp_composition(**plain)
        return
    with pytest.raises(ValueError) as err:
        check_fsdp_composition(**plain)
    message = str(err.value)
    assert f"torch {torch.__version__}" in message and "set_reduce_scatter_unused_params" in message, message
    assert "dp_sharding='replicate'" in message and "torch >= 2.13" in message, message
