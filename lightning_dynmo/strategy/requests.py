"""Agreeing what a profiled step was for, so a request made on some ranks only still acts on all.

A callback that calls ``request_rebalance`` or ``request_repack`` on one rank only (say under
``if trainer.is_global_zero``) makes that rank profile the next step; the step's all-reduce tells
every rank that a profile happened, and all of them decide after it. What they decide must be the
same: whether to rebalance (some rank had a reason other than a re-pack request) and whether and
where to re-pack (the requested target). One small all-reduce over the world, at decision steps only.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..plan.controller import PEER_REQUEST


def agree_on_actions(reason: str, repack: int | str | None, device: torch.device,
                     event: bool = False) -> tuple[bool, int | str | None, bool]:
    """``(rebalance, repack target or None, event)`` the same on every rank; ``event``: some rank
    saw a dynamism event since the last profile (its times say nothing about rank speeds).
    Collective over the world."""
    wants_rebalance = not (reason.startswith("repack") or reason == PEER_REQUEST)
    code = 0 if repack is None else 1 if repack == "auto" else int(repack) + 1  # 0: none, 1: auto, n + 1: n ranks
    flags = torch.tensor([1.0 if wants_rebalance else 0.0, float(code), 1.0 if event else 0.0], dtype=torch.float64,
                         device=device)
    if dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    code = int(flags[1])
    return bool(flags[0] > 0), None if code == 0 else "auto" if code == 1 else code - 1, bool(flags[2] > 0)
