"""CUDA side of the sparse kernels: nvcc compile check (CPU CI) and GPU correctness."""
import os
import shutil
import subprocess

import pytest
import torch
from torch import nn

from lightning_dynmo import sparse
from lightning_dynmo.sparse import SparseLinear

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "cpp", "check_cuda_compile.sh")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")
def test_cuda_kernels_compile_with_nvcc():
    proc = subprocess.run(["bash", SCRIPT], capture_output=True, text=True,
                          env=dict(os.environ, CUDA_ARCHS="90"))
    assert proc.returncode == 0, proc.stdout + proc.stderr


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")


@pytest.mark.cuda
@cuda
def test_cuda_kernels_are_compiled():
    assert sparse.cuda_kernels_available()


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("tokens,in_f,out_f,density", [(1, 64, 48, 0.3), (257, 96, 130, 0.1),
                                                        (1024, 768, 3072, 0.1), (64, 32, 16, 0.0)])
def test_cuda_matches_dense_masked(dtype, tol, tokens, in_f, out_f, density):
    gen = torch.Generator().manual_seed(tokens)
    dense = nn.Linear(in_f, out_f)
    mask = torch.rand(out_f, in_f, generator=gen) < density
    layer = SparseLinear.from_dense(dense, mask).to("cuda", dtype)
    x = torch.randn(tokens, in_f, generator=gen).to("cuda", dtype).requires_grad_()
    x_ref = x.detach().float().requires_grad_()
    w_ref = (dense.weight.detach() * mask).cuda().requires_grad_()
    y = layer(x)
    y_ref = nn.functional.linear(x_ref, w_ref, dense.bias.detach().cuda())
    torch.testing.assert_close(y.float(), y_ref, atol=tol * 10, rtol=tol)
    g = torch.randn(y.shape, generator=gen).cuda()
    y.backward(g.to(dtype))
    y_ref.backward(g)
    torch.testing.assert_close(x.grad.float(), x_ref.grad, atol=tol * 10, rtol=tol)
    torch.testing.assert_close(layer.values.grad.float(), w_ref.grad[mask.cuda()], atol=tol * 10 * tokens ** 0.5, rtol=tol)
