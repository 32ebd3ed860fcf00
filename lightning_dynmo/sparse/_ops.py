"""The sparse ops behind SparseLinear: compiled kernels when present, labelled slow fallbacks
otherwise, plus the fake (meta) and autograd rules that make them work under autograd and
``torch.compile``.

Kernels live under ``torch.ops.ldsparse`` (schemas in cpp/csrc/ops.cpp).  When the
extension is missing -- a broken or skipped build -- the same schemas are defined here with
pure-torch reference implementations (they densify the weight: correct but slower and
O(out*in) memory), so ``import lightning_dynmo`` and every SparseLinear feature still work.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch import Tensor

try:
    from . import _C  # noqa: F401  (registers torch.ops.ldsparse kernels)
    _EXT_ERROR: Optional[BaseException] = None
except Exception as exc:  # ImportError, or OSError/undefined symbols from a stale build
    _C = None
    _EXT_ERROR = exc


def extension_available() -> bool:
    """True when the compiled kernels loaded (otherwise ops run the slow reference path)."""
    return _C is not None


def extension_error() -> Optional[BaseException]:
    """Why the compiled extension could not be imported (None when it was)."""
    return _EXT_ERROR


def cuda_kernels_available() -> bool:
    return _C is not None and bool(_C.has_cuda())


# --------------------------------------------------------------------------- reference path
def _rows_of(crow: Tensor) -> Tensor:
    counts = crow[1:].long() - crow[:-1].long()
    return torch.repeat_interleave(torch.arange(counts.numel(), device=crow.device), counts)


def _dense(crow: Tensor, col: Tensor, values: Tensor, n_cols: int) -> Tensor:
    w = values.new_zeros(crow.numel() - 1, n_cols)
    w[_rows_of(crow), col.long()] = values
    return w


def ref_spmm(crow: Tensor, col: Tensor, values: Tensor, x: Tensor, bias: Optional[Tensor]) -> Tensor:
    """Reference (slow: densifies W) for ``spmm``: Y = x @ W^T + bias."""
    y = x @ _dense(crow, col, values, x.shape[1]).t()
    return y + bias if bias is not None else y


def ref_sddmm(crow: Tensor, col: Tensor, g: Tensor, x: Tensor) -> Tensor:
    """Reference (slow: dense G^T X) for ``sddmm``: (g^T x) sampled at W's pattern."""
    return (g.t() @ x)[_rows_of(crow), col.long()]


def ref_csr_transpose(crow: Tensor, col: Tensor, n_cols: int):
    """Reference for ``csr_transpose``: CSR of W^T and perm with values_t = values[perm]."""
    rows = _rows_of(crow)
    perm = torch.argsort(col.long() * (crow.numel() - 1) + rows, stable=True)
    crow_t = torch.zeros(n_cols + 1, dtype=torch.int32, device=crow.device)
    crow_t[1:] = torch.cumsum(torch.bincount(col.long(), minlength=n_cols), 0)
    return crow_t, rows[perm].to(torch.int32), perm.to(torch.int32)


if _C is None:
    warnings.warn(
        f"lightning_dynmo.sparse: compiled kernels unavailable ({_EXT_ERROR!r}); SparseLinear "
        "uses the pure-torch reference path, which is SLOWER than dense. Rebuild with "
        "`pip install --no-build-isolation -e .`.", RuntimeWarning, stacklevel=2)
    _lib = torch.library.Library("ldsparse", "DEF")
    _lib.define("spmm(Tensor crow, Tensor col, Tensor values, Tensor x, Tensor? bias) -> Tensor")
    _lib.define("sddmm(Tensor crow, Tensor col, Tensor g, Tensor x) -> Tensor")
    _lib.define("csr_transpose(Tensor crow, Tensor col, int n_cols) -> (Tensor, Tensor, Tensor)")
    for _name, _fn in (("spmm", ref_spmm), ("sddmm", ref_sddmm), ("csr_transpose", ref_csr_transpose)):
        _lib.impl(_name, _fn, "CompositeExplicitAutograd")
elif not _C.has_cuda():
    # CPU-only build: CUDA tensors still work, through the reference path.
    _lib = torch.library.Library("ldsparse", "IMPL")
    _lib.impl("spmm", ref_spmm, "CUDA")
    _lib.impl("sddmm", ref_sddmm, "CUDA")


def _kernel_covers(x: Tensor) -> bool:
    """CPU kernels are fp32/fp64; other dtypes (e.g. bf16 on CPU) take the reference path."""
    return x.device.type != "cpu" or x.dtype in (torch.float32, torch.float64)


def spmm(crow: Tensor, col: Tensor, values: Tensor, x: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    if _kernel_covers(x):
        return torch.ops.ldsparse.spmm(crow, col, values, x, bias)
    return ref_spmm(crow, col, values, x, bias)


def sddmm(crow: Tensor, col: Tensor, g: Tensor, x: Tensor) -> Tensor:
    if _kernel_covers(x):
        return torch.ops.ldsparse.sddmm(crow, col, g, x)
    return ref_sddmm(crow, col, g, x)


def csr_transpose(crow: Tensor, col: Tensor, n_cols: int):
    return torch.ops.ldsparse.csr_transpose(crow, col, n_cols)


# --------------------------------------------------------------------------- fake tensors
@torch.library.register_fake("ldsparse::spmm")
def _spmm_fake(crow, col, values, x, bias):
    return x.new_empty(x.shape[0], crow.shape[0] - 1)


@torch.library.register_fake("ldsparse::sddmm")
def _sddmm_fake(crow, col, g, x):
    return x.new_empty(col.shape[0])


@torch.library.register_fake("ldsparse::csr_transpose")
def _csr_transpose_fake(crow, col, n_cols):
    return crow.new_empty(n_cols + 1), col.new_empty(col.shape[0]), col.new_empty(col.shape[0])


# --------------------------------------------------------------------------- autograd op
@torch.library.custom_op("lightning_dynmo::sparse_linear", mutates_args=())
def sparse_linear(x: Tensor, values: Tensor, bias: Optional[Tensor], crow: Tensor, col: Tensor,
                  crow_t: Tensor, col_t: Tensor, perm_t: Tensor) -> Tensor:
    """Y[t, o] = bias[o] + sum_k W[o, k] x[t, k] for 2-D x; W = CSR(crow, col, values).

    Backward: dX = G W via the cached transpose (crow_t, col_t, perm_t), dW = SDDMM(G, X)
    on W's pattern (nnz-sized, so optimizer state stays compressed), dbias = sum_t G.
    """
    return spmm(crow, col, values, x, bias)


@sparse_linear.register_fake
def _sparse_linear_fake(x, values, bias, crow, col, crow_t, col_t, perm_t):
    return x.new_empty(x.shape[0], crow.shape[0] - 1)


def _setup_context(ctx, inputs, output):
    x, values, bias, crow, col, crow_t, col_t, perm_t = inputs
    ctx.has_bias = bias is not None
    ctx.save_for_backward(x, values, crow, col, crow_t, col_t, perm_t)


def _backward(ctx, grad):
    x, values, crow, col, crow_t, col_t, perm_t = ctx.saved_tensors
    g = grad.contiguous()
    dx = dv = db = None
    if ctx.needs_input_grad[0]:
        dx = spmm(crow_t, col_t, torch.index_select(values, 0, perm_t), g, None)
    if ctx.needs_input_grad[1]:
        dv = sddmm(crow, col, g, x)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        db = g.sum(0)
    return dx, dv, db, None, None, None, None, None


sparse_linear.register_autograd(_backward, setup_context=_setup_context)
