"""CUDA-event timing shared by the GPU benchmarks: methods are timed round-robin (one call of
each per round, so clock and thermal drift hit all alike) and the median per method is kept."""
from __future__ import annotations

import statistics

import torch


def cuda_round_robin(fns: dict, rounds: int, warmup: int = 2) -> dict:
    """``{name: median milliseconds}`` of ``fns`` (callables launching CUDA work)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times[k].append(start.elapsed_time(end))
    return {k: statistics.median(v) for k, v in times.items()}
