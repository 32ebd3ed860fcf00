"""Lightning's strategy collectives (barrier, broadcast, reduce) over the default world group:
what ``DynMoStrategy`` shares with any torch.distributed strategy, apart from its pipeline logic;
and :func:`explain_timeout`, which makes a collective's timeout say which call every rank must make."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ParallelStrategy
from typing_extensions import override


class WorldCollectives(ParallelStrategy):
    """A Lightning ``ParallelStrategy`` base with these three collectives (``root_device`` is the subclass's)."""

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if dist.is_available() and dist.is_initialized():
            if dist.get_backend() == "nccl":
                dist.barrier(device_ids=[self.root_device.index])
            else:
                dist.barrier()

    @override
    def broadcast(self, obj, src: int = 0):
        if not (dist.is_available() and dist.is_initialized()):
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(self, tensor, group=None, reduce_op="mean"):
        from lightning.fabric.utilities.distributed import _sync_ddp_if_available

        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor


def _peer_missing(err: BaseException) -> bool:
    """A collective that timed out, or whose peer gave up first (it timed out elsewhere)."""
    text = str(err).lower()
    return any(s in text for s in ("timed out", "timeout", "connection closed", "connection reset"))


@contextmanager
def explain_timeout(hint: str):
    """A collective inside the block that timed out, or lost a peer that timed out first (a rank
    stopped, or skipped a call every rank must make), raises ``RuntimeError`` with torch's message
    followed by ``hint``."""
    try:
        yield
    except RuntimeError as err:
        if not _peer_missing(err):
            raise
        raise RuntimeError(f"{err}\n{hint}") from err
