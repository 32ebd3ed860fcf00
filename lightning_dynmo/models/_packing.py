"""Token packing for blocks that compute on a subset of their tokens (early exit, mixture of depths).

Each row's kept tokens are gathered, in their original order, into ``[B, A, C]`` with ``A`` the
largest per-row count; the block runs on the packed tensor only and the results are scattered
back. Work therefore follows ``B * A`` rather than ``B * T``. Attention among packed tokens stays
causal (a packed token only attends to earlier kept tokens of its row), and padding slots are
masked out as keys.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .gpt.layers import CausalSelfAttention

__all__ = ["Packing", "pack", "unpack", "packed_attention"]


class Packing(NamedTuple):
    order: Tensor  # [B, A] token position of each packed slot
    index: Tensor  # [B, A, C] ``order`` expanded over channels (gather/scatter index)
    valid: Tensor  # [B, A] real tokens (False: padding of rows with fewer than A kept tokens)


def pack(x: Tensor, keep: Tensor, per_row: Tensor, width: int) -> tuple[Tensor, Packing]:
    """Gather the kept tokens of ``x [B,T,C]``: ``keep [B,T]`` bool, ``per_row = keep.sum(1)``,
    ``width = max(per_row)`` (the caller already has both on the host to size the work)."""
    b, _, c = x.shape
    # each row's kept positions first (original order kept), then the rest
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :width]
    valid = torch.arange(width, device=x.device)[None, :] < per_row[:, None]
    index = order[..., None].expand(b, width, c)
    return torch.gather(x, 1, index), Packing(order, index, valid)


def unpack(x: Tensor, xp: Tensor, yp: Tensor, packing: Packing) -> Tensor:
    """``x`` with the packed results ``yp`` written back; padding slots write their own input
    ``xp`` back, so they never change a token."""
    yp = torch.where(packing.valid[..., None], yp, xp)
    return x.scatter(1, packing.index, yp)


def packed_attention(attn: CausalSelfAttention, xn: Tensor, valid: Tensor, training: bool) -> Tensor:
    """``attn``'s residual update on packed (already normalised) tokens ``xn [B, A, C]``."""
    b, a, c = xn.shape
    idx = torch.arange(a, device=xn.device)
    causal = idx[None, :] <= idx[:, None]  # [A(query), A(key)]
    # valid queries only see valid keys (every key <= a valid query is valid); padding
    # queries also see themselves so that no row is fully masked (no NaN)
    mask = causal[None] & (valid[:, None, :] | torch.eye(a, dtype=torch.bool, device=xn.device)[None])
    q, k, v = attn.qkv(xn).split(c, dim=2)
    q, k, v = (z.view(b, a, attn.n_head, c // attn.n_head).transpose(1, 2) for z in (q, k, v))
    y = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask[:, None], dropout_p=attn.dropout if training else 0.0
    )
    y = y.transpose(1, 2).contiguous().view(b, a, c)
    return attn.resid_drop(attn.proj(y))
