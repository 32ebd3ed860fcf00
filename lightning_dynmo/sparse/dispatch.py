"""Dense-or-sparse choice per layer, from the crossover density measured on this device.

Pruning must never slow a layer down, so the choice is measured rather than assumed: the
first request for a (device, threads, shape bucket) times dense vs SparseLinear
forward+backward at decreasing densities, and caches the density below which sparse wins.
Set ``LDSPARSE_CROSSOVER=<density>`` to skip the measurement (e.g. in CI).

:func:`choose_linear_kernel` widens the choice to dense, 2:4 semi-structured (torch's tensor-core
kernels, :mod:`.semi_structured`) and CSR, per (device type, dtype, token bucket, shape bucket),
again by measurement; ``LDSPARSE_KERNEL=dense|2:4|csr`` overrides it where that kernel can run.
The choice is local to a process: callers whose replicas must compute alike agree on it with one
collective (``GradualPruning`` broadcasts the data-parallel group's first rank's choice).
"""
from __future__ import annotations

import os
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor, nn

from . import _ops
from .backend_choice import median_ms
from .linear import MaskedLinear, SparseLinear
from .semi_structured import SemiStructuredCache, semi_structured_linear, semi_structured_unavailable

#: the kernels a pruned linear layer can run with (their index is the code replicas agree on)
LINEAR_KERNELS = ("dense", "2:4", "csr")
_KERNEL_CACHE: Dict[Tuple, float] = {}

_DENSITIES = (0.5, 0.35, 0.25, 0.18, 0.12, 0.08, 0.05, 0.02, 0.01)
_CACHE: Dict[Tuple, float] = {}


def _bucket(n: int) -> int:
    """Next power of two: nearby shapes share one measurement."""
    return 1 << max(0, int(n) - 1).bit_length()


def _time(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` (one measurement routine for every measured choice)."""
    return median_ms(fn, device, repeats) / 1e3


def _fwd_bwd(layer: nn.Module, x: Tensor):
    def run():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x).sum().backward()
    return run


def _measure(in_f: int, out_f: int, tokens: int, device: torch.device, repeats: int = 3) -> float:
    gen = torch.Generator(device="cpu").manual_seed(0)
    dense = nn.Linear(in_f, out_f).to(device)
    x = torch.randn(tokens, in_f, generator=gen).to(device).requires_grad_()
    t_dense = _time(_fwd_bwd(dense, x), device, repeats)
    prev: Optional[Tuple[float, float]] = None
    for d in _DENSITIES:
        mask = (torch.rand(out_f, in_f, generator=gen) < d).to(device)
        t_sparse = _time(_fwd_bwd(SparseLinear.from_dense(dense, mask), x), device, repeats)
        if t_sparse < t_dense:
            if prev is None:
                return d
            # Sparse time is ~linear in density: interpolate to where it meets dense.
            d_hi, t_hi = prev
            return d + (d_hi - d) * (t_dense - t_sparse) / max(t_hi - t_sparse, 1e-12)
        prev = (d, t_sparse)
    return 0.0


def crossover_density(in_features: int, out_features: int, tokens: int = 2048,
                      device=None) -> float:
    """Density below which SparseLinear's forward+backward beats dense on ``device``
    (0.0: never).  Autotuned once per (device, threads, power-of-two shape bucket)."""
    override = os.environ.get("LDSPARSE_CROSSOVER", "").strip()
    if override:
        return float(override)
    device = torch.device(device if device is not None else "cpu")
    if not _ops.extension_available():
        return 0.0  # the reference path densifies: never faster than dense
    # Past ~1k tokens the ratio barely moves (both sides scale linearly): cap the probe cost.
    probe_tokens = max(1, min(tokens, 1024))
    key = (device.type, device.index, torch.get_num_threads(), _bucket(in_features),
           _bucket(out_features), _bucket(probe_tokens))
    if key not in _CACHE:  # the first shape seen in a bucket is measured for all of it
        with torch.enable_grad():
            _CACHE[key] = _measure(in_features, out_features, probe_tokens, device)
    return _CACHE[key]


def maybe_sparsify(linear: nn.Linear, mask: Tensor, tokens: int = 2048) -> nn.Module:
    """SparseLinear if it is faster than dense at this mask's density, else MaskedLinear."""
    if isinstance(linear, (SparseLinear, MaskedLinear)):
        linear = linear.to_dense()
    density = float(mask.float().mean())
    threshold = crossover_density(linear.in_features, linear.out_features, tokens,
                                  linear.weight.device)
    if density < threshold:
        return SparseLinear.from_dense(linear, mask)
    return MaskedLinear.from_dense(linear, mask)


def linear_kernel_candidates(in_features: int, out_features: int, device, dtype: torch.dtype, density: float,
                             two_four: bool) -> list:
    """The kernels that can run this layer here: dense always; ``"2:4"`` where torch's
    semi-structured kernels take the device, dtype and shape and the mask (``two_four``) is 2:4;
    ``"csr"`` where the extension is built and the layer is pruned at all (its crossover is
    measured in fp32; a dense-stored layer runs the kernel in fp32/fp64 only)."""
    device = torch.device(device)
    out = ["dense"]
    if two_four and semi_structured_unavailable(device, dtype, out_features, in_features) is None:
        out.append("2:4")
    if density < 1.0 and _ops.extension_available():
        out.append("csr")
    return out


def _measure_2to4(in_f: int, out_f: int, tokens: int, device: torch.device, dtype: torch.dtype,
                  repeats: int = 5) -> float:
    """Dense time / 2:4 time, forward+backward (> 1: 2:4 is faster). The 2:4 side compresses its
    weight on every call, as training does once per optimizer step."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    weight = torch.randn(out_f, in_f, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    mask = (torch.rand(out_f, in_f // 4, 4, generator=gen).argsort(-1) < 2).reshape(out_f, in_f).to(device)
    x = torch.randn(tokens, in_f, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    cache = SemiStructuredCache()

    def dense():
        weight.grad = x.grad = None
        torch.nn.functional.linear(x, weight).sum().backward()

    def two_four():
        weight.grad = x.grad = None
        cache.key = None  # an optimizer step changed the weight: compress again
        semi_structured_linear(x, weight, mask, None, cache).sum().backward()

    t_dense = _time(dense, device, repeats)
    t_sparse = _time(two_four, device, repeats)
    return t_dense / max(t_sparse, 1e-12)


def choose_linear_kernel(in_features: int, out_features: int, tokens: int, device, dtype: torch.dtype,
                         density: float, two_four: bool = False) -> str:
    """The fastest of :data:`LINEAR_KERNELS` for a pruned layer of this shape and ``density``
    computing ``tokens`` rows in ``dtype`` on ``device``: 2:4 when its measured forward+backward
    beats dense, else CSR below the measured crossover density, else dense. Measured once per
    (device, dtype, power-of-two shape and token bucket); ``LDSPARSE_KERNEL`` overrides (a kernel
    that cannot run here falls back to dense)."""
    device = torch.device(device)
    candidates = linear_kernel_candidates(in_features, out_features, device, dtype, density, two_four)
    override = os.environ.get("LDSPARSE_KERNEL", "").strip()
    if override:
        if override not in LINEAR_KERNELS:
            raise ValueError(f"LDSPARSE_KERNEL must be one of {LINEAR_KERNELS}, got {override!r}")
        return override if override in candidates else "dense"
    if "2:4" in candidates:
        key = (device.type, device.index, dtype, _bucket(in_features), _bucket(out_features), _bucket(tokens))
        if key not in _KERNEL_CACHE:
            with torch.enable_grad():
                _KERNEL_CACHE[key] = _measure_2to4(in_features, out_features, max(1, min(tokens, 8192)),
                                                   device, dtype)
        if _KERNEL_CACHE[key] > 1.0:
            return "2:4"
    if "csr" in candidates and density < crossover_density(in_features, out_features, tokens, device):
        return "csr"
    return "dense"
