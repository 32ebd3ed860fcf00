"""CUDA side of the sparse kernels: nvcc compile check (CPU CI) and an adversarial GPU plan
(empty rows, 1 nnz, odd sizes, strided/offset inputs, no bias, > 65535 token strips, fp16
autocast, CUDA graphs).  Memory and race checks: ``bash cpp/sanitize_cuda.sh`` on a GPU machine
(compute-sanitizer memcheck/racecheck/initcheck over these tests)."""
import os
import shutil
import subprocess

import pytest
import torch
from torch import nn

from lightning_dynmo import sparse
from lightning_dynmo.sparse import SparseLinear

from tests.support.sparse import half_tol, rounded_reference

SPMM_KERNELS = ["v1", "v2", "v3", "v4", "v5"]  # LDSPARSE_SPMM_KERNEL (v2-v5 fp32; bf16 runs v1)

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
@pytest.mark.parametrize("kernel", SPMM_KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,in_f,out_f,density", [(1, 64, 48, 0.3), (257, 96, 130, 0.1),
                                                        (1024, 768, 3072, 0.1), (64, 32, 16, 0.0)])
def test_cuda_matches_dense_masked(monkeypatch, kernel, dtype, tokens, in_f, out_f, density):
    """Forward and backward (the transposed SpMM for dx, SDDMM for dW) under every SpMM kernel."""
    monkeypatch.setenv("LDSPARSE_SPMM_KERNEL", kernel)
    gen = torch.Generator().manual_seed(tokens)
    mask = torch.rand(out_f, in_f, generator=gen) < density
    layer = SparseLinear.from_dense(nn.Linear(in_f, out_f), mask).to("cuda", dtype)
    x = torch.randn(tokens, in_f, generator=gen).to("cuda", dtype).requires_grad_()
    g = torch.randn(tokens, out_f, generator=gen).to("cuda", dtype)
    y = layer(x)
    y.backward(g)
    y_ref, dx_ref, dv_ref = rounded_reference(layer, x, g)
    torch.testing.assert_close(y.double(), y_ref, **half_tol(dtype, in_f))
    torch.testing.assert_close(x.grad.double(), dx_ref, **half_tol(dtype, out_f))
    torch.testing.assert_close(layer.values.grad.double(), dv_ref, **half_tol(dtype, tokens))


# --------------------------------------------------------------------------- adversarial GPU plan
# Each case also runs on the CPU kernels (here), which keeps the cases and references honest.
_DEVICES = ["cpu", pytest.param("cuda", marks=(pytest.mark.cuda, cuda))]


def _case_mask(case, gen):
    if case == "empty_rows":  # every other row empty, the last row full
        mask = torch.rand(21, 37, generator=gen) < 0.4
        mask[::2] = False
        mask[-1] = True
        return mask, 37
    if case == "all_empty":
        return torch.zeros(16, 24, dtype=torch.bool), 5
    if case == "one_nnz":
        mask = torch.zeros(9, 13, dtype=torch.bool)
        mask[8, 12] = True
        return mask, 1
    if case == "odd_unaligned":  # no size a multiple of the 4/8-wide vector loads
        return torch.rand(131, 67, generator=gen) < 0.2, 257
    if case == "one_row_one_col":
        return torch.ones(1, 1, dtype=torch.bool), 3
    raise ValueError(case)


def _layout(t, how):
    """The same values as a contiguous tensor, a strided view, or a view at storage offset 1."""
    if how == "strided":
        return torch.stack([t, torch.zeros_like(t)], -1)[..., 0]
    if how == "offset":
        return torch.cat([t.new_zeros(1), t.flatten()])[1:].view(t.shape)
    return t


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["empty_rows", "all_empty", "one_nnz", "odd_unaligned", "one_row_one_col"])
@pytest.mark.parametrize("how", ["contiguous", "strided", "offset"])
@pytest.mark.parametrize("bias", [True, False])
def test_ops_adversarial_inputs(device, dtype, case, how, bias):
    from lightning_dynmo.sparse import _ops
    from lightning_dynmo.sparse.linear import csr_pattern
    gen = torch.Generator().manual_seed(7)
    mask, tokens = _case_mask(case, gen)
    out_f, in_f = mask.shape
    w = (torch.randn(out_f, in_f, generator=gen) * mask).to(dtype).double()
    x = torch.randn(tokens, in_f, generator=gen).to(dtype).double()
    g = torch.randn(tokens, out_f, generator=gen).to(dtype).double()
    b = torch.randn(out_f, generator=gen).to(dtype).double() if bias else None
    crow, col = (t.to(device) for t in csr_pattern(mask))

    def dev(t):
        return None if t is None else _layout(t.to(device, dtype), how)

    y = _ops.spmm(crow, col, dev(w[mask]), dev(x), dev(b))
    y_ref = x @ w.t() + (b if bias else 0)
    assert y.dtype == dtype and y.is_contiguous()
    torch.testing.assert_close(y.cpu().double(), y_ref, **half_tol(dtype, in_f))
    out = _ops.sddmm(crow, col, dev(g), dev(x))
    torch.testing.assert_close(out.cpu().double(), (g.t() @ x)[mask], **half_tol(dtype, tokens))


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("dtype,tokens", [
    (torch.float32, 65535 * 32 + 33),      # odd: scalar path, one strip per 32 tokens
    (torch.bfloat16, 65535 * 256 + 256)])  # vector path (8 per lane), 2 strip rounds
def test_cuda_spmm_beyond_grid_y_limit(dtype, tokens):
    """Token strips past gridDim.y's 65535 are looped over, not dropped or rejected."""
    gen = torch.Generator().manual_seed(0)
    mask = torch.rand(6, 8, generator=gen) < 0.5
    layer = SparseLinear.from_dense(nn.Linear(8, 6), mask).to("cuda", dtype)
    x = torch.randn(tokens, 8, device="cuda").to(dtype)
    with torch.no_grad():
        y = layer(x)
        ref = nn.functional.linear(x.float(), layer.dense_weight().float(), layer.bias.float())
    torch.testing.assert_close(y.float(), ref, **half_tol(dtype, 8))


@pytest.mark.cuda
@cuda
def test_cuda_autocast_fp16_falls_back_to_fp32_kernel():
    """fp16 has no CUDA kernel: it runs upcast to fp32 (not an error), result in fp16."""
    gen = torch.Generator().manual_seed(4)
    mask = torch.rand(48, 80, generator=gen) < 0.2
    layer = SparseLinear.from_dense(nn.Linear(80, 48), mask).cuda()
    x = torch.randn(130, 80, generator=gen).cuda()
    with torch.autocast("cuda", dtype=torch.float16):
        y = layer(x)
    assert y.dtype == torch.float16
    y.float().sum().backward()
    assert layer.values.grad.dtype == torch.float32 and torch.isfinite(layer.values.grad).all()
    rounded = SparseLinear.from_dense(layer.to_dense(), layer.mask()).to(torch.float16)
    y_ref, _, _ = rounded_reference(rounded, x.half(), torch.ones(130, 48, device="cuda"))
    torch.testing.assert_close(y.double(), y_ref, **half_tol(torch.float16, 80))


@pytest.mark.cuda
@cuda
def test_cuda_ops_reject_mixed_devices_and_huge_token_counts():
    from lightning_dynmo.sparse.linear import csr_pattern
    crow, col = csr_pattern(torch.tensor([[1, 0], [1, 1]], dtype=torch.bool))
    vals, x = torch.randn(3, device="cuda"), torch.randn(4, 2, device="cuda")
    ops = torch.ops.ldsparse
    with pytest.raises(RuntimeError, match="crow_indices is on cpu but x is on cuda"):
        ops.spmm(crow, col, vals, x, None)
    with pytest.raises(RuntimeError, match="values is on cpu but x is on cuda"):
        ops.spmm(crow.cuda(), col.cuda(), vals.cpu(), x, None)
    with pytest.raises(RuntimeError, match="bias is on cpu but x is on cuda"):
        ops.spmm(crow.cuda(), col.cuda(), vals, x, torch.randn(2))
    with pytest.raises(RuntimeError, match="g is on cpu but x is on cuda"):
        ops.sddmm(crow.cuda(), col.cuda(), torch.randn(4, 2), x)
    huge = x[:1].expand(2**31, 2)  # 2^31 tokens as a stride-0 view: no memory
    with pytest.raises(RuntimeError, match="tokens = 2147483648 exceeds the kernels' int32 limit"):
        ops.spmm(crow.cuda(), col.cuda(), vals, huge, None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 only"):
        ops.spmm(crow.cuda(), col.cuda(), vals.half(), x.half(), None)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_capture_forward_and_backward(dtype):
    """spmm, sddmm and the transpose path are capturable (no host sync, no allocation outside
    the graph pool) and a replay recomputes from the new input."""
    gen = torch.Generator().manual_seed(5)
    mask = torch.rand(40, 72, generator=gen) < 0.25
    layer = SparseLinear.from_dense(nn.Linear(72, 40), mask).to("cuda", dtype)
    x = torch.randn(50, 72, generator=gen).to("cuda", dtype).requires_grad_()
    graphed = torch.cuda.make_graphed_callables(layer, (x,))
    for seed in (1, 2):
        xs = torch.randn(50, 72, generator=torch.Generator().manual_seed(seed)).to("cuda", dtype)
        xs.requires_grad_()
        # set_to_none: the first backward hands .grad the graph's static gradient buffer (autograd
        # steals it), so zeroing in place and accumulating would add that buffer to itself on the
        # next replay (2x gradients, seen on an H200) -- torch's graphed-callable rule, not ours
        layer.zero_grad(set_to_none=True)
        y = graphed(xs)
        g = torch.ones_like(y)
        y.backward(g)
        y_ref, dx_ref, dv_ref = rounded_reference(layer, xs, g)
        torch.testing.assert_close(y.double(), y_ref, **half_tol(dtype, 72))
        torch.testing.assert_close(xs.grad.double(), dx_ref, **half_tol(dtype, 40))
        torch.testing.assert_close(layer.values.grad.double(), dv_ref, **half_tol(dtype, 50))


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


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("kernel", SPMM_KERNELS)
@pytest.mark.parametrize("tokens,in_f,out_f,density", [
    (1, 1, 1, 1.0), (127, 33, 129, 0.5), (129, 64, 255, 1.0), (300, 4096, 130, 0.02),
    (1000, 97, 1000, 0.3), (257, 31, 7, 0.0), (255, 65, 63, 1.0), (513, 96, 65, 0.7), (129, 40, 257, 0.6)])
def test_cuda_spmm_kernels_match_the_dense_product(monkeypatch, kernel, tokens, in_f, out_f, density):
    """Every SpMM kernel (LDSPARSE_SPMM_KERNEL; v2 and v3 are fp32-only, bf16 stays on v1)
    against the dense product: tile edges in rows (64, 128, 256), tokens (128 / 256) and
    columns (32-column chunks), dense chunks (a full entry buffer), empty rows, several token tiles."""
    monkeypatch.setenv("LDSPARSE_SPMM_KERNEL", kernel)
    from lightning_dynmo.sparse.linear import csr_pattern
    gen = torch.Generator().manual_seed(in_f * 7 + out_f)
    mask = torch.rand(out_f, in_f, generator=gen) < density
    w = torch.randn(out_f, in_f, generator=gen) * mask
    x = torch.randn(tokens, in_f, generator=gen)
    b = torch.randn(out_f, generator=gen)
    crow, col = (t.cuda() for t in csr_pattern(mask))
    y = torch.ops.ldsparse.spmm(crow, col, w[mask].cuda(), x.cuda(), b.cuda())
    ref = x.double() @ w.double().t() + b.double()
    torch.testing.assert_close(y.cpu().double(), ref, **half_tol(torch.float32, in_f))


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("kernel", SPMM_KERNELS)
def test_cuda_spmm_without_input_features_is_the_bias(monkeypatch, kernel):
    monkeypatch.setenv("LDSPARSE_SPMM_KERNEL", kernel)
    crow, col = torch.zeros(4, dtype=torch.int32, device="cuda"), torch.zeros(0, dtype=torch.int32, device="cuda")
    b = torch.randn(3, device="cuda")
    y = torch.ops.ldsparse.spmm(crow, col, torch.zeros(0, device="cuda"), torch.zeros(5, 0, device="cuda"), b)
    torch.testing.assert_close(y, b.expand(5, 3))


@pytest.mark.cuda
@cuda
def test_cuda_spmm_rejects_an_unknown_kernel_name(monkeypatch):
    monkeypatch.setenv("LDSPARSE_SPMM_KERNEL", "v6")
    crow, col = torch.tensor([0, 1], dtype=torch.int32, device="cuda"), torch.zeros(1, dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="LDSPARSE_SPMM_KERNEL must be one of v1, v2, v3, v4, v5"):
        torch.ops.ldsparse.spmm(crow, col, torch.ones(1, device="cuda"), torch.ones(2, 1, device="cuda"), None)
