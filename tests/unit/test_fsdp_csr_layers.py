"""CSR-stored pruned layers as FSDP units (``dp_sharding="fsdp"``), on 2 forked gloo ranks: the
values vector is sharded and the pattern whole, a layer pruned to nothing stays out of the unit,
the state dict is the dense format laid out as a dense-stored shard, and a gather makes the layer
whole again (pattern buffers that changed shape since it was sharded included)."""
from __future__ import annotations

import torch
from torch import nn

from lightning_dynmo.dynamic import PrunableLinear
from tests.support.worlds import forked_ranks


def _layers() -> nn.ModuleList:
    torch.manual_seed(0)
    layers = nn.ModuleList([nn.Sequential(PrunableLinear(8, 6)), nn.Sequential(PrunableLinear(6, 4))])
    first, second = layers[0][0], layers[1][0]
    with torch.no_grad():
        first.set_mask(first.weight.abs() > 0.15)  # about half kept
        second.set_mask(torch.zeros_like(second.weight_mask))  # pruned to nothing
    first.compress()
    second.compress()
    return layers


def _on_two_ranks(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from lightning_dynmo.dynamic.pruning import sparse_kernels_available
    from lightning_dynmo.runtime.fsdp import ShardedLayers, dp_mesh, whole

    layers = _layers()
    ref = _layers()
    module = nn.Module()
    module.layers = layers
    sharded = ShardedLayers(dp_mesh(dist.group.WORLD, torch.device("cpu")), layers, "layers", module, [], None)
    sharded.shard([0, 1])
    first, second = layers[0][0], layers[1][0]
    out = {"values_sharded": (first.values_sharded, isinstance(second.weight, DTensor)),
           "local_values": first.weight.to_local().numel(), "nnz": ref[0][0].nnz,
           "counts": (first.local_counts(), second.local_counts())}
    state = module.state_dict()  # collective: the values all-gathered into the dense rows
    out["state_rows"] = tuple(state["layers.0.0.weight"].to_local().shape)
    out["state_dense"] = bool(torch.equal(whole(state["layers.0.0.weight"]), ref[0][0].dense_weight()))
    out["state_mask"] = bool(torch.equal(whole(state["layers.0.0.weight_mask"]), ref[0][0].dense_mask()))
    out["empty_state"] = bool(torch.equal(state["layers.1.0.weight"], torch.zeros(4, 6)))
    stage = sharded.wrap_stage(nn.Sequential(layers[0], layers[1]))
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(rank))
    stage(x).sum().backward()
    ref_x = torch.cat([torch.randn(3, 8, generator=torch.Generator().manual_seed(r)) for r in range(world)])
    nn.Sequential(ref[0], ref[1])(ref_x).sum().backward()
    grad = first.weight.grad.full_tensor() * world  # FSDP averages over the replicas; the reference sums
    out["grad"] = bool(torch.allclose(grad, ref[0][0].weight.grad, rtol=1e-5, atol=1e-6))
    out["empty_grad"] = None if second.weight.grad is None else second.weight.grad.numel()
    if sparse_kernels_available():  # the CSR transpose is built after sharding: new buffer shapes
        first.set_sparse_kernel(True)
    sharded.gather([0, 1], torch.device("cpu"))
    whole_first = layers[0][0]
    out["gathered"] = (not isinstance(whole_first.weight, DTensor)
                       and bool(torch.equal(whole_first.weight.detach(), ref[0][0].weight.detach())))
    out["transpose"] = (whole_first.csr_col_t.numel(), whole_first.sparse_kernel)
    return out


def test_csr_values_shard_over_replicas_and_gather_whole(tmp_path):
    results = forked_ranks(_on_two_ranks, 2, tmp_path)
    assert all(kind == "ok" for kind, _ in results), results
    a, b = (value for _, value in results)
    for r in (a, b):
        assert r["values_sharded"] == (True, False), r  # the empty values stay out of the unit, plain
        # a CSR layer's counts are whole on every replica (the callers count them once)
        assert r["counts"] == ((r["nnz"], 48), (0, 24)), r
        assert r["state_rows"] == (3, 8) and r["state_dense"] and r["state_mask"] and r["empty_state"], r
        assert r["grad"], r
        assert r["empty_grad"] in (None, 0), r
        assert r["gathered"], r
        assert r["transpose"][0] == (r["nnz"] if r["transpose"][1] else 0), r
    assert a["local_values"] + b["local_values"] == a["nnz"] and abs(a["local_values"] - b["local_values"]) <= 1
