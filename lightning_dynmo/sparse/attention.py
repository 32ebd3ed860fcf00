"""Block-sparse causal attention: ``block_sparse_attention(q, k, v, layout, block_size)``.

A :class:`BlockLayout` says, per (batch, head) and query block of ``block_size`` tokens, which
key blocks it attends to. The attention is exact softmax attention under the token mask

    visible(i, j) = (block(i), block(j)) in layout  and  j <= i

computed flash-style (online softmax, O(T) memory per head, logsumexp saved for the backward)
by the ``ldsparse.block_attn_fwd`` / ``block_attn_bwd`` kernels of the compiled extension (CPU:
fp32/fp64; CUDA: fp32/bf16/fp16 when built with CUDA). Everything else -- no extension, another
dtype or device, a block size without a kernel -- takes :func:`reference_block_sparse_attention`,
dense attention under the same mask (O(T^2) memory, same results). Query rows that see no key
(a query block with no key block) output 0, as ``scaled_dot_product_attention`` does. On CUDA
the default ``backend="auto"`` computes the same attention with torch's FlexAttention
(:mod:`lightning_dynmo.sparse.flex`) or our kernel, whichever it measured faster for this shape
class (:mod:`lightning_dynmo.sparse.backend_choice`; flex alone where our CUDA kernel is not
built); ``backend="kernel"`` keeps ours, ``"flex"`` takes FlexAttention.

Layout format (what the kernels take, one CSR per head, heads one after another)::

    row_ptr  int32 [B, H, n + 1]   n = ceil(S / block_size); row_ptr[b, h, 0] = end of the previous head
    col_idx  int32 [nnz]           key blocks of query block i: col_idx[row_ptr[b,h,i]:row_ptr[b,h,i+1]],
                                   strictly increasing, each <= i

The layout lives on S "slots", by default the T tokens in order. ``slot_token`` (int32
``[B, H, S]``: the token at each slot, -1 for an empty padding slot, every token exactly once)
runs the attention on a permuted, padded sequence -- the mask above applies to slots, and
padding slots are no keys -- while
inputs, outputs and gradients stay in token order; the kernels apply the permutation as they
load and store, so it costs no extra pass (the hash-sorted layouts of ``hash_layout`` use this).
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Tuple, Union

import torch
from torch import Tensor

from . import _ops
from .backend_choice import cached_choice, choice_key, env_override, fastest
from .layout import BlockLayout, gather_slots, scatter_slots, slot_sources

__all__ = ["block_sparse_attention", "reference_block_sparse_attention",
           "attention_kernel_available", "KERNEL_BLOCK_SIZES", "BACKENDS", "resolve_backend", "auto_candidates",
           "pick_backend", "auto_route"]

KERNEL_BLOCK_SIZES = (16, 32, 64, 128)
# "kernel": our compiled kernels (the dense reference where none fits); "flex": torch's
# FlexAttention with the same mask (lightning_dynmo.sparse.flex); "auto": on CUDA the faster of
# the two by measurement (sparse.backend_choice; flex alone where our CUDA kernel is not built),
# the kernels on the CPU (FlexAttention has no CPU backward).
BACKENDS = ("auto", "kernel", "flex")


def _has_op(name: str) -> bool:
    if not _ops.extension_available():
        return False
    try:
        getattr(torch.ops.ldsparse, name)
        return True
    except (AttributeError, RuntimeError):  # a stale build without the attention kernels
        return False


_HAS_KERNELS = _has_op("block_attn_fwd") and _has_op("block_attn_bwd")


def _has_cuda_kernels() -> bool:
    return _HAS_KERNELS and _ops.cuda_kernels_available() and torch._C._dispatch_has_kernel_for_dispatch_key(
        "ldsparse::block_attn_fwd", "CUDA")


def attention_kernel_available(device: Union[str, torch.device] = "cpu",
                               dtype: torch.dtype = torch.float32, block_size: int = 64) -> bool:
    """Whether ``block_sparse_attention`` runs the compiled kernel (not the dense reference)."""
    device = torch.device(device)
    if not _HAS_KERNELS or block_size not in KERNEL_BLOCK_SIZES:
        return False
    if device.type == "cpu":
        return dtype in (torch.float32, torch.float64)
    if device.type == "cuda":
        return dtype in (torch.float32, torch.bfloat16, torch.float16) and _has_cuda_kernels()
    return False


# --------------------------------------------------------------------------- reference
def reference_block_sparse_attention(q: Tensor, k: Tensor, v: Tensor, layout: BlockLayout,
                                     scale: Optional[float] = None,
                                     slot_token: Optional[Tensor] = None) -> Tensor:
    """Dense attention under ``layout.token_mask()`` (O(T^2) memory): the fallback path and the
    definition the kernels are tested against. Rows that see no key output 0."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    mask = layout.to(q.device).token_mask()
    if slot_token is not None:  # gather to slots, attend (padding slots are no keys), gather back
        t = q.shape[2]
        src = slot_sources(slot_token.to(q.device), t)
        qs, ks, vs = (gather_slots(x, src) for x in (q, k, v))
        return scatter_slots(_masked_attention(qs, ks, vs, mask & (src < t).unsqueeze(-2), scale), src, t)
    return _masked_attention(q, k, v, mask, scale)


def _masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    denom = e.sum(-1, keepdim=True)
    return torch.matmul(e / torch.where(denom > 0, denom, torch.ones_like(denom)), v)


# --------------------------------------------------------------------------- kernel op
@torch.library.custom_op("lightning_dynmo::block_sparse_attention", mutates_args=())
def block_attention_op(q: Tensor, k: Tensor, v: Tensor, row_ptr: Tensor, col_idx: Tensor,
                       col_ptr: Tensor, row_idx: Tensor, block_size: int, scale: float,
                       slot_token: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """(out [B, H, T, D], lse [B, H, S]) of the kernels, differentiable in q, k, v.
    (col_ptr, row_idx) is the transposed layout, used by the backward only."""
    return torch.ops.ldsparse.block_attn_fwd(q, k, v, row_ptr, col_idx, block_size, scale, slot_token)


def _lse_dtype(q: Tensor) -> torch.dtype:
    return q.dtype if q.device.type == "cpu" or q.dtype == torch.float64 else torch.float32


def _fwd_outputs(q, slot_token):
    lse_shape = q.shape[:-1] if slot_token is None else slot_token.shape
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty(lse_shape, dtype=_lse_dtype(q)))


@block_attention_op.register_fake
def _block_attention_fake(q, k, v, row_ptr, col_idx, col_ptr, row_idx, block_size, scale, slot_token=None):
    return _fwd_outputs(q, slot_token)


if _HAS_KERNELS:
    @torch.library.register_fake("ldsparse::block_attn_fwd")
    def _fwd_fake(q, k, v, row_ptr, col_idx, block_size, scale, slot_token=None):
        return _fwd_outputs(q, slot_token)

    @torch.library.register_fake("ldsparse::block_attn_bwd")
    def _bwd_fake(grad_out, q, k, v, out, lse, col_ptr, row_idx, block_size, scale, slot_token=None):
        return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, row_ptr, col_idx, col_ptr, row_idx, block_size, scale, slot_token = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.block_size, ctx.scale = block_size, scale
    ctx.save_for_backward(q, k, v, out, lse, col_ptr, row_idx, slot_token)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, col_ptr, row_idx, slot_token = ctx.saved_tensors
    dq, dk, dv = torch.ops.ldsparse.block_attn_bwd(grad_out, q, k, v, out, lse, col_ptr, row_idx,
                                                   ctx.block_size, ctx.scale, slot_token)
    return dq, dk, dv, None, None, None, None, None, None, None


block_attention_op.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------- public API
# torch's compiled FlexAttention refuses head dims below 16 on CUDA ("NYI: embedding dimension
# ... must be at least 16"); "auto" keeps our kernel there, found on an H200 (torch 2.11)
FLEX_MIN_HEAD_DIM = 16


def resolve_backend(backend: str, device: Union[str, torch.device], head_dim: Optional[int] = None) -> str:
    """``"kernel"`` or ``"flex"``: what ``backend`` means for tensors on ``device`` with
    ``head_dim`` channels per head (unknown: assume flex can take it), without measuring:
    for ``"auto"`` the preferred candidate (see :func:`pick_backend` for the measured choice)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; use one of {', '.join(BACKENDS)}")
    small = head_dim is not None and int(head_dim) < FLEX_MIN_HEAD_DIM
    on_cuda = torch.device(device).type == "cuda"
    if backend == "auto":
        from .flex import flex_available

        return "flex" if on_cuda and not small and flex_available() else "kernel"
    if backend == "flex" and on_cuda and small:
        raise ValueError(f"backend='flex' needs head_dim >= {FLEX_MIN_HEAD_DIM} on CUDA (torch's FlexAttention "
                         f"does not compile smaller ones), got {head_dim}: use backend='auto' or 'kernel'")
    return backend


def auto_candidates(device: Union[str, torch.device], dtype: torch.dtype, block_size: int,
                    head_dim: int) -> Tuple[str, ...]:
    """What ``backend="auto"`` chooses among: FlexAttention on CUDA (head_dim >= 16), and our
    kernel where it is built for this device, dtype and block size. With neither, ``("kernel",)``:
    the dense reference (which a benchmark must name so)."""

    device = torch.device(device)
    found = []
    if resolve_backend("auto", device, head_dim) == "flex":
        found.append("flex")
    if attention_kernel_available(device, dtype, block_size):
        found.append("kernel")
    return tuple(found) or ("kernel",)


def auto_route(device: Union[str, torch.device], dtype: torch.dtype, seq_len: int, block_size: int,
               head_dim: int, what: str = "layout") -> Optional[str]:
    """What ``backend="auto"`` runs for such a call: ``"flex"``, ``"kernel"`` (our compiled
    kernel) or ``"reference"`` (the dense masked fallback: never to be reported as ours); None
    while it is still to be measured."""
    candidates = auto_candidates(device, dtype, block_size, head_dim)
    name = env_override(candidates) or (candidates[0] if len(candidates) == 1 else None)
    name = name or cached_choice(choice_key(what, torch.device(device), dtype, seq_len, block_size, head_dim))
    if name == "kernel" and not attention_kernel_available(device, dtype, block_size):
        return "reference"
    return name


Trial = Callable[[str], Callable[[], None]]  # name -> a prepared forward+backward to time


def pick_backend(backend: str, what: str, q: Tensor, block_size: int, trial: Trial) -> str:
    """``"kernel"`` or ``"flex"`` for this call: ``backend`` itself unless it is ``"auto"``; then
    the only candidate, ``LDSPARSE_ATTENTION_BACKEND``, or the faster one measured once per shape
    class (``trial(name)`` prepares a forward+backward to time; :mod:`.backend_choice`). While
    ``torch.compile`` traces or a CUDA graph is captured nothing is measured: the cached choice,
    else the preferred candidate."""
    d = q.shape[-1]
    if backend != "auto":
        return resolve_backend(backend, q.device, d)
    candidates = auto_candidates(q.device, q.dtype, block_size, d)
    forced = env_override(candidates)
    if forced is not None or len(candidates) == 1:
        return forced or candidates[0]
    key = choice_key(what, q.device, q.dtype, q.shape[-2], block_size, d)
    if torch.compiler.is_compiling() or (q.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return cached_choice(key) or candidates[0]
    return fastest(key, {name: (lambda name=name: trial(name)) for name in candidates}, q.device)


def timed_step(attend: Callable[[Tensor, Tensor, Tensor], Tensor], q: Tensor, k: Tensor, v: Tensor):
    """A forward+backward of ``attend`` on detached copies of q, k, v (a :func:`pick_backend` trial)."""
    xs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    grad = torch.randn_like(xs[0])

    def run():
        for x in xs:
            x.grad = None
        attend(*xs).backward(grad)
    return run


def _as_layout(layout, block_size: Optional[int], seq_len: int) -> BlockLayout:
    if isinstance(layout, BlockLayout):
        if block_size is not None and int(block_size) != layout.block_size:
            raise ValueError(f"block_size={block_size} does not match the layout's {layout.block_size}")
        return layout
    if block_size is None:
        raise ValueError("block_size is required unless layout is a BlockLayout")
    if isinstance(layout, Tensor):
        return BlockLayout.from_block_mask(layout, block_size, seq_len)
    if isinstance(layout, (tuple, list)) and len(layout) == 2:
        return BlockLayout(layout[0], layout[1], block_size, seq_len)
    raise TypeError("layout must be a BlockLayout, a boolean [B, H, n, n] block mask or a "
                    f"(row_ptr, col_idx) pair, got {type(layout).__name__}")


def block_sparse_attention(q: Tensor, k: Tensor, v: Tensor,
                           layout: Union[BlockLayout, Tensor, Tuple[Tensor, Tensor]],
                           block_size: Optional[int] = None, scale: Optional[float] = None,
                           slot_token: Optional[Tensor] = None, backend: str = "auto") -> Tensor:
    """Causal softmax attention restricted to a block layout; ``q, k, v``: ``[B, H, T, D]``.

    ``layout``: a :class:`BlockLayout`, a boolean ``[B, H, n, n]`` block mask, or a
    ``(row_ptr, col_idx)`` pair (then ``block_size`` is required). ``scale`` defaults to
    ``1 / sqrt(D)``. ``slot_token``: see the module docstring. ``backend``: see ``BACKENDS``
    (``"flex"`` cannot train on the CPU). Differentiable in q, k, v; equal
    (to rounding) to ``scaled_dot_product_attention(q, k, v, attn_mask=layout.token_mask(),
    scale=scale)`` when ``slot_token`` is None.
    """
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError("q, k, v must all be [batch, heads, seq, head_dim] of one shape, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    b, h, t, d = q.shape
    slots = t
    if slot_token is not None:
        if slot_token.dim() != 3 or tuple(slot_token.shape[:2]) != (b, h):
            raise ValueError(f"slot_token must be [B, H, S] = [{b}, {h}, S], got {tuple(slot_token.shape)}")
        slots = slot_token.shape[-1]
        slot_token = slot_token.to(device=q.device, dtype=torch.int32).contiguous()
    layout = _as_layout(layout, block_size, slots)
    if layout.seq_len != slots or layout.batch != b or layout.heads != h:
        raise ValueError(f"layout is for (batch={layout.batch}, heads={layout.heads}, seq={layout.seq_len}) "
                         f"but q is [{b}, {h}, {t}, {d}]" + (f" with {slots} slots" if slot_token is not None else ""))
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)

    def attend(name: str, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if name == "flex":
            from .flex import flex_block_sparse_attention

            return flex_block_sparse_attention(q, k, v, layout, scale, slot_token)
        return _kernel_attention(q, k, v, layout, scale, slot_token)

    name = pick_backend(backend, "layout", q, layout.block_size,
                        lambda name: timed_step(lambda *x: attend(name, *x), q, k, v))
    return attend(name, q, k, v)


def _kernel_attention(q: Tensor, k: Tensor, v: Tensor, layout: BlockLayout, scale: float,
                      slot_token: Optional[Tensor]) -> Tensor:
    """Our compiled kernel, or the dense reference where none is built for this call."""
    if attention_kernel_available(q.device, q.dtype, layout.block_size):
        layout = layout.to(q.device)
        col_ptr, row_idx = layout.transposed()
        out, _ = block_attention_op(q, k, v, layout.row_ptr, layout.col_idx, col_ptr, row_idx,
                                    layout.block_size, scale, slot_token)
        return out
    return reference_block_sparse_attention(q, k, v, layout, scale, slot_token)
