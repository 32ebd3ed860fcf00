"""The sparse ops behind SparseLinear: compiled kernels when present, labelled slow fallbacks
otherwise, plus the fake (meta) and autograd rules that make them work under autograd and
``torch.compile``.

Kernels live under ``torch.ops.ldsparse`` (schemas in cpp/csrc/ops.cpp).  When the
extension is missing -- a broken or skipped build -- the same schemas are defined here with
pure-torch reference implementations (they densify the weight: correct but slower and
O(out*in) memory), so ``import lightning_dynmo`` and every SparseLinear feature still work.
Per call, ``kernel_dtype`` (a pure function of device and dtype) picks the kernel, the kernel
run upcast to fp32 (half types it lacks, e.g. fp16 under CUDA autocast), or the reference path.
"""
from __future__ import annotations

import importlib
import json
import warnings
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

_PKG_DIR = Path(__file__).resolve().parent
_FIX = "rebuild with `pip install --no-build-isolation -e .` (add FORCE_CUDA=1 for the CUDA kernels)"


def _record_entry(module: str) -> dict:
    try:
        entry = json.loads((_PKG_DIR / "_build_record.json").read_text()).get(module)
    except (OSError, ValueError):
        return {}
    return entry if isinstance(entry, dict) else {}


def build_record(module: str) -> Optional[str]:
    """What the install recorded about building ``module`` (cpp/build.py writes
    ``_build_record.json`` beside the modules: built, skipped and why, or the build error)."""
    entry = _record_entry(module)
    return None if not entry or entry.get("built") else str(entry.get("why"))


class BuiltForAnotherTorch(ImportError):
    """The module was built against another torch release than this process runs: C++
    extensions are not ABI-compatible across releases. Loading one anyway can succeed and still
    be wrong: a module built on torch 2.13 loaded into 2.12 and registered its kernels under other
    dispatch keys (every call then failed with "Could not run 'ldsparse::...' with arguments
    from the 'CPU' backend"), so it is not loaded at all."""


def import_failure_cause(module: str, exc: BaseException) -> str:
    """One line naming why ``lightning_dynmo.sparse.<module>`` did not import, and the fix.

    ``from . import _C`` inside the still-initialising package turns a missing module into
    "cannot import name ... (most likely due to a circular import)"; the cause was almost always
    that the module had not been built, so it is told apart here.
    """
    built = sorted(p.name for p in _PKG_DIR.glob(f"{module}.*") if p.suffix in (".so", ".pyd"))
    text = str(exc)
    if isinstance(exc, BuiltForAnotherTorch):
        return f"{module} is built ({built[0] if built else module}) {text}; {_FIX}"
    if not built:
        recorded = build_record(module)
        at_install = f": the install says {recorded}" if recorded else ""
        return (f"{module} is not built (no {module}*.so in {_PKG_DIR}){at_install}; {_FIX}")
    if isinstance(exc, OSError) or "undefined symbol" in text or "cannot open shared object" in text:
        return (f"{module} is built ({built[0]}) but does not load, most likely a stale build against "
                f"another torch ({type(exc).__name__}: {text}); {_FIX}")
    if "circular import" in text or "partially initialized" in text:
        return (f"{module} is built ({built[0]}) but was imported while lightning_dynmo.sparse was still "
                f"initialising (a real circular import: {text})")
    return f"{module} is built ({built[0]}) but failed to import ({type(exc).__name__}: {text}); {_FIX}"


def _load(module: str):
    built_for = _record_entry(module).get("torch")
    if built_for and built_for != torch.__version__:
        return None, BuiltForAnotherTorch(f"against torch {built_for}, but this process runs torch {torch.__version__}")
    try:
        return importlib.import_module(f"{__package__}.{module}"), None
    except Exception as exc:  # ImportError, or OSError/undefined symbols from a stale build
        return None, exc


# _C_cpu defines the op schemas and the CPU kernels; _C_cuda registers the CUDA kernels on them
# (separate modules: a failed or skipped CUDA build keeps the CPU kernels).
_C, _EXT_ERROR = _load("_C_cpu")
_C_CUDA, _CUDA_ERROR = _load("_C_cuda") if _C is not None else (None, None)


def extension_available() -> bool:
    """True when the compiled kernels loaded (otherwise ops run the slow reference path)."""
    return _C is not None


def extension_error() -> Optional[BaseException]:
    """Why the compiled extension could not be imported (None when it was)."""
    return _EXT_ERROR


def cuda_kernels_available() -> bool:
    return _C is not None and _C_CUDA is not None


def cuda_kernels_missing_reason() -> Optional[str]:
    """Why CUDA tensors take the reference path (None when the CUDA kernels loaded)."""
    if cuda_kernels_available():
        return None
    if _C is None:
        return import_failure_cause("_C_cpu", _EXT_ERROR)
    return import_failure_cause("_C_cuda", _CUDA_ERROR)


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


_WARNED: set = set()


def warn_reference_on_cuda(what: str) -> None:
    """Warn once per ``what`` (a layer or op name) that CUDA tensors run the densifying
    reference path, naming the cause and the fix."""
    if what in _WARNED:
        return
    _WARNED.add(what)
    warnings.warn(f"lightning_dynmo.sparse: {what} runs on CUDA tensors through the densifying reference "
                  f"path (slower than dense, O(out*in) memory) because the CUDA kernels are missing: "
                  f"{cuda_kernels_missing_reason()}", RuntimeWarning, stacklevel=3)


if _C is None:
    warnings.warn(
        f"lightning_dynmo.sparse: compiled kernels unavailable: {import_failure_cause('_C_cpu', _EXT_ERROR)}. "
        "SparseLinear uses the pure-torch reference path, which is SLOWER than dense.",
        RuntimeWarning, stacklevel=2)
    _lib = torch.library.Library("ldsparse", "DEF")
    _lib.define("spmm(Tensor crow, Tensor col, Tensor values, Tensor x, Tensor? bias) -> Tensor")
    _lib.define("sddmm(Tensor crow, Tensor col, Tensor g, Tensor x) -> Tensor")
    _lib.define("csr_transpose(Tensor crow, Tensor col, int n_cols) -> (Tensor, Tensor, Tensor)")
    for _name, _fn in (("spmm", ref_spmm), ("sddmm", ref_sddmm), ("csr_transpose", ref_csr_transpose)):
        _lib.impl(_name, _fn, "CompositeExplicitAutograd")
elif _C_CUDA is None:
    # CPU-only build: CUDA tensors still work, through the reference path, which warns once.
    if torch.cuda.is_available():
        warnings.warn("lightning_dynmo.sparse: this is a GPU host but only the CPU kernels are built; "
                      f"sparse ops on CUDA tensors will densify (slow): {cuda_kernels_missing_reason()}",
                      RuntimeWarning, stacklevel=2)

    def _ref_cuda(name, fn):
        def run(*args):
            warn_reference_on_cuda(f"ldsparse.{name}")
            return fn(*args)
        return run

    _lib = torch.library.Library("ldsparse", "IMPL")
    _lib.impl("spmm", _ref_cuda("spmm", ref_spmm), "CUDA")
    _lib.impl("sddmm", _ref_cuda("sddmm", ref_sddmm), "CUDA")


# Dtypes each device's compiled kernels are instantiated for (cpp/csrc/sparse_cpu.cpp, cuda/).
KERNEL_DTYPES = {"cpu": (torch.float32, torch.float64), "cuda": (torch.float32, torch.bfloat16)}
_HALF = (torch.float16, torch.bfloat16)


def kernel_dtype(device_type: str, dtype: torch.dtype, kernels: dict) -> Optional[torch.dtype]:
    """The dtype to run the compiled kernel in for ``dtype`` inputs on ``device_type``, or None
    for the reference path; ``kernels`` maps device type -> kernel dtypes (what is built).

    A half type the device's kernel lacks (float16 on CUDA, both half types on CPU) runs upcast
    to float32 and is cast back: the upcast is exact and the kernels accumulate in float32 and
    round once, which is what a native half kernel does (the bf16 CUDA kernel included), and the
    cost stays O(nnz) where the reference path would densify the weight.  Anything else without
    a kernel (float64 on CUDA, a CPU-only build, no build) takes the exact reference path.
    """
    if device_type == "meta":
        return dtype  # shapes only: the ops' fake kernels take any dtype
    native = kernels.get(device_type, ())
    if dtype in native:
        return dtype
    if dtype in _HALF and torch.float32 in native:
        return torch.float32
    return None


def _built_kernels() -> dict:
    if _C is None:
        return {}
    return {d: KERNEL_DTYPES[d] for d in (("cpu", "cuda") if cuda_kernels_available() else ("cpu",))}


_KERNELS = _built_kernels()


def _route(x: Tensor, *others: Optional[Tensor]):
    """(kernel dtype or None, the inputs cast to it): one dispatch decision for spmm and sddmm."""
    dtype = kernel_dtype(x.device.type, x.dtype, _KERNELS)
    if dtype is None or dtype == x.dtype:
        return dtype, (x, *others)
    mixed = [t.dtype for t in others if t is not None and t.dtype != x.dtype]
    if mixed:  # casting would hide the mismatch the kernels reject
        raise TypeError(f"ldsparse: inputs must share x's dtype {x.dtype}, got {mixed}; cast them first")
    return dtype, tuple(t.to(dtype) if t is not None else None for t in (x, *others))


def spmm(crow: Tensor, col: Tensor, values: Tensor, x: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    dtype, (xk, vk, bk) = _route(x, values, bias)
    if dtype is None:
        return ref_spmm(crow, col, values, x, bias)
    return torch.ops.ldsparse.spmm(crow, col, vk, xk, bk).to(x.dtype)


def sddmm(crow: Tensor, col: Tensor, g: Tensor, x: Tensor) -> Tensor:
    dtype, (xk, gk) = _route(x, g)
    if dtype is None:
        return ref_sddmm(crow, col, g, x)
    return torch.ops.ldsparse.sddmm(crow, col, gk, xk).to(x.dtype)


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
