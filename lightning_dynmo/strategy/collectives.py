"""Lightning's strategy collectives (barrier, broadcast, reduce) over the default world group:
what ``DynMoStrategy`` shares with any torch.distributed strategy, apart from its pipeline logic."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class WorldCollectives:
    """Mixin for a Lightning ``ParallelStrategy`` with a ``root_device``."""

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if dist.is_available() and dist.is_initialized():
            if dist.get_backend() == "nccl":
                dist.barrier(device_ids=[self.root_device.index])
            else:
                dist.barrier()

    def broadcast(self, obj, src: int = 0):
        if not (dist.is_available() and dist.is_initialized()):
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor, group=None, reduce_op="mean"):
        from lightning.fabric.utilities.distributed import _sync_ddp_if_available

        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor
