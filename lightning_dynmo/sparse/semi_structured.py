"""2:4 semi-structured sparsity on tensor cores, through torch's own kernels (no kernel of ours).

:func:`semi_structured_linear` computes ``y = x (W * mask)^T + b`` for a weight whose mask keeps
at most 2 of every 4 consecutive input weights, with the forward on
:class:`torch.sparse.SparseSemiStructuredTensor` (cuSPARSELt where torch has it, else CUTLASS).

Why this backward: torch's semi-structured tensor is an inference format. It has no autograd of
its own, its compressed values cannot be updated in place, and its transpose is only available
when both orientations were compressed (``prune_dense_static_sort``, which imposes its own 4x4
tile pattern rather than our magnitude rule). So the layer keeps the **dense master weight** and
its mask (what the optimizer, the data-parallel all-reduce, migration and checkpoints see, as for
any masked dense layer) and a small autograd function does the rest:

* forward: ``F.linear(x, compress(W * mask), b)`` on the sparse tensor cores;
* input gradient ``g (W * mask)``: on the sparse tensor cores when the mask is 2:4 along the
  output dimension too ("transposable": then ``(W * mask)^T`` is compressed as well), else dense;
* weight gradient ``(g^T x) * mask``: dense (an SDDMM has no semi-structured kernel), so pruned
  weights get exactly zero gradient, as in masked dense training.

The compressed weight is cached against the weight's and mask's version counters
(``Tensor._version``), so it is rebuilt exactly once after every optimizer step (or mask change)
and reused by every micro-batch in between: stale values cannot be used.

Where the route is unavailable (CPU, fp32/fp64, shapes torch's kernels reject, a mask that is not
2:4), :func:`semi_structured_unavailable` says why and the caller computes the same math masked
dense.
"""
from __future__ import annotations

import os

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["semi_structured_unavailable", "semi_structured_linear", "semi_structured_backend",
           "SemiStructuredCache", "is_2to4"]

_DTYPES = (torch.bfloat16, torch.float16)


def is_2to4(mask: Tensor) -> bool:
    """At most 2 kept of every 4 consecutive entries along the last dimension of a 2-D mask."""
    if mask.dim() != 2 or mask.shape[1] % 4:
        return False
    return bool((mask.reshape(mask.shape[0], -1, 4).sum(-1) <= 2).all())


SEMI_BACKENDS = ("cusparselt", "cutlass")


def semi_structured_backend() -> Optional[type]:
    """torch's semi-structured tensor class this build uses, or None.

    ``LDSPARSE_SEMI_BACKEND`` (read per call) picks ``cusparselt`` or ``cutlass``; unset, cuSPARSELt
    where torch has it. Why a choice: torch 2.11's cuSPARSELt matmul rebuilds its descriptors and
    plan on every call (a fixed cost of about half a millisecond, pytorch/pytorch#177866), which
    the CUTLASS kernels do not pay -- but those run on compute capability 8.x only (A100), so on
    Hopper cuSPARSELt is the one 2:4 route (:func:`semi_structured_unavailable` says so)."""
    sparse = torch.sparse
    if not hasattr(sparse, "to_sparse_semi_structured"):
        return None
    wanted = os.environ.get("LDSPARSE_SEMI_BACKEND", "")
    if wanted and wanted not in SEMI_BACKENDS:
        raise ValueError(f"LDSPARSE_SEMI_BACKEND must be one of {SEMI_BACKENDS} (or unset), got {wanted!r}")
    cusparselt = getattr(torch.backends, "cusparselt", None)
    has_lt = (cusparselt is not None and cusparselt.is_available()
              and hasattr(sparse, "SparseSemiStructuredTensorCUSPARSELT"))
    if wanted != "cutlass" and has_lt:
        return sparse.SparseSemiStructuredTensorCUSPARSELT
    if wanted == "cusparselt":
        raise RuntimeError("LDSPARSE_SEMI_BACKEND=cusparselt, but this torch build has no cuSPARSELt")
    return getattr(sparse, "SparseSemiStructuredTensorCUTLASS", None)


def semi_structured_unavailable(device: torch.device, dtype: torch.dtype, out_features: int,
                                in_features: int) -> Optional[str]:
    """None when torch's 2:4 kernels can run this layer here; else the reason (for logs and tests)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"2:4 semi-structured kernels need a CUDA device (got {device.type})"
    if dtype not in _DTYPES:
        return f"2:4 semi-structured training runs in bf16/fp16 (got {dtype})"
    if not torch.cuda.is_available() or torch.cuda.get_device_capability(device) < (8, 0):
        return "2:4 semi-structured kernels need compute capability 8.0 or newer"
    cls = semi_structured_backend()
    if cls is None:
        return "this torch build has no semi-structured sparse tensors"
    if cls.__name__.endswith("CUTLASS") and torch.cuda.get_device_capability(device)[0] != 8:
        # torch's CUTLASS 2:4 kernels are built for sm8x only (an H200 run: "sparse_semi_structured_mad_op:
        # Supported only on GPUs with compute capability 8.x")
        return ("torch's CUTLASS 2:4 kernels run on compute capability 8.x only; unset LDSPARSE_SEMI_BACKEND "
                "(cuSPARSELt) on this GPU")
    c = cls._DTYPE_SHAPE_CONSTRAINTS[dtype]
    for rows, cols in ((out_features, in_features), (in_features, out_features)):
        if rows % c.sparse_min_rows or cols % c.sparse_min_cols:
            return (f"{cls.__name__} needs weight dims that are multiples of ({c.sparse_min_rows}, "
                    f"{c.sparse_min_cols}) in both orientations (got [{out_features}, {in_features}])")
    return None


class SemiStructuredCache:
    """The compressed ``W * mask`` (and its transpose when the mask allows), rebuilt only when the
    weight or the mask changed (their ``_version`` counters) or the compute dtype did."""

    def __init__(self) -> None:
        self.key: Optional[tuple] = None
        self.sparse: Optional[Tensor] = None
        self.sparse_t: Optional[Tensor] = None
        self.masked: Optional[Tensor] = None
        self.rebuilds = 0

    @torch.no_grad()
    def get(self, weight: Tensor, mask: Tensor, dtype: torch.dtype) -> tuple[Tensor, Optional[Tensor], Tensor]:
        cls = semi_structured_backend()
        key = (weight.data_ptr(), weight._version, mask.data_ptr(), mask._version, dtype, cls)
        if key != self.key:
            masked = (weight.detach().to(dtype) * mask).contiguous()
            self.sparse = cls.from_dense(masked)
            mask_t = mask.t()
            self.sparse_t = cls.from_dense(masked.t().contiguous()) if is_2to4(mask_t) else None
            self.masked = masked
            self.key = key
            self.rebuilds += 1
        return self.sparse, self.sparse_t, self.masked


class _SemiStructuredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, bias, mask, sparse, sparse_t, masked):
        ctx.save_for_backward(x2d, mask, masked)
        ctx.sparse_t = sparse_t
        ctx.has_bias = bias is not None
        with torch.autocast(x2d.device.type, enabled=False):  # operands are already in the compute dtype
            return F.linear(x2d, sparse, bias)

    @staticmethod
    def backward(ctx, g):
        x2d, mask, masked = ctx.saved_tensors
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = F.linear(g, ctx.sparse_t) if ctx.sparse_t is not None else g @ masked
        if ctx.needs_input_grad[1]:
            gw = (g.t() @ x2d) * mask
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g.sum(0)
        return gx, gw, gb, None, None, None, None


def semi_structured_linear(x: Tensor, weight: Tensor, mask: Tensor, bias: Optional[Tensor],
                           cache: SemiStructuredCache, dtype: Optional[torch.dtype] = None) -> Tensor:
    """``F.linear(x, weight * mask, bias)`` with the 2:4 forward (see the module docstring).

    ``dtype``: the compute dtype (autocast's, or the weight's); the caller has checked
    :func:`semi_structured_unavailable` and that ``mask`` is 2:4."""
    dtype = dtype or weight.dtype
    sparse, sparse_t, masked = cache.get(weight, mask, dtype)
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1]).to(dtype)
    w = weight.to(dtype)  # differentiable cast: the gradient flows back to the fp32 master weight
    b = bias.to(dtype) if bias is not None else None
    y = _SemiStructuredLinear.apply(x2d, w, b, mask, sparse, sparse_t, masked)
    return y.reshape(*lead, y.shape[-1])
