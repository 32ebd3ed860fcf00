"""Checks on what each rank feeds the pipeline."""
from __future__ import annotations

import torch
import torch.distributed as dist


def check_same_batch(inputs: torch.Tensor, targets: torch.Tensor, group, rank: int, device: torch.device) -> None:
    """Every rank of a pipeline must see the same batch, or stage 0's inputs and the last
    stage's targets silently disagree (collective over the pipeline ``group``)."""
    digest = torch.tensor([float(inputs.double().sum()), float(targets.double().sum()), float(inputs.shape[0])],
                          dtype=torch.float64, device=device)
    lo, hi = digest.clone(), digest.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(lo, hi):
        raise RuntimeError(
            f"rank {rank}: the ranks of one pipeline received different batches. Every pipeline "
            "rank must load the same batch: use a sampler with a fixed seed (Lightning's DistributedSampler, "
            "which the Trainer injects by default, or `DataLoader(..., generator=torch.Generator().manual_seed(s))`)."
        )
