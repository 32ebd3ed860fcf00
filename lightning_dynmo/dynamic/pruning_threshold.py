"""How many and which weights to prune: the Zhu & Gupta cubic schedule and the global
magnitude threshold over all pipeline stages (re-exported by :mod:`lightning_dynmo.dynamic.pruning`).

Threshold without gathering weights
-----------------------------------
For non-negative IEEE floats the order of the values equals the order of their bit patterns read
as integers. :func:`global_magnitude_threshold` therefore bisects over the *integer* bit pattern
of ``|w|`` with one all-reduced count per iteration (31 iterations for float32, 63 for float64),
using a local sort + ``searchsorted`` so each count is ``O(log n)``. The search ends at the
smallest value ``t`` with ``count(|w| <= t) >= k``, which is exactly the k-th smallest ``|w|`` over
all ranks -- bitwise equal to ``torch.kthvalue`` on the concatenation -- and no rank ever holds
another rank's weights. Data-parallel replicas hold identical weights, so each replica's pipeline
group computes the same threshold. Replicas that each hold a different shard (``dp_sharding="fsdp"``)
count over their data-parallel group too (``group`` is then a sequence of groups, summed in turn),
so every weight counts once, as in one process, and the threshold is the same.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["cubic_sparsity", "global_magnitude_threshold"]


def _dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def global_magnitude_threshold(
    tensors: list[Tensor], sparsity: float, group=None, distributed: bool | None = None, zeros: int = 0
) -> float:
    """The k-th smallest ``|w|`` over ``tensors`` on every rank of ``group`` (k = round(sparsity * N)).

    Pruning ``|w| <= threshold`` removes (at least, with ties exactly at the threshold) ``k`` weights.
    ``k == 0`` returns ``-inf`` (prune nothing). Works without ``torch.distributed`` (single process);
    ``distributed=None`` reduces over ``group`` whenever a process group is initialised, ``False``
    never reduces. Every rank of the group must call it (it is a collective); a rank may pass an
    empty list. ``zeros``: this rank's weights that are not in ``tensors`` because they are already
    pruned (entries a CSR-stored layer no longer holds); they count as ``|w| = 0``, so passing only
    the kept values of a layer gives the same threshold as passing its masked dense weight.
    ``group`` may be a sequence of groups: each reduction runs over each in turn (a shard's
    replicas, then the pipeline), so the counts are over the ranks they span together.
    """
    if not 0.0 <= float(sparsity) <= 1.0:
        raise ValueError(f"sparsity must be in [0, 1], got {sparsity}")
    reduce = _dist_ready() if distributed is None else bool(distributed)
    groups = list(group) if isinstance(group, (list, tuple)) else [group]

    def all_reduce(t: Tensor, op=dist.ReduceOp.SUM) -> None:
        for g in groups:
            dist.all_reduce(t, op=op, group=g)

    local = [t.detach().reshape(-1) for t in tensors if t.numel()]
    wide = any(t.dtype == torch.float64 for t in local)
    fdt, idt = (torch.float64, torch.int64) if wide else (torch.float32, torch.int32)
    device = local[0].device if local else torch.device("cpu")
    if reduce and dist.get_backend(groups[0]) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    if local:
        vals = torch.cat([t.to(device=device, dtype=fdt).abs() for t in local])
        vals = vals[~torch.isnan(vals)]
    else:
        vals = torch.empty(0, dtype=fdt, device=device)
    bits = vals.view(idt).to(torch.int64).sort().values  # order of |w| == order of its bit pattern

    zeros = int(zeros)
    if zeros < 0:
        raise ValueError(f"zeros must be >= 0, got {zeros}")
    stats = torch.tensor([bits.numel() + zeros, int(bits[-1]) if bits.numel() else 0], dtype=torch.int64,
                         device=device)
    if reduce:
        n_total = stats[:1].clone()
        all_reduce(n_total)
        hi = stats[1:].clone()
        all_reduce(hi, op=dist.ReduceOp.MAX)
        n, hi_bits = int(n_total), int(hi)
    else:
        n, hi_bits = int(stats[0]), int(stats[1])
    k = int(round(float(sparsity) * n))
    if k <= 0 or n == 0:
        return -math.inf
    k = min(k, n)

    # smallest bit pattern t in [0, hi] with count(bits <= t) >= k
    lo, hi = 0, hi_bits
    probe = torch.zeros(1, dtype=torch.int64, device=device)
    while lo < hi:
        mid = (lo + hi) // 2
        probe[0] = mid
        count = torch.searchsorted(bits, probe, right=True) + zeros  # mid >= 0: every pruned zero counts
        if reduce:
            all_reduce(count)
        if int(count) >= k:
            hi = mid
        else:
            lo = mid + 1
    return float(torch.tensor([lo], dtype=torch.int64).to(idt).view(fdt))


def cubic_sparsity(step: int, initial: float, final: float, start: int, n_steps: int, frequency: int) -> float:
    """Zhu & Gupta: ``s_t = s_f + (s_i - s_f) (1 - (t - t0) / (n dt))^3`` clamped to the window."""
    if step < start:
        return 0.0  # nothing is pruned before the schedule starts
    span = max(1, n_steps * frequency)
    frac = min(1.0, (step - start) / span)
    return float(final + (initial - final) * (1.0 - frac) ** 3)
