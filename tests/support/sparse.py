"""Shared by the sparse-kernel tests: the fp64 reference and tolerance that half-precision kernels
are held to, and a fresh interpreter in which the CPU extension cannot be imported."""
from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager

import pytest
import torch
from torch import nn


def half_tol(dtype: torch.dtype, k: int) -> dict[str, float]:
    """Kernels accumulate in fp32 and round once to ``dtype``: one ulp of ``dtype`` relative plus
    fp32 accumulation error over ``k`` terms (a bf16-accumulating kernel misses this by ~100x)."""
    return dict(rtol=max(torch.finfo(dtype).eps, 1e-5), atol=1e-6 * k)


def rounded_reference(layer, x: torch.Tensor, g: torch.Tensor):
    """y, dx, dvalues in fp64 from the inputs as the kernels see them (rounded to their dtype),
    so the comparison measures the kernels' accumulation, not the inputs' rounding."""
    w = layer.dense_weight().double().requires_grad_()
    xr = x.detach().double().requires_grad_()
    y = nn.functional.linear(xr, w, None if layer.bias is None else layer.bias.detach().double())
    y.backward(g.double())
    return y, xr.grad, w.grad[layer.mask()]


_BLOCK_CPU_EXTENSION = (
    "import sys, importlib.abc, warnings\n"
    "class Block(importlib.abc.MetaPathFinder):\n"
    "    def find_spec(self, name, path, target=None):\n"
    "        if name == 'lightning_dynmo.sparse._C_cpu': raise ImportError('blocked for test')\n"
    "sys.meta_path.insert(0, Block())\n")


def run_without_extension(code: str) -> None:
    """Run ``code`` in a fresh interpreter where ``lightning_dynmo.sparse._C_cpu`` fails to import
    (a broken build), without ``LDSPARSE_CROSSOVER``; a failure shows the child's stderr."""
    env = {k: v for k, v in os.environ.items() if k != "LDSPARSE_CROSSOVER"}
    proc = subprocess.run([sys.executable, "-c", _BLOCK_CPU_EXTENSION + code], capture_output=True, text=True,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]


@contextmanager
def cpu_isa(isa: str):
    """The CPU kernels dispatched to ``isa`` ("default": SSE2, "avx2") inside the block, the widest
    the CPU has again after it; skips the test where the CPU lacks ``isa``."""
    from lightning_dynmo.sparse import _ops

    widest = _ops._C.cpu_isa()
    if not _ops._C.set_cpu_isa(isa):
        pytest.skip(f"CPU lacks {isa}")
    try:
        assert _ops._C.cpu_isa() == isa
        yield
    finally:
        _ops._C.set_cpu_isa(widest)
