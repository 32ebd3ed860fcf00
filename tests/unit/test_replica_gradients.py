"""Data-parallel gradient averaging when a replica's batch leaves a parameter without a gradient
(found by ``benchmarks/at_scale.py``: early exit at pp=2 x dp=2 aborted gloo with 'Received data
size doesn't match expected size')."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lightning_dynmo.runtime.gradients import average_over_replicas


def _worker(rank: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        only_rank0, both, nowhere = (nn.Parameter(torch.zeros(3)) for _ in range(3))
        if rank == 0:
            only_rank0.grad = torch.full((3,), 4.0)
        both.grad = torch.full((3,), float(rank + 1))
        average_over_replicas([only_rank0, both, nowhere], dist.group.WORLD, 2)
        torch.save({"only": only_rank0.grad, "both": both.grad, "nowhere": nowhere.grad}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_gradient_missing_on_one_replica_counts_as_zero(tmp_path):
    init = f"file://{tmp_path / 'store'}"
    mp.spawn(_worker, args=(init, str(tmp_path / "grads")), nprocs=2, join=True)
    for rank in (0, 1):
        g = torch.load(tmp_path / f"grads.{rank}")
        assert torch.equal(g["only"], torch.full((3,), 2.0))  # (4 + 0) / 2 on both replicas
        assert torch.equal(g["both"], torch.full((3,), 1.5))
        assert g["nowhere"] is None  # no gradient anywhere: the optimizer still skips it
