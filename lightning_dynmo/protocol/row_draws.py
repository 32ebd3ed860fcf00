"""Rows of a seeded normal draw without the whole tensor: what lets a rank initialise only its
``Shard(0)`` rows of a layer (``dp_sharding="fsdp"`` with meta-device init) or one chunk of a
vocabulary-split head, with the values a single process draws for the whole tensor.

``torch.empty(n).normal_(mean, std, generator=g)`` on the CPU in fp32 (``n >= 16``) first takes
``n`` uniforms from ``g`` in order, then turns each block of 16 into 16 normals (Box-Muller, pairs
``j`` and ``j + 8``), and when ``n`` is not a multiple of 16 takes 16 more uniforms for the last 16
positions. A draw of a length that is a multiple of 16 is therefore the matching slice of the
whole draw, bit for bit, and ``uniform_`` takes the same uniforms as the first pass (each one
32-bit draw). :func:`normal_rows_` streams the whole draw through a bounded buffer in such
pieces, keeps the rows asked for, and leaves ``g`` where the whole draw leaves it.
``tests/unit/test_row_draws.py`` holds it to the whole draw on every length class.
"""
from __future__ import annotations

import torch

__all__ = ["normal_rows_", "skip_normal"]

_BLOCK = 16
_CHUNK = 1 << 20  # elements of the streaming buffer (4 MiB), a multiple of the block


def normal_rows_(out: torch.Tensor, shape: tuple[int, ...], start: int, std: float, generator: torch.Generator,
                 mean: float = 0.0, chunk: int | None = None) -> torch.Tensor:
    """Fill ``out`` (``[rows, *shape[1:]]``) with rows ``[start, start + rows)`` of
    ``torch.empty(shape).normal_(mean, std, generator=generator)`` (fp32, CPU), advancing
    ``generator`` exactly as that whole draw does; at most ``chunk`` (default 2^20) extra
    elements are held."""
    shape = tuple(int(s) for s in shape)
    row = 1
    for s in shape[1:]:
        row *= s
    n = row * shape[0] if shape else 1
    rows = out.shape[0] if out.dim() else 1
    lo, hi = start * row, (start + rows) * row
    if not 0 <= lo <= hi <= n:
        raise ValueError(f"rows [{start}, {start + rows}) are outside a draw of shape {list(shape)}")
    flat = out.reshape(-1) if out.is_contiguous() else None
    if n < _BLOCK or flat is None:  # short draws (another algorithm) and strided targets: drawn whole
        whole = torch.empty(shape, dtype=torch.float32).normal_(mean, std, generator=generator)
        out.copy_(whole.reshape(-1)[lo:hi].reshape(out.shape))
        return out
    chunk = _CHUNK if chunk is None else chunk
    chunk = max(_BLOCK, chunk - chunk % _BLOCK)
    body = n - n % _BLOCK  # the whole blocks: their normals come from the first n uniforms
    keep_hi = min(hi, n - _BLOCK) if n % _BLOCK else hi  # positions past n - 16 are redrawn at the end
    buf = torch.empty(min(chunk, body), dtype=torch.float32)
    pos = 0
    while pos < body:
        size = min(chunk, body - pos)
        piece = buf[:size]
        if pos + size <= lo or pos >= keep_hi:
            piece.uniform_(generator=generator)  # the same uniforms, not needed here
        else:
            piece.normal_(mean, std, generator=generator)
            a, b = max(lo, pos), min(keep_hi, pos + size)
            if a < b:
                flat[a - lo:b - lo].copy_(piece[a - pos:b - pos])
        pos += size
    if n % _BLOCK:
        torch.empty(n - body, dtype=torch.float32).uniform_(generator=generator)  # the rest of the first pass
        tail = torch.empty(_BLOCK, dtype=torch.float32).normal_(mean, std, generator=generator)
        a, b = max(lo, n - _BLOCK), hi
        if a < b:
            flat[a - lo:b - lo].copy_(tail[a - (n - _BLOCK):b - (n - _BLOCK)])
    return out


def skip_normal(generator: torch.Generator, shape: tuple[int, ...]) -> None:
    """Advance ``generator`` past ``torch.empty(shape).normal_(generator=generator)`` (fp32, CPU)
    holding at most a streaming buffer."""
    normal_rows_(torch.empty((0, *tuple(shape)[1:]), dtype=torch.float32), shape, 0, 1.0, generator)
