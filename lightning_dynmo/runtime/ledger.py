"""Agreement on the next collective call before it is made.

Before each DynMo collective whose participation depends on state, the ranks agree on the call's
name and a counter in one small all-reduce. A rank that makes a call the others do not (a
``broadcast`` on one rank only, a decision only some ranks reach) meets its peers in that
all-reduce, so every rank raises :class:`~lightning_dynmo.runtime.fault.CollectiveMismatchError`
within one round trip, naming every rank's call and the fix. A rank whose job already failed
refuses the call (``fault.check_not_failed``).
"""
from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from .fault import CollectiveMismatchError, check_not_failed

__all__ = ["CollectiveLedger"]


class CollectiveLedger:
    """Agreement on the next collective call (name and counter) before it is made."""

    MAX_FLAGS = 2  # values that ride along with an agreement (see agree)

    def __init__(self, rank: int, device: torch.device) -> None:
        self.rank = rank
        self.device = device
        self.count = 0

    def agree(self, name: str, group=None, flag: float | tuple[float, ...] = 0.0) -> float | tuple[float, ...]:
        """Collective over ``group`` (default: the world): every rank names the call it is about to
        make; if the names or counters differ, every rank raises :class:`CollectiveMismatchError`.
        Returns the largest ``flag`` over the ranks (values ride along for free): a float, or a
        tuple of the element-wise largest for a tuple of flags."""
        check_not_failed(name)
        flags = tuple(float(f) for f in flag) if isinstance(flag, tuple) else (float(flag),)
        if len(flags) > self.MAX_FLAGS:  # (on one rank too: the same call fails on every world size)
            raise ValueError(f"the ledger carries at most {self.MAX_FLAGS} flags, got {len(flags)}")
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return flags if isinstance(flag, tuple) else flags[0]
        self.count += 1
        call = f"{name}#{self.count}"
        h = float(zlib.crc32(call.encode()))
        # one size for every call: a rank agreeing on another call with fewer flags must meet this
        # all-reduce (and see the mismatch), not hang in one of another size
        padded = flags + (0.0,) * (self.MAX_FLAGS - len(flags))
        v = torch.tensor([h, -h, *(-f for f in padded)], dtype=torch.float64, device=self.device)
        dist.all_reduce(v, op=dist.ReduceOp.MIN, group=group)
        if v[0].item() == -v[1].item():
            largest = tuple(-x for x in v[2:2 + len(flags)].tolist())
            return largest if isinstance(flag, tuple) else largest[0]
        calls: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(calls, (self.rank, call), group=group)
        listing = "; ".join(f"rank {r}: {c}" for r, c in calls)
        raise CollectiveMismatchError(
            f"the ranks are about to make different collective calls ({listing}). Every rank must make the "
            "same DynMo/Lightning collective calls in the same order: call trainer.save_checkpoint, "
            "strategy.broadcast/barrier, trainer.log_dir and strategy.pipeline.rebalance_to / repack_to / "
            "gather_layer_costs on every rank (not under `if trainer.is_global_zero:`), and keep rank-local "
            "state (a timer, a file, the torch version) out of decisions about which calls to make")
