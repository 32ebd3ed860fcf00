"""N:M structured sparsity (e.g. 2:4): the rule that decides which weights an N:M pattern keeps.

N:M keeps at most ``N`` weights in every group of ``M`` consecutive *input* weights of a row of
``weight [out, in]`` -- the layout tensor cores accelerate (2:4 for bf16/fp16 on Ampere and
Hopper, through :func:`torch.sparse.to_sparse_semi_structured`). The rule here is exact and
device independent: it keeps the ``N`` largest ``|w|`` of each group, already pruned weights rank
below every kept one, and ties go to the lower input index (decided by pairwise comparison, not
by a sort whose tie order could differ between devices or versions). Replicas holding equal
weights therefore compute equal masks without talking.

Inside the global magnitude schedule (:class:`~lightning_dynmo.callbacks.GradualPruning` with
``pattern="N:M"``) only the weights outside a group's top ``N`` may be pruned, smallest global
magnitude first; the sparsity that reaches ``1 - N/M`` is exactly the N:M pattern, and no
schedule may ask for more.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["parse_nm", "nm_keep", "nm_droppable", "satisfies_nm", "nm_max_sparsity", "transposable_2to4_keep",
           "transposable_droppable"]


def parse_nm(pattern: str | None) -> tuple[int, int] | None:
    """``"N:M"`` -> ``(N, M)``; ``None`` or ``"unstructured"`` -> ``None`` (plain magnitude pruning)."""
    if pattern is None or pattern == "unstructured":
        return None
    if not isinstance(pattern, str) or pattern.count(":") != 1:
        raise ValueError(f"pattern must be 'unstructured', 'N:M' (e.g. '2:4') or '2:4T', got {pattern!r}")
    try:
        n, m = (int(p) for p in pattern.split(":"))
    except ValueError:
        raise ValueError(f"pattern must be 'unstructured' or 'N:M' with integers N, M, got {pattern!r}") from None
    if not 1 <= n < m:
        raise ValueError(f"pattern {pattern!r}: need 1 <= N < M (N kept of every M input weights)")
    return n, m


def nm_max_sparsity(n: int, m: int) -> float:
    """The sparsity an N:M pattern reaches: ``1 - N/M``."""
    return 1.0 - n / m


def _groups(t: Tensor, m: int) -> Tensor:
    if t.dim() != 2:
        raise ValueError(f"N:M patterns apply to 2-D weights [out, in], got shape {tuple(t.shape)}")
    if t.shape[1] % m:
        raise ValueError(f"N:M pattern with M={m} needs in_features divisible by {m}, got weight shape "
                         f"{tuple(t.shape)}; leave this layer out (layer_filter) or use another M")
    return t.reshape(t.shape[0], t.shape[1] // m, m)


def nm_keep(scores: Tensor, n: int, m: int) -> Tensor:
    """Bool ``[out, in]``: the ``n`` largest ``scores`` in every group of ``m`` consecutive columns.

    Ties go to the lower column. An element's rank in its group is the number of elements that beat
    it: larger, or equal and earlier; it is kept when its rank is below ``n``."""
    g = _groups(scores, m)
    a, b = g.unsqueeze(-1), g.unsqueeze(-2)  # a: the element, b: its rivals
    earlier = torch.ones(m, m, dtype=torch.bool, device=g.device).tril(-1)  # [i, j]: j < i
    beats = (b > a) | ((b == a) & earlier)
    rank = beats.sum(-1)
    return (rank < n).reshape(scores.shape)


def nm_droppable(weight: Tensor, mask: Tensor, n: int, m: int) -> Tensor:
    """Kept weights outside their group's ``n`` largest ``|w|`` (pruned ones rank last): what the
    global magnitude schedule may prune next without leaving the N:M pattern."""
    mag = weight.detach().abs().float()
    mag = torch.where(mask.bool(), torch.nan_to_num(mag, nan=0.0), torch.full_like(mag, -1.0))
    return mask.bool() & ~nm_keep(mag, n, m)


def satisfies_nm(mask: Tensor, n: int, m: int) -> bool:
    """True when every group of ``m`` consecutive input weights keeps at most ``n``."""
    if mask.dim() != 2 or mask.shape[1] % m:
        return False
    return bool((_groups(mask.bool(), m).sum(-1) <= n).all())


def _tile_patterns(device) -> Tensor:
    """The 90 4x4 0/1 tiles with two ones in every row and every column, ``[16, 90]``, in a fixed order."""
    from itertools import combinations, product

    rows = [tuple(1 if c in pair else 0 for c in range(4)) for pair in combinations(range(4), 2)]
    tiles = [t for t in product(rows, repeat=4) if all(sum(r[c] for r in t) == 2 for c in range(4))]
    return torch.tensor(tiles, dtype=torch.float32, device=device).reshape(len(tiles), 16).t()


def _tiles(t: Tensor) -> Tensor:
    out, inn = t.shape
    return t.reshape(out // 4, 4, inn // 4, 4).permute(0, 2, 1, 3).reshape(-1, 16)


def transposable_2to4_keep(scores: Tensor, excluded: Tensor | None = None) -> Tensor:
    """Bool ``[out, in]``: per 4x4 tile, the 2:4 pattern *in rows and in columns* with the largest
    total score (exhaustive over the 90 such tiles; ties to the first in a fixed order). Its
    transpose is 2:4 too, so both the forward and the input gradient can run on 2:4 kernels.
    ``excluded`` (bool ``[out, in]``): positions no chosen tile may keep (already pruned weights)."""
    if scores.dim() != 2:
        raise ValueError(f"2:4 patterns apply to 2-D weights [out, in], got shape {tuple(scores.shape)}")
    out, inn = scores.shape
    if out % 4 or inn % 4:
        raise ValueError(f"a transposable 2:4 pattern needs both weight dims divisible by 4, got {tuple(scores.shape)}")
    pats = _tile_patterns(scores.device)
    score = _tiles(scores.float()) @ pats
    if excluded is not None:  # a tile keeping an excluded position is not a candidate
        score = score.masked_fill((_tiles(excluded.float()) @ pats) > 0, float("-inf"))
    best = score.argmax(-1)  # argmax returns the first maximum
    keep = pats.t()[best].bool().reshape(out // 4, inn // 4, 4, 4).permute(0, 2, 1, 3).reshape(out, inn)
    return keep


def transposable_droppable(weight: Tensor, mask: Tensor) -> Tensor:
    """Kept weights outside the best transposable 2:4 tile pattern that avoids every pruned
    weight (one always exists: the pattern chosen at the previous pruning step)."""
    mag = torch.nan_to_num(weight.detach().abs().float(), nan=0.0)
    return mask.bool() & ~transposable_2to4_keep(mag, excluded=~mask.bool())
