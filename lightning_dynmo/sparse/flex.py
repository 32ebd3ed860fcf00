"""Block-sparse attention through ``torch.nn.attention.flex_attention``: the CUDA route.

On an H100 our CUDA kernel ran at 0.07-0.36x of FlexAttention (bf16), so on CUDA the attention
of a :class:`~lightning_dynmo.sparse.attention.BlockLayout` (slot permutation included) can run as
FlexAttention with a ``BlockMask`` that says the same thing; ``backend="auto"`` takes whichever of
the two it measures faster (:mod:`lightning_dynmo.sparse.backend_choice`). FlexAttention has no backward on
the CPU in torch 2.13 (``backend="flex"`` on the CPU is for forward checks; training takes the
kernels there).

**Exact by construction.** ``mask_mod`` is the token rule itself,

    visible(q, k) = layout[q // bs, k // bs]  and  k <= q  and  slot k holds a token

on the slot sequence, padded with empty slots to a whole number of tiles. The ``BlockMask``
only tells FlexAttention which tiles it may skip or compute without ``mask_mod``: tiles are
``lcm(bs, 128)`` slots (every GPU's default flex tile sizes divide 128, and a tile holds whole
layout blocks); a tile is skipped when no layout block in it is active or it lies above the
diagonal, and is "full" (``mask_mod`` skipped) only when every pair in it is visible: strictly
below the diagonal, every layout block in it active, every key slot a token. Query slots that
hold no token are computed and dropped.

**Built once per layout.** The ``BlockMask`` (about 80 small tensor ops: the tile masks, their
index lists and the transposed lists the backward needs) is kept on the layout
(:func:`cached_block_mask`, ``BlockLayout.derived``): a training step with an unchanged layout
builds nothing, and a changed layout (reassigned or in-place-written ``row_ptr``/``col_idx``)
gets a new one. Measured on the CPU (``benchmarks/flex_mask_build.py``: seq 4096, 16 heads,
128-blocks, one thread) a build is 76 top-level ops and 1.7-2.9 ms against 740 ms (density 1)
and 122 ms (density 1/8) for a compiled FlexAttention forward: 0.2-2.4 % of the call. On a GPU
the attention takes a fraction of a millisecond and each of those ops is a kernel launch
(``benchmarks/sparse_attention.py --device cuda`` reports ``mask_build_ms``). A permuted layout
(``slot_token``) keeps the mask of the last slot map it saw.

Under ``torch.compile`` the slot count is the one shape that changes with the data (hash
buckets pad differently every step); ``slots`` fixes it to an upper bound so that one compiled
kernel serves every step.
"""
from __future__ import annotations

import math
import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .layout import BlockLayout, gather_slots, scatter_slots, slot_sources

__all__ = ["FLEX_TILE", "flex_available", "flex_tile", "flex_block_mask", "cached_block_mask",
           "flex_block_sparse_attention"]

FLEX_TILE = 128  # FlexAttention's default BLOCK_SIZE; its GPU kernels' tiles divide it


def flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def flex_tile(block_size: int) -> int:
    """Slots per BlockMask tile for a layout block size: a multiple of both."""
    return math.lcm(int(block_size), FLEX_TILE)


def _as_kv(mask: Tensor) -> tuple[Tensor, Tensor]:
    """(count, indices) per query tile of a boolean ``[B, H, n, n]`` tile mask, active first."""
    num = mask.sum(-1, dtype=torch.int32)
    idx = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num, idx


def flex_block_mask(layout: BlockLayout, valid: Tensor):
    """The ``BlockMask`` of ``layout`` on ``S = valid.shape[-1]`` slots (a multiple of
    :func:`flex_tile`; ``valid[b, h, s]``: slot s holds a token). See the module docstring."""
    from torch.nn.attention.flex_attention import BlockMask

    bs, tile = layout.block_size, flex_tile(layout.block_size)
    b, h, slots = valid.shape
    if slots % tile or slots < layout.seq_len or (layout.batch, layout.heads) != (b, h):
        raise ValueError(f"valid must be [{layout.batch}, {layout.heads}, S] with S >= {layout.seq_len} a multiple "
                         f"of {tile}, got {tuple(valid.shape)}")
    m, n, r, nt = slots // bs, layout.n_blocks, tile // bs, slots // tile
    fine = F.pad(layout.to(valid.device).block_mask(), (0, m - n, 0, m - n)).contiguous()
    tiles = fine.view(b, h, nt, r, nt, r)
    below = torch.ones(nt, nt, dtype=torch.bool, device=valid.device).tril_(-1)
    on_or_below = torch.ones(nt, nt, dtype=torch.bool, device=valid.device).tril_()
    keys_valid = valid.view(b, h, nt, tile).all(-1)
    full = tiles.all(dim=5).all(dim=3) & below & keys_valid.unsqueeze(-2)
    partial = tiles.any(dim=5).any(dim=3) & on_or_below & ~full
    valid = valid.contiguous()

    def mask_mod(bi, hi, q, k):
        return fine[bi, hi, q // bs, k // bs] & (k <= q) & valid[bi, hi, k]

    return BlockMask.from_kv_blocks(*_as_kv(partial), *_as_kv(full), BLOCK_SIZE=tile, mask_mod=mask_mod,
                                    seq_lengths=(slots, slots))


_COMPILED = None


def _flex_fn(device: torch.device):
    """Compiled FlexAttention on CUDA (one fused kernel), eager elsewhere (dense math: checks)."""
    global _COMPILED
    from torch.nn.attention.flex_attention import flex_attention

    if device.type == "cuda":
        if _COMPILED is None:
            _COMPILED = torch.compile(flex_attention, dynamic=False)
        return _COMPILED

    def eager(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return flex_attention(*args, **kwargs)

    return eager


def flex_block_sparse_attention(q: Tensor, k: Tensor, v: Tensor, layout: BlockLayout, scale: Optional[float] = None,
                                slot_token: Optional[Tensor] = None, slots: Optional[int] = None) -> Tensor:
    """``block_sparse_attention`` (same arguments and result) computed by FlexAttention;
    ``slots``: pad the slot sequence to at least this many (static shapes under compile)."""
    if not flex_available():
        raise RuntimeError(f"backend='flex' needs torch.nn.attention.flex_attention (torch >= 2.5), "
                           f"this is torch {torch.__version__}; use backend='kernel'")
    if q.device.type == "cpu" and torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        raise NotImplementedError("backend='flex' cannot train on the CPU (torch's FlexAttention has no CPU "
                                  "backward); use backend='kernel' (or 'auto', which picks it on the CPU)")
    b, h, t, d = q.shape
    tile = flex_tile(layout.block_size)
    n_slots = -(-max(layout.seq_len, int(slots or 0)) // tile) * tile
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    flex = _flex_fn(q.device)
    if slot_token is None:  # token order: pad the tail only
        qkv = (F.pad(x, (0, 0, 0, n_slots - t)) if n_slots > t else x for x in (q, k, v))
        return flex(*qkv, block_mask=cached_block_mask(layout, q.device, n_slots, t), scale=scale)[:, :, :t]
    src, block_mask = _cached_slot_mask(layout, slot_token, q.device, n_slots, t)
    out = flex(*(gather_slots(x, src) for x in (q, k, v)), block_mask=block_mask, scale=scale)
    return scatter_slots(out, src, t)


def cached_block_mask(layout: BlockLayout, device: torch.device, n_slots: int, seq_len: int):
    """The ``BlockMask`` of ``layout`` for ``seq_len`` tokens in order on ``n_slots`` slots, built
    once per layout (:meth:`BlockLayout.derived`): an unchanged layout pays no mask build."""
    def build():
        valid = (torch.arange(n_slots, device=device) < seq_len).expand(layout.batch, layout.heads, n_slots)
        return flex_block_mask(layout, valid)

    return layout.derived(("flex_block_mask", torch.device(device), int(n_slots), int(seq_len)), build)


def _cached_slot_mask(layout: BlockLayout, slot_token: Tensor, device: torch.device, n_slots: int, t: int):
    """(slot sources, BlockMask) of a permuted layout; the last ``slot_token`` seen is kept (with
    its version) per (device, slots), so the cache stays one entry however many maps pass by."""
    key = ("flex_slot_mask", torch.device(device), int(n_slots), int(t))
    held = layout.derived(key, lambda: {})
    if not torch.compiler.is_compiling() and held.get("slot_token") is slot_token \
            and held.get("version") == slot_token._version:
        return held["src"], held["mask"]
    src = F.pad(slot_sources(slot_token.to(device), t), (0, n_slots - slot_token.shape[-1]), value=t)
    mask = flex_block_mask(layout, src < t)
    if not torch.compiler.is_compiling():
        held.update(slot_token=slot_token, version=slot_token._version, src=src, mask=mask)
    return src, mask
