"""Shard-only meta-device init under ``dp_sharding="fsdp"``, on 2 forked gloo ranks: each GPT layer
built on the meta device becomes an FSDP unit first, then each rank allocates and fills only its
rows, and no plain tensor of a whole layer weight is created on the way; the values are the
single-process model's bit for bit, at block and at fine granularity with a chunked head."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_dynmo.models import GPT
from tests.support.worlds import forked_ranks

CHUNK = 64  # the row draws' streaming buffer, in elements (small, so it cannot hide a whole weight)
CONFIGS = {
    "block": dict(vocab_size=96, block_size=16, n_layer=2, n_head=2, n_embd=32),
    "fine_chunked_head": dict(vocab_size=96, block_size=16, n_layer=2, n_head=2, n_embd=32,
                              pipeline_granularity="fine", head_chunks=3),
}


class LargestPlainTensor(TorchDispatchMode):
    """The most elements of any plain tensor with storage that an op creates or writes."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if type(t) is torch.Tensor and not t.is_meta:  # (meta tensors hold no memory)
                self.largest = max(self.largest, t.numel())
        return out


def _on_two_ranks(name: str):
    def run(rank: int, world: int) -> dict:
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        import lightning_dynmo.protocol.row_draws as row_draws
        from lightning_dynmo.runtime.fsdp import ShardedLayers, dp_mesh

        row_draws._CHUNK = CHUNK
        ref = GPT(CONFIGS[name], seed=3)
        with torch.device("meta"):
            model = GPT(CONFIGS[name], seed=3)
        layers = model.pipeline_layers()
        sharded = ShardedLayers(dp_mesh(dist.group.WORLD, torch.device("cpu")), layers, "layers", model, [], None)
        out = {"in_shards": [], "largest": 0, "equal": [], "whole_largest": 0}
        for i in range(len(layers)):
            if not any(True for _ in layers[i].parameters()):
                continue  # (a fine piece without weights: nothing to allocate)
            mode = LargestPlainTensor()
            with mode:
                out["in_shards"].append(sharded.materialize_in_shards(model, i, torch.device("cpu")))
            out["largest"] = max(out["largest"], mode.largest)
            mine, theirs = dict(layers[i].named_parameters()), dict(ref.pipeline_layers()[i].named_parameters())
            out["whole_largest"] = max([out["whole_largest"]] + [p.numel() for p in theirs.values()])
            for n, p in mine.items():
                value = p.full_tensor() if isinstance(p, DTensor) else p
                out["equal"].append((i, n, bool(torch.equal(value.detach(), theirs[n].detach()))))
        return out
    return run


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_each_rank_allocates_and_fills_only_its_rows(tmp_path, name):
    results = forked_ranks(_on_two_ranks(name), 2, tmp_path)
    assert all(kind == "ok" for kind, _ in results), results
    for _, r in results:
        assert all(r["in_shards"]), r["in_shards"]
        assert all(ok for _, _, ok in r["equal"]), [e for e in r["equal"] if not e[2]]
        # nothing as large as a whole weight: the shards (half) and the streaming buffer only
        assert r["largest"] <= max(r["whole_largest"] // 2, CHUNK), (r["largest"], r["whole_largest"])


def _pruned_on_meta(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from lightning_dynmo.dynamic import PrunableLinear, make_prunable
    from lightning_dynmo.runtime.fsdp import ShardedLayers, dp_mesh

    ref = GPT(CONFIGS["block"], seed=3)
    with torch.device("meta"):
        model = GPT(CONFIGS["block"], seed=3)
    layers = model.pipeline_layers()
    for block in list(layers)[1:-2]:  # what GradualPruning.setup does to a model still on the meta device
        make_prunable(block)
    sharded = ShardedLayers(dp_mesh(dist.group.WORLD, torch.device("cpu")), layers, "layers", model, [], None)
    masks, equal = [], []
    for i in range(1, len(layers) - 2):
        assert sharded.materialize_in_shards(model, i, torch.device("cpu"))
        for m in layers[i].modules():
            if isinstance(m, PrunableLinear):
                masks.append((isinstance(m.weight_mask, DTensor), bool(m.weight_mask.to_local().all()),
                               m.weight_mask.to_local().shape[0] * world == m.out_features))
        theirs = dict(ref.pipeline_layers()[i].named_parameters())
        equal += [bool(torch.equal(p.full_tensor().detach(), theirs[n].detach()))
                  for n, p in layers[i].named_parameters()]
    return {"masks": masks, "equal": equal}


def test_a_layer_made_prunable_on_the_meta_device_materialises_in_shards(tmp_path):
    """``GradualPruning`` makes Linears prunable at setup, before the strategy materialises the
    model: each mask is allocated as its weight's shard and starts all-kept."""
    results = forked_ranks(_pruned_on_meta, 2, tmp_path)
    assert all(kind == "ok" for kind, _ in results), results
    for _, r in results:
        assert len(r["masks"]) == 2 * 4 and all(all(m) for m in r["masks"]), r["masks"]
        assert r["equal"] and all(r["equal"])


def test_a_layer_made_prunable_on_the_meta_device_materialises_whole():
    from lightning_dynmo.dynamic import PrunableLinear, make_prunable
    from lightning_dynmo.protocol import materialize_layer

    ref = GPT(CONFIGS["block"], seed=3)
    with torch.device("meta"):
        model = GPT(CONFIGS["block"], seed=3)
    block = model.pipeline_layers()[1]
    make_prunable(block)
    materialize_layer(model, 1, block)
    masks = [m.weight_mask for m in block.modules() if isinstance(m, PrunableLinear)]
    assert len(masks) == 4 and all(bool(m.all()) for m in masks)
    for (n, p), q in zip(block.named_parameters(), ref.pipeline_layers()[1].parameters()):
        assert torch.equal(p, q), n
