"""The block layout of a block-sparse attention call and the slot permutation around it.

:class:`BlockLayout` is the CSR format of ``attention.py``'s module docstring; ``slot_sources``,
``gather_slots`` and ``scatter_slots`` move rows between token order and slot order (a permuted,
padded sequence, ``slot_token``). Both attention back ends use them -- our kernels' reference
path (``attention.py``) and FlexAttention (``flex.py``) -- so they live apart from either.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Hashable, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["BlockLayout", "gather_slots", "scatter_slots", "slot_sources"]


class BlockLayout:
    """Causal block layout of one attention call (see the module docstring for the format).

    Build one with :meth:`from_block_mask` (any boolean ``[B, H, n, n]`` block mask; blocks above
    the diagonal are dropped) or directly from ``row_ptr``/``col_idx``. The transposed layout the
    backward needs is computed on first use with tensor ops on the layout's device and cached.

    What is derived from the layout (its transpose, its copy on another device, FlexAttention's
    ``BlockMask``) is built once and kept on the layout (:meth:`derived`), so a training step
    whose layout did not change pays nothing for it. The cache is dropped when the layout
    changes: another tensor assigned to ``row_ptr``/``col_idx``/``block_size``/``seq_len``, or
    an in-place write to ``row_ptr``/``col_idx`` (their version counters move).
    """

    __slots__ = ("row_ptr", "col_idx", "block_size", "seq_len", "_stamp", "_derived")

    def __init__(self, row_ptr: Tensor, col_idx: Tensor, block_size: int, seq_len: int) -> None:
        block_size, seq_len = int(block_size), int(seq_len)
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if seq_len < 0:
            raise ValueError(f"seq_len must be non-negative, got {seq_len}")
        n = -(-seq_len // block_size)
        if row_ptr.dtype != torch.int32 or col_idx.dtype != torch.int32:
            raise TypeError(f"row_ptr and col_idx must be int32, got {row_ptr.dtype} and {col_idx.dtype}")
        if row_ptr.dim() != 3 or row_ptr.shape[-1] != n + 1:
            raise ValueError(f"row_ptr must have shape [B, H, ceil(T / block_size) + 1] = [B, H, {n + 1}] "
                             f"for T={seq_len}, block_size={block_size}; got {tuple(row_ptr.shape)}")
        if col_idx.dim() != 1:
            raise ValueError(f"col_idx must be 1-D, got shape {tuple(col_idx.shape)}")
        if row_ptr.device != col_idx.device:
            raise ValueError("row_ptr and col_idx must be on the same device")
        self.row_ptr = row_ptr.contiguous()
        self.col_idx = col_idx.contiguous()
        self.block_size = block_size
        self.seq_len = seq_len
        self._stamp: Optional[tuple] = None
        self._derived: Dict[Hashable, Any] = {}

    # ------------------------------------------------------------------ derived data
    def _current_stamp(self) -> tuple:
        # the tensors themselves (held, so their ids cannot be reused) and their version counters
        return (self.row_ptr, self.col_idx, self.row_ptr._version, self.col_idx._version,
                self.block_size, self.seq_len)

    def _unchanged(self, stamp: tuple) -> bool:
        old = self._stamp
        return old is not None and old[0] is stamp[0] and old[1] is stamp[1] and old[2:] == stamp[2:]

    def derived(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """``build()``, computed once per ``key`` while the layout stays as it is (a change drops
        every cached value). Under ``torch.compile`` tracing it is built each time (no state)."""
        if torch.compiler.is_compiling():
            return build()
        stamp = self._current_stamp()
        if not self._unchanged(stamp):
            self._stamp, self._derived = stamp, {}
        if key not in self._derived:
            self._derived[key] = build()
        return self._derived[key]

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_block_mask(cls, mask: Tensor, block_size: int, seq_len: Optional[int] = None) -> "BlockLayout":
        """Layout of the causal part of a boolean block mask ``[B, H, n, n]`` (query block, key
        block). ``seq_len`` defaults to ``n * block_size``; a shorter one makes the last block ragged."""
        if mask.dim() != 4 or mask.shape[-1] != mask.shape[-2]:
            raise ValueError(f"block mask must be [B, H, n, n], got {tuple(mask.shape)}")
        b, h, n, _ = mask.shape
        seq_len = n * int(block_size) if seq_len is None else int(seq_len)
        if -(-seq_len // int(block_size)) != n:
            raise ValueError(f"a [.., {n}, {n}] block mask does not fit seq_len={seq_len} with "
                             f"block_size={block_size} (needs {-(-seq_len // int(block_size))} blocks)")
        causal = torch.ones(n, n, dtype=torch.bool, device=mask.device).tril_()
        m = mask.bool() & causal
        counts = m.sum(-1, dtype=torch.int64).reshape(-1)
        flat = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=mask.device)
        torch.cumsum(counts, 0, out=flat[1:])
        heads = torch.arange(b * h, device=mask.device).unsqueeze(1) * n
        row_ptr = flat[heads + torch.arange(n + 1, device=mask.device)].reshape(b, h, n + 1)
        col_idx = m.nonzero()[:, 3]  # row-major: sorted by (b, h, query block, key block)
        return cls(row_ptr.to(torch.int32), col_idx.to(torch.int32), block_size, seq_len)

    # ------------------------------------------------------------------ views
    @property
    def n_blocks(self) -> int:
        return self.row_ptr.shape[-1] - 1

    @property
    def batch(self) -> int:
        return self.row_ptr.shape[0]

    @property
    def heads(self) -> int:
        return self.row_ptr.shape[1]

    @property
    def device(self) -> torch.device:
        return self.row_ptr.device

    def active_blocks(self) -> int:
        """Block pairs computed, over all batches and heads."""
        return self.col_idx.numel()

    def causal_blocks(self) -> int:
        """Block pairs of dense causal attention (the denominator of :meth:`density`)."""
        n = self.n_blocks
        return self.batch * self.heads * n * (n + 1) // 2

    def density(self) -> float:
        """Active / causal block pairs: the fraction of dense causal attention's work done."""
        return self.active_blocks() / max(1, self.causal_blocks())

    def _rows(self) -> Tuple[Tensor, Tensor]:
        """(head index b * H + h, query block) of every entry of ``col_idx``."""
        n = self.n_blocks
        counts = (self.row_ptr[..., 1:] - self.row_ptr[..., :-1]).reshape(-1).long()
        rows = torch.repeat_interleave(torch.arange(counts.numel(), device=self.device), counts,
                                       output_size=self.col_idx.numel())
        return rows // max(n, 1), rows % max(n, 1)

    def block_mask(self) -> Tensor:
        """Boolean ``[B, H, n, n]`` block mask (query block, key block)."""
        n = self.n_blocks
        mask = torch.zeros(self.batch * self.heads, n, n, dtype=torch.bool, device=self.device)
        head, qb = self._rows()
        mask[head, qb, self.col_idx.long()] = True
        return mask.reshape(self.batch, self.heads, n, n)

    def token_mask(self) -> Tensor:
        """Boolean ``[B, H, T, T]`` mask of the attention the kernels compute (block mask and
        causal), e.g. for ``scaled_dot_product_attention(..., attn_mask=...)``."""
        t, bs = self.seq_len, self.block_size
        blocks = torch.arange(t, device=self.device) // bs
        tokens = self.block_mask()[:, :, blocks][:, :, :, blocks]
        return tokens & torch.ones(t, t, dtype=torch.bool, device=self.device).tril_()

    def transposed(self) -> Tuple[Tensor, Tensor]:
        """``(col_ptr, row_idx)``: per key block the query blocks attending to it, same format.
        Tensor ops only (no host sync on CUDA); cached (:meth:`derived`)."""
        return self.derived("transposed", self._transpose)

    def _transpose(self) -> Tuple[Tensor, Tensor]:
        b, h, n = self.batch, self.heads, self.n_blocks
        head, qb = self._rows()
        key = head * n + self.col_idx.long()
        order = torch.argsort(key, stable=True)  # entries are in query order within a head
        counts = torch.zeros(b * h * n, dtype=torch.int64, device=self.device)
        counts.scatter_add_(0, key, torch.ones_like(key))
        flat = torch.zeros(b * h * n + 1, dtype=torch.int64, device=self.device)
        torch.cumsum(counts, 0, out=flat[1:])
        heads = torch.arange(b * h, device=self.device).unsqueeze(1) * n
        col_ptr = flat[heads + torch.arange(n + 1, device=self.device)].reshape(b, h, n + 1)
        return col_ptr.to(torch.int32), qb[order].to(torch.int32)

    def to(self, device) -> "BlockLayout":
        """This layout on ``device``: ``self`` there, else a copy made once and cached, so what
        the copy caches in turn (its transpose, its ``BlockMask``) lasts as long as the layout."""
        device = torch.device(device)
        if device == self.device:
            return self
        return self.derived(("to", device), lambda: BlockLayout(self.row_ptr.to(device), self.col_idx.to(device),
                                                                self.block_size, self.seq_len))

    def __repr__(self) -> str:
        return (f"BlockLayout(batch={self.batch}, heads={self.heads}, seq_len={self.seq_len}, "
                f"block_size={self.block_size}, active={self.active_blocks()}, "
                f"density={self.density():.3f})")


def slot_sources(slot_token: Tensor, seq_len: int) -> Tensor:
    """int64 ``[B, H, S]``: the token at each slot, ``seq_len`` for a padding slot."""
    return torch.where(slot_token >= 0, slot_token.long(), seq_len)


def gather_slots(x: Tensor, src: Tensor) -> Tensor:
    """``x [B, H, T, D]`` in slot order ``[B, H, S, D]`` (zero rows at padding slots)."""
    b, h, _, d = x.shape
    idx = src.unsqueeze(-1).expand(b, h, src.shape[-1], d)
    return torch.cat([x, x.new_zeros(b, h, 1, d)], dim=2).gather(2, idx)


def scatter_slots(out: Tensor, src: Tensor, seq_len: int) -> Tensor:
    """Inverse of :func:`gather_slots`: slot-order rows back to token order (padding dropped)."""
    b, h, _, d = out.shape
    slots = torch.arange(src.shape[-1], device=src.device).expand_as(src)
    slot_of = torch.zeros(b, h, seq_len + 1, dtype=torch.long, device=src.device).scatter_(-1, src, slots)
    return out.gather(2, slot_of[..., :seq_len].unsqueeze(-1).expand(b, h, seq_len, d))
