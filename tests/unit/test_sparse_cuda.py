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


# --------------------------------------------------------------------------- block-sparse attention
def _attn_case(b, h, t, d, bs, density, seed, empty_rows=0):
    from lightning_dynmo.sparse import BlockLayout
    gen = torch.Generator().manual_seed(seed)
    n = -(-t // bs)
    mask = (torch.rand(b, h, n, n, generator=gen) < density) | torch.eye(n, dtype=torch.bool)
    if empty_rows:
        mask[0, 0, torch.randperm(n, generator=gen)[:empty_rows]] = False
    layout = BlockLayout.from_block_mask(mask, bs, t)
    x = torch.randn(b, t, 3 * h * d, generator=gen)  # GPT-like strided q, k, v views
    return layout, x


def _check_attn_cuda(layout, x, h, d, dtype, tol, slot_token=None, token_mask=None):
    from lightning_dynmo.sparse import block_sparse_attention
    b, t = x.shape[:2]
    xc = x.to("cuda", dtype).requires_grad_()
    q, k, v = (z.view(b, t, h, d).transpose(1, 2) for z in xc.split(h * d, dim=2))
    out = block_sparse_attention(q, k, v, layout.to("cuda"), slot_token=slot_token)
    xr = x.double().cuda().requires_grad_()
    qr, kr, vr = (z.view(b, t, h, d).transpose(1, 2) for z in xr.split(h * d, dim=2))
    mask = (layout.token_mask() if token_mask is None else token_mask).cuda()
    ref = nn.functional.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask)
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).cuda()
    (gx,) = torch.autograd.grad(out, xc, g.to(dtype))
    (gr,) = torch.autograd.grad(ref, xr, g.double())
    torch.testing.assert_close(gx.double(), gr, atol=tol * 4, rtol=tol * 4)


@pytest.mark.cuda
@cuda
def test_attention_cuda_kernel_is_used():
    from lightning_dynmo.sparse import attention_kernel_available
    assert attention_kernel_available("cuda", torch.float32, 64)
    assert attention_kernel_available("cuda", torch.bfloat16, 16)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("b,h,t,d,bs,density,empty", [
    (1, 1, 16, 16, 16, 1.0, 0), (2, 3, 100, 24, 16, 0.4, 0), (1, 2, 257, 64, 64, 0.3, 0),
    (2, 2, 130, 5, 32, 0.6, 2), (1, 3, 300, 128, 128, 0.5, 1), (1, 2, 512, 80, 64, 0.25, 0),
    (3, 1, 33, 40, 32, 0.5, 1)])
def test_attention_cuda_matches_sdpa(dtype, tol, b, h, t, d, bs, density, empty):
    layout, x = _attn_case(b, h, t, d, bs, density, seed=t + d, empty_rows=empty)
    _check_attn_cuda(layout, x, h, d, dtype, tol)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_hash_sparse_attention_cuda(dtype, tol):
    from lightning_dynmo.sparse.hash_layout import draw_rotations, hash_buckets, hash_sort_plan
    b, h, t, d, nb, bs = 2, 4, 700, 64, 4, 32
    x = torch.randn(b, t, 3 * h * d, generator=torch.Generator().manual_seed(0))
    k = x[..., h * d:2 * h * d].reshape(b, t, h, d).transpose(1, 2)
    buckets = hash_buckets(k, draw_rotations(h, d, nb, torch.Generator().manual_seed(1)), nb)
    plan = hash_sort_plan(buckets.cuda(), nb, bs)
    same = buckets.unsqueeze(-1) == buckets.unsqueeze(-2)
    mask = same & torch.ones(t, t, dtype=torch.bool).tril()
    _check_attn_cuda(plan.layout, x, h, d, dtype, tol, slot_token=plan.slot_token, token_mask=mask)


@pytest.mark.cuda
@cuda
def test_attention_cuda_matches_cpu_kernel():
    from lightning_dynmo.sparse import block_sparse_attention
    layout, x = _attn_case(2, 4, 1000, 64, 64, 0.3, seed=5, empty_rows=2)
    q, k, v = (z.view(2, 1000, 4, 64).transpose(1, 2).contiguous() for z in x.split(256, dim=2))
    cpu = block_sparse_attention(q, k, v, layout)
    gpu = block_sparse_attention(q.cuda(), k.cuda(), v.cuda(), layout.to("cuda"))
    torch.testing.assert_close(gpu.cpu(), cpu, atol=2e-5, rtol=2e-5)
