"""The values a seeded draw gives a tensor that may be one rank's rows of it: a ``Shard(0)``
DTensor (``dp_sharding="fsdp"`` with meta-device init, which allocates only the shards) or a
chunk of a vocabulary-split head. The rows are drawn without the whole tensor
(:func:`~lightning_dynmo.protocol.row_draws.normal_rows_`), so a rank's setup memory follows its
shards, and the values are the whole draw's, bit for bit.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard

from ..protocol.row_draws import normal_rows_


def shard_rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(the tensor this rank holds, its first row in the whole tensor)``: a DTensor's local rows
    (``Shard(0)`` on a 1-D mesh, cut as ``torch.chunk`` cuts: FSDP2's layout), else ``(t, 0)``."""
    if not isinstance(t, DTensor):
        return t, 0
    if t.device_mesh.ndim != 1 or tuple(t.placements) != (Shard(0),):
        raise ValueError(f"a DTensor laid out as {t.placements} on a {t.device_mesh.ndim}-D mesh is not a row shard; "
                         "only Shard(0) on one mesh dimension is initialised by rows")
    local, world, n = t.to_local(), t.device_mesh.size(), t.shape[0]
    per = -(-n // world)
    start = min(n, t.device_mesh.get_local_rank() * per)
    if local.shape[0] != max(0, min(per, n - start)):
        raise ValueError(f"this rank's shard has {local.shape[0]} of {n} rows, not the torch.chunk piece "
                         f"[{start}, {min(n, start + per)})")
    return local, start


@torch.no_grad()
def normal_from_(t: torch.Tensor, std: float, generator: torch.Generator, whole_shape: tuple[int, ...] | None = None,
                 first_row: int = 0) -> None:
    """Fill ``t`` with its rows of ``torch.empty(whole_shape).normal_(0, std, generator=generator)``
    (fp32, CPU; ``whole_shape`` defaults to ``t``'s global shape, and ``t``'s rows start at
    ``first_row``, plus its shard's first row), advancing ``generator`` as that whole draw does."""
    local, start = shard_rows(t)
    shape = tuple(whole_shape) if whole_shape is not None else tuple(t.shape)
    start += first_row
    if local.dtype == torch.float32 and local.device.type == "cpu" and local.is_contiguous():
        if start == 0 and tuple(local.shape) == shape:
            local.normal_(0.0, std, generator=generator)  # the whole draw itself
        else:
            normal_rows_(local, shape, start, std, generator)
    else:
        local.copy_(normal_rows_(torch.empty(local.shape, dtype=torch.float32), shape, start, std, generator))
