"""The pipeline's grad scaler on a stage that holds FSDP shards (DTensors) beside plain expert
shards (``dp_sharding="fsdp"`` with ``expert_parallel > 1``): torch's unscale kernel refuses the
mix in one call, so the scaler unscales the gradients' local tensors, in place, and still finds an
inf in either kind. One process with a one-rank gloo group (the multi-rank agreement is tested in
tests/distributed/test_moe_expert_parallel.py; the group: tests/support/worlds.py)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from lightning_dynmo.runtime.precision import install_found_inf_agreement


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(4, 4)
        self.expert = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return self.dense(x) @ self.expert


@pytest.mark.parametrize("inf_in", [None, "dense", "expert"])
def test_unscale_of_mixed_dtensor_and_plain_gradients(world_of_one, inf_in):
    torch.manual_seed(0)
    layer = _Layer()
    fully_shard(layer, mesh=init_device_mesh("cpu", (1,)), ignored_params={layer.expert})
    assert isinstance(layer.dense.weight, DTensor) and not isinstance(layer.expert, DTensor)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=4.0))
    install_found_inf_agreement(plugin, lambda: dist.group.WORLD, lambda: True, lambda: torch.device("cpu"),
                                lambda: dist.group.WORLD)
    plugin.scaler.scale(layer(torch.randn(2, 4)).sum()).backward()
    scaled = {n: p.grad.to_local().clone() if isinstance(p.grad, DTensor) else p.grad.clone()
              for n, p in layer.named_parameters()}
    if inf_in == "dense":
        layer.dense.weight.grad.to_local()[0, 0] = float("inf")
    elif inf_in == "expert":
        layer.expert.grad[0, 0] = float("inf")
    plugin.scaler.unscale_(opt)
    found = plugin.scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
    assert [float(v) for v in found.values()] == [float(inf_in is not None)]
    if inf_in is None:  # unscaled in place, both kinds
        for n, p in layer.named_parameters():
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            torch.testing.assert_close(g, scaled[n] / 4.0, rtol=0, atol=0, msg=n)
