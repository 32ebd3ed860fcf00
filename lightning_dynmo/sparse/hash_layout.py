"""Hash-based dynamic sparse attention on top of :func:`block_sparse_attention`.

Following Pagliardini et al. (2023, "Faster causal attention over large sequences through sparse
flash attention"): per head, random rotations give every token a bucket id (angular LSH as in
Reformer: ``argmax([x R, -x R])`` over ``nb_hash`` directions), tokens are sorted by bucket,
and only (query block, key block) pairs of one bucket are computed. How many pairs survive
depends on the data, per layer and per step: that is the load signal the pipeline balances.

**What is hashed.** Training grows a direction that every key shares; an angular hash of the
raw keys then sends most tokens to one bucket and the layer's density climbs towards 1
(``benchmarks/hash_bucket_balance.py``, 60 steps: an 8-bucket layer went from density 0.21 to
0.95-0.99 on random tokens, to 0.62-0.76 on text). ``center="causal"`` (GPT's default,
``GPTConfig.hash_center``) hashes each key minus the mean of the keys at positions <= its own
(:func:`causal_center`): 0.21 and 0.28 there, same loss. Being a statistic of the past, it keeps
the attention causal; a mean over the whole sequence would not. ``"causal_std"`` also divides
by the running standard deviation (0.21 and 0.26: a small gain for another pass). L2
normalisation would change nothing: the hash is angular.

**Which tokens see which.** Token i attends to token j iff

    bucket(i) == bucket(j)  and  j <= i        (positions in the original sequence)

**How causality survives the sort -- exactly, with the kernels' plain causal block mask.**

Sorting by bucket and masking with the sorted index would let a token see later tokens of other
buckets; Pagliardini et al. mask with the original indices inside a generic kernel. Here the
layout itself makes the sorted index safe:

1. One bucket per token (the hash of its key, Reformer's shared-QK choice), so queries, keys and
   values move with one permutation per (batch, head).
2. The permutation sorts by ``(bucket, original position)``: inside a bucket the sorted order is
   the original order.
3. Each bucket's run is padded with empty slots to a whole number of blocks, so every block holds
   tokens of one bucket only, and the layout is, per bucket, the lower triangle of that bucket's
   blocks (the diagonal block included). No block pair mixes buckets.

Within a bucket's run, "key slot <= query slot" (what the kernels' diagonal-block mask and the
lower-triangular layout implement) is therefore exactly "key position <= query position", and
pairs across buckets are never computed. Padding slots come after every real token of their
run, so the causal mask already hides them from every real query (and the kernels treat
padding slots as no keys anyway); their own outputs are dropped. Every token sees at least
itself (its diagonal block is always in the layout), so no row is empty. The kernels apply the
permutation while loading and storing (``slot_token``): sorting costs no gather passes.
:meth:`HashPlan.token_mask` gives the resulting mask in the original order; the tests check it
against the rule above and the outputs against ``scaled_dot_product_attention`` with that mask.

**Cost.** Bucket ``b`` with ``n_b`` tokens takes ``m_b = ceil(n_b / block_size)`` blocks and
``m_b (m_b + 1) / 2`` block pairs; with balanced buckets the density (active / dense causal
block pairs) is about ``1 / nb_hash`` plus the diagonal and padding overhead, about
``2 / n_blocks``. Keep ``nb_hash`` well below ``T / block_size``: with tiny buckets the
padding makes the sparse layer dearer than dense (density > 1 is reported as such).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

from .attention import block_sparse_attention, pick_backend, timed_step
from .layout import BlockLayout

__all__ = ["draw_rotations", "hash_buckets", "HashPlan", "hash_sort_plan", "hash_sparse_attention",
           "local_window_layout", "max_slots", "HASH_CENTERS", "causal_center"]

# What the hash sees (see hash_buckets): the keys as they are, or minus their causal running mean
# (and, "causal_std", divided by their causal running standard deviation per dimension).
HASH_CENTERS = ("none", "causal", "causal_std")


def _check_nb_hash(nb_hash: int) -> int:
    if int(nb_hash) != nb_hash or int(nb_hash) < 1:
        raise ValueError(f"nb_hash must be an integer >= 1, got {nb_hash!r}")
    return int(nb_hash)


def draw_rotations(n_head: int, head_dim: int, nb_hash: int, generator: Optional[torch.Generator] = None,
                   device=None, dtype: torch.dtype = torch.float32) -> Tensor:
    """Random Gaussian directions ``[n_head, head_dim, ceil(nb_hash / 2)]`` for :func:`hash_buckets`
    (drawn on the CPU from ``generator`` so a seed gives the same rotations on any device)."""
    nb_hash = _check_nb_hash(nb_hash)
    r = torch.randn(n_head, head_dim, (nb_hash + 1) // 2, generator=generator, dtype=torch.float32)
    return r.to(device=device, dtype=dtype)


def _check_center(center: str) -> str:
    if center not in HASH_CENTERS:
        raise ValueError(f"hash center must be one of {HASH_CENTERS}, got {center!r}")
    return center


def causal_center(x: Tensor, scale: bool = False, eps: float = 1e-6) -> Tensor:
    """``x[..., t, :]`` minus the mean of ``x[..., :t + 1, :]`` (per head and dimension), and with
    ``scale`` divided by their standard deviation: a running statistic over the past and the
    token itself only, so a token's bucket never depends on later tokens. ``x``: ``[B, H, T, D]``."""
    x = x.float()
    x = x - x[..., :1, :]  # shifted by the first token (a past one for all): no cancellation in var
    n = torch.arange(1, x.shape[-2] + 1, device=x.device, dtype=x.dtype).unsqueeze(-1)
    mean = torch.cumsum(x, dim=-2) / n
    out = x - mean
    if scale:
        var = (torch.cumsum(x * x, dim=-2) / n - mean * mean).clamp_min(0.0)
        out = out / torch.sqrt(var + eps)
    return out


@torch.no_grad()
def hash_buckets(x: Tensor, rotations: Tensor, nb_hash: int, center: str = "none") -> Tensor:
    """Bucket id in ``[0, nb_hash)`` of every token: ``argmax([x R, -x R][:nb_hash])`` per head.
    ``x``: ``[B, H, T, D]``, ``rotations``: ``[H, D, ceil(nb_hash / 2)]``. Returns int64 ``[B, H, T]``.

    The hash is angular, so scaling a token's ``x`` changes nothing (L2 normalisation is a no-op);
    a direction that all keys share, which training grows, sends most tokens to one bucket.
    ``center="causal"`` hashes ``x`` minus its causal running mean (:func:`causal_center`),
    ``"causal_std"`` also divides by the running per-dimension standard deviation."""
    nb_hash = _check_nb_hash(nb_hash)
    center = _check_center(center)
    if rotations.dim() != 3 or rotations.shape[0] != x.shape[1] or rotations.shape[1] != x.shape[-1] \
            or rotations.shape[2] != (nb_hash + 1) // 2:
        raise ValueError(f"rotations must be [heads, head_dim, ceil(nb_hash / 2)] = "
                         f"[{x.shape[1]}, {x.shape[-1]}, {(nb_hash + 1) // 2}], got {tuple(rotations.shape)}")
    x = x.detach().float() if center == "none" else causal_center(x.detach(), scale=center == "causal_std")
    proj = torch.einsum("bhtd,hdr->bhtr", x, rotations.float())
    return torch.cat([proj, -proj], dim=-1)[..., :nb_hash].argmax(dim=-1)


@dataclass
class HashPlan:
    """Where every token goes and which block pairs are computed (see the module docstring).

    ``slot[b, h, t]``: position of token ``t`` in the sorted, padded sequence of ``layout.seq_len``
    slots; ``source[b, h, s]``: token at slot ``s`` (``seq_len`` = padding); ``layout``: the causal
    block layout on the padded sequence; ``causal_blocks``: block pairs of dense causal attention
    over the original sequence, the denominator of :attr:`density`.
    """

    buckets: Tensor
    slot: Tensor
    source: Tensor
    layout: BlockLayout
    seq_len: int
    causal_blocks: int

    @property
    def slot_token(self) -> Tensor:
        """int32 ``[B, H, slots]``: the token at each slot, -1 for padding (the kernels' format)."""
        return torch.where(self.source < self.seq_len, self.source, -1).to(torch.int32)

    @property
    def active_blocks(self) -> int:
        return self.layout.active_blocks()

    @property
    def density(self) -> float:
        """Block pairs computed / block pairs of dense causal attention (can exceed 1 when
        buckets are tiny compared with the block size)."""
        return self.active_blocks / max(1, self.causal_blocks)

    def token_mask(self) -> Tensor:
        """``[B, H, T, T]`` mask of who attends to whom, in the original token order, as the
        kernel computes it (layout and causal mask on the sorted slots, mapped back)."""
        sorted_mask = self.layout.token_mask()
        idx = self.slot
        rows = sorted_mask.gather(2, idx.unsqueeze(-1).expand(*idx.shape, sorted_mask.shape[-1]))
        return rows.gather(3, idx.unsqueeze(-2).expand(*idx.shape, idx.shape[-1]))


def hash_sort_plan(buckets: Tensor, nb_hash: int, block_size: int) -> HashPlan:
    """Sort tokens by ``(bucket, position)``, pad each bucket's run to whole blocks and build
    the per-bucket lower-triangular block layout. ``buckets``: int ``[B, H, T]`` in ``[0, nb_hash)``.
    Tensor ops throughout; the one host sync is the size of the layout."""
    nb = _check_nb_hash(nb_hash)
    bs = int(block_size)
    if bs < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if buckets.dim() != 3:
        raise ValueError(f"buckets must be [B, H, T], got {tuple(buckets.shape)}")
    b, h, t = buckets.shape
    dev = buckets.device
    buckets = buckets.long()
    pos = torch.arange(t, device=dev)
    perm = torch.argsort(buckets * t + pos, dim=-1)  # sorted index -> token
    sorted_bucket = buckets.gather(-1, perm)
    counts = torch.zeros(b, h, nb, dtype=torch.long, device=dev).scatter_add_(-1, buckets, torch.ones_like(buckets))
    run_blocks = (counts + bs - 1) // bs
    blk_end = torch.cumsum(run_blocks, -1)
    blk_start = blk_end - run_blocks
    tok_start = torch.cumsum(counts, -1) - counts
    rank = pos - tok_start.gather(-1, sorted_bucket)
    slot_sorted = blk_start.gather(-1, sorted_bucket) * bs + rank
    n_blocks = int(blk_end[..., -1].max()) if t > 0 else 0
    slots = n_blocks * bs
    slot = torch.empty_like(perm).scatter_(-1, perm, slot_sorted)
    source = torch.full((b, h, slots), t, dtype=torch.long, device=dev).scatter_(-1, slot_sorted, perm)

    r = torch.arange(n_blocks, device=dev).expand(b, h, n_blocks).contiguous()
    run = torch.searchsorted(blk_end, r, right=True)  # bucket whose run holds block r (nb: none)
    run_start = blk_start.gather(-1, run.clamp(max=nb - 1))
    row_len = torch.where(run < nb, r - run_start + 1, torch.zeros_like(r)).reshape(-1)
    flat = torch.zeros(row_len.numel() + 1, dtype=torch.long, device=dev)
    torch.cumsum(row_len, 0, out=flat[1:])
    nnz = int(flat[-1])
    heads = torch.arange(b * h, device=dev).unsqueeze(1) * n_blocks
    row_ptr = flat[heads + torch.arange(n_blocks + 1, device=dev)].reshape(b, h, n_blocks + 1)
    col_idx = (torch.repeat_interleave(run_start.reshape(-1), row_len, output_size=nnz)
               + torch.arange(nnz, device=dev)
               - torch.repeat_interleave(flat[:-1], row_len, output_size=nnz))
    layout = BlockLayout(row_ptr.to(torch.int32), col_idx.to(torch.int32), bs, slots)
    nq = -(-t // bs)
    return HashPlan(buckets, slot, source, layout, t, b * h * nq * (nq + 1) // 2)


def max_slots(seq_len: int, nb_hash: int, block_size: int) -> int:
    """Most slots :func:`hash_sort_plan` can need: every non-empty bucket pads at most one block."""
    return (-(-int(seq_len) // int(block_size)) + min(int(nb_hash), int(seq_len)) - 1) * int(block_size)


def hash_sparse_attention(q: Tensor, k: Tensor, v: Tensor, rotations: Tensor, nb_hash: int,
                          block_size: int, scale: Optional[float] = None,
                          buckets: Optional[Tensor] = None, backend: str = "auto",
                          center: str = "none") -> Tuple[Tensor, HashPlan]:
    """Causal attention where token i sees token j iff they share a hash bucket and j <= i.

    ``q, k, v``: ``[B, H, T, D]``; buckets come from the keys (:func:`hash_buckets`, with ``center``)
    unless given.
    ``backend``: as for ``block_sparse_attention`` (FlexAttention on CUDA by default; its slot
    sequence is padded to :func:`max_slots`, one shape for every step under ``torch.compile``).
    Returns the output ``[B, H, T, D]`` (differentiable in q, k, v) and the :class:`HashPlan`.
    """
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must be [B, H, T, D] of one shape, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    b, h, t, d = q.shape
    if buckets is None:
        buckets = hash_buckets(k, rotations, nb_hash, center)
    plan = hash_sort_plan(buckets, nb_hash, block_size)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)

    def attend(name: str, q: Tensor, k: Tensor, v: Tensor, layout: BlockLayout = plan.layout) -> Tensor:
        if name == "flex":
            from .flex import flex_block_sparse_attention

            return flex_block_sparse_attention(q, k, v, layout, scale, plan.slot_token,
                                               slots=max_slots(t, nb_hash, block_size))
        # The kernels read q/k/v through the slot map and write token order: no gather passes.
        return block_sparse_attention(q, k, v, layout, scale=scale, slot_token=plan.slot_token, backend="kernel")

    def trial(name: str):
        # a hash layout is new every step: each timed run gets a fresh layout object, so the
        # flex trial pays its BlockMask build as every training step does
        def fresh(*x):
            lay = plan.layout
            return attend(name, *x, layout=BlockLayout(lay.row_ptr, lay.col_idx, lay.block_size, lay.seq_len))
        return timed_step(fresh, q, k, v)

    return attend(pick_backend(backend, "hash", q, block_size, trial), q, k, v), plan


def local_window_layout(batch: int, heads: int, seq_len: int, block_size: int, window_blocks: int,
                        device=None) -> BlockLayout:
    """Order-keeping sliding-window layout: each query block sees itself and the
    ``window_blocks`` blocks before it (a static baseline to compare hash layouts with)."""
    if window_blocks < 0:
        raise ValueError(f"window_blocks must be >= 0, got {window_blocks}")
    n = -(-int(seq_len) // int(block_size))
    i = torch.arange(n, device=device)
    band = (i.unsqueeze(1) - i.unsqueeze(0) <= window_blocks)
    return BlockLayout.from_block_mask(band.expand(batch, heads, n, n), block_size, seq_len)
