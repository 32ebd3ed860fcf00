"""SparseLinear / ldsparse kernels agree with the dense masked computation (CPU)."""
import os

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from lightning_dynmo import sparse
from lightning_dynmo.sparse import MaskedLinear, SparseLinear, _ops

from tests.support.sparse import cpu_isa, half_tol, rounded_reference, run_without_extension


def _mask(out_f, in_f, density, gen, empty_rows=True):
    mask = torch.rand(out_f, in_f, generator=gen) < density
    if empty_rows and out_f > 2:
        mask[out_f // 2] = False
    return mask


def _check_layer(lead, in_f, out_f, density, bias, seed, atol=1e-4):
    gen = torch.Generator().manual_seed(seed)
    dense = nn.Linear(in_f, out_f, bias=bias)
    mask = _mask(out_f, in_f, density, gen)
    layer = SparseLinear.from_dense(dense, mask)
    x = torch.randn(*lead, in_f, generator=gen, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    w_ref = (dense.weight.detach() * mask).requires_grad_()
    b_ref = dense.bias.detach().clone().requires_grad_() if bias else None
    y = layer(x)
    y_ref = nn.functional.linear(x_ref, w_ref, b_ref)
    assert y.shape == (*lead, out_f)
    torch.testing.assert_close(y, y_ref, atol=atol, rtol=1e-4)
    g = torch.randn(y.shape, generator=gen)
    y.backward(g)
    y_ref.backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad, atol=atol, rtol=1e-4)
    torch.testing.assert_close(layer.values.grad, w_ref.grad[mask], atol=atol, rtol=1e-4)
    if bias:
        torch.testing.assert_close(layer.bias.grad, b_ref.grad, atol=atol, rtol=1e-4)


def test_extension_built():
    if os.environ.get("LDSPARSE_REQUIRE_EXT", "1") == "0":
        pytest.skip("LDSPARSE_REQUIRE_EXT=0")
    assert sparse.extension_available(), f"extension failed to import: {sparse.extension_error()!r}"


@settings(max_examples=40, deadline=None)
@given(lead=st.lists(st.integers(0, 9), min_size=0, max_size=2), in_f=st.integers(1, 70),
       out_f=st.integers(1, 70), density=st.sampled_from([0.0, 0.05, 0.3, 1.0]),
       bias=st.booleans(), seed=st.integers(0, 2**16))
def test_matches_dense_masked(lead, in_f, out_f, density, bias, seed):
    _check_layer(tuple(lead), in_f, out_f, density, bias, seed)


@pytest.mark.parametrize("tokens,in_f,out_f,density", [
    (1, 300, 257, 0.1),       # decode step: one token, rows split across chunks
    (300, 129, 65, 0.2),      # several token tiles plus a ragged one
    (2 * 128 + 3, 40, 700, 0.5),
    (64, 33, 19, 0.0),        # all-zero matrix
])
def test_matches_dense_masked_larger(tokens, in_f, out_f, density):
    _check_layer((tokens,), in_f, out_f, density, True, seed=tokens)


def test_skewed_rows():
    """One dense row among empty ones: the nnz-balanced row split must still be right."""
    mask = torch.zeros(64, 96, dtype=torch.bool)
    mask[5] = True
    mask[60, ::7] = True
    dense = nn.Linear(96, 64)
    layer = SparseLinear.from_dense(dense, mask)
    x = torch.randn(3, 100, 96)
    torch.testing.assert_close(layer(x), nn.functional.linear(x, dense.weight * mask, dense.bias),
                               atol=1e-4, rtol=1e-4)


def test_gradcheck_float64():
    gen = torch.Generator().manual_seed(0)
    layer = SparseLinear.from_dense(nn.Linear(13, 11), _mask(11, 13, 0.4, gen)).double()
    assert layer.crow_indices.dtype == torch.int32  # .double() must leave indices alone
    x = torch.randn(2, 7, 13, dtype=torch.float64, generator=gen, requires_grad=True)

    def f(x, values, bias):
        return _ops.sparse_linear(x.reshape(-1, 13), values, bias, layer.crow_indices,
                                  layer.col_indices, layer.crow_indices_t, layer.col_indices_t,
                                  layer.perm_t)

    assert torch.autograd.gradcheck(f, (x, layer.values, layer.bias))


@pytest.mark.skipif(not sparse.extension_available(), reason="needs the compiled extension")
def test_kernels_match_dense_torch():
    """The compiled ops against plain dense torch and torch's own CSR conversion (not against the
    package's ``ref_*`` fallbacks, which are what the ops become without the extension)."""
    gen = torch.Generator().manual_seed(1)
    mask = _mask(50, 70, 0.2, gen)
    w = torch.randn(50, 70, generator=gen) * mask
    csr = w.to_sparse_csr()
    crow, col, vals = csr.crow_indices().int(), csr.col_indices().int(), csr.values()
    x, g, b = torch.randn(90, 70, generator=gen), torch.randn(90, 50, generator=gen), torch.randn(50)
    ops = torch.ops.ldsparse
    torch.testing.assert_close(ops.spmm(crow, col, vals, x, b), x @ w.t() + b, atol=1e-4, rtol=1e-4)
    rows, cols = mask.nonzero(as_tuple=True)  # row-major: the CSR order of the values
    torch.testing.assert_close(ops.sddmm(crow, col, g, x), (g.t() @ x)[rows, cols], atol=1e-4, rtol=1e-4)
    crow_t, col_t, perm = ops.csr_transpose(crow, col, 70)
    wt = w.t().contiguous().to_sparse_csr()
    assert torch.equal(crow_t, wt.crow_indices().int()) and torch.equal(col_t, wt.col_indices().int())
    assert torch.equal(vals[perm.long()], wt.values())  # values_t = values[perm]


def test_module_state_is_compressed_and_movable():
    dense = nn.Linear(64, 32)
    mask = torch.rand(32, 64) < 0.1
    layer = SparseLinear.from_dense(dense, mask)
    params = dict(layer.named_parameters())
    assert set(params) == {"values", "bias"} and params["values"].shape == (int(mask.sum()),)
    assert set(dict(layer.named_buffers())) == {"crow_indices", "col_indices", "crow_indices_t",
                                                "col_indices_t", "perm_t"}
    assert all(b.dtype == torch.int32 for b in layer.buffers())
    assert all(t.numel() < 64 * 32 for t in layer.state_dict().values())
    back = layer.to_dense()
    assert isinstance(back, nn.Linear)
    torch.testing.assert_close(back.weight, dense.weight * mask)
    # A checkpoint with another pattern loads into a freshly built layer.
    other = SparseLinear(64, 32)
    other.load_state_dict(layer.state_dict())
    x = torch.randn(5, 64)
    torch.testing.assert_close(other(x), layer(x))


def test_generic_migration_by_names():
    """What the pipeline's layer migration does: meta skeleton, to_empty, copy by name."""
    import copy
    src = SparseLinear.from_dense(nn.Linear(48, 24), torch.rand(24, 48) < 0.2)
    memo = {id(t): (nn.Parameter(torch.empty_like(t, device="meta")) if isinstance(t, nn.Parameter)
                    else torch.empty_like(t, device="meta"))
            for t in list(src.parameters()) + list(src.buffers())}
    dst = copy.deepcopy(src, memo).to_empty(device="cpu")
    params, buffers = dict(dst.named_parameters()), dict(dst.named_buffers())
    for name, p in src.named_parameters():
        params[name].data.copy_(p)
    for name, b in src.named_buffers():
        buffers[name].copy_(b)
    x = torch.randn(7, 48)
    torch.testing.assert_close(dst(x), src(x))


def test_adam_state_is_nnz_sized_and_pattern_is_kept():
    dense = nn.Linear(40, 30)
    mask = torch.rand(30, 40) < 0.2
    layer = SparseLinear.from_dense(dense, mask)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        layer(torch.randn(8, 40)).pow(2).mean().backward()
        opt.step()
    assert opt.state[layer.values]["exp_avg"].shape == (int(mask.sum()),)
    assert torch.all(layer.to_dense().weight[~mask] == 0)


def test_masked_linear_keeps_pruned_weights_zero():
    dense = nn.Linear(20, 10)
    mask = torch.rand(10, 20) < 0.5
    layer = MaskedLinear.from_dense(dense, mask)
    layer(torch.randn(4, 20)).sum().backward()
    assert torch.all(layer.weight.grad[~mask] == 0)
    torch.testing.assert_close(layer.to_dense().weight, dense.weight * mask)


def test_maybe_sparsify_follows_crossover(monkeypatch):
    monkeypatch.setenv("LDSPARSE_CROSSOVER", "0.5")
    dense = nn.Linear(32, 16)
    assert isinstance(sparse.maybe_sparsify(dense, torch.rand(16, 32) < 0.1), SparseLinear)
    assert isinstance(sparse.maybe_sparsify(dense, torch.rand(16, 32) < 0.9), MaskedLinear)


def test_crossover_density_autotunes_and_caches(monkeypatch):
    monkeypatch.delenv("LDSPARSE_CROSSOVER", raising=False)
    d = sparse.crossover_density(64, 64, tokens=64)
    assert 0.0 <= d <= 1.0
    assert sparse.crossover_density(60, 50, tokens=40) == d  # same power-of-two bucket: cached


def test_torch_compile_forward_backward():
    dense = nn.Linear(24, 12)
    mask = torch.rand(12, 24) < 0.3
    layer = SparseLinear.from_dense(dense, mask)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 5, 24, requires_grad=True)
    compiled(x).sum().backward()
    grad_compiled = layer.values.grad.clone()
    layer.values.grad = None
    layer(x).sum().backward()
    torch.testing.assert_close(grad_compiled, layer.values.grad)


@pytest.mark.skipif(not sparse.extension_available(), reason="needs the compiled extension")
@pytest.mark.parametrize("isa", ["default", "avx2"])
def test_narrower_isa_builds_agree(isa):
    """The run-time ISA dispatch: the SSE2/AVX2 builds give the same answers."""
    with cpu_isa(isa):
        _check_layer((130,), 70, 50, 0.3, True, seed=3)
        _check_layer((3, 5), 33, 20, 0.5, False, seed=4)
        test_gradcheck_float64()


def test_package_works_without_extension():
    """A broken build must not break the package: ops fall back to the reference path."""
    run_without_extension(
        "import torch; from torch import nn\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    from lightning_dynmo import sparse\n"
        "assert not sparse.extension_available() and any('SLOWER' in str(x.message) for x in w)\n"
        "assert sparse.crossover_density(64, 64, 64) == 0.0\n"
        "torch.manual_seed(0); d = nn.Linear(30, 20); m = torch.rand(20, 30) < 0.3\n"
        "l = sparse.SparseLinear.from_dense(d, m); x = torch.randn(2, 9, 30, requires_grad=True)\n"
        "y = l(x); y.sum().backward()\n"
        "torch.testing.assert_close(y, nn.functional.linear(x, d.weight * m, d.bias))\n"
        "torch.testing.assert_close(l.values.grad, x.reshape(-1, 30).sum(0).expand(20, 30)[m])\n"
        "assert isinstance(sparse.maybe_sparsify(d, m), sparse.MaskedLinear)\n")


# --------------------------------------------------------------------------- kernel dispatch
F32, F64, BF16, F16 = torch.float32, torch.float64, torch.bfloat16, torch.float16
_FULL = {"cpu": _ops.KERNEL_DTYPES["cpu"], "cuda": _ops.KERNEL_DTYPES["cuda"]}
_CPU_ONLY = {"cpu": _ops.KERNEL_DTYPES["cpu"]}


@pytest.mark.parametrize("kernels,device,dtype,expected", [
    (_FULL, "cuda", F32, F32), (_FULL, "cuda", BF16, BF16),
    (_FULL, "cuda", F16, F32),       # autocast fp16: upcast, not the fp32/bf16 kernel's error
    (_FULL, "cuda", F64, None),      # no fp64 CUDA kernel: exact reference path
    (_FULL, "cpu", F32, F32), (_FULL, "cpu", F64, F64),
    (_FULL, "cpu", BF16, F32), (_FULL, "cpu", F16, F32),
    (_CPU_ONLY, "cuda", F16, None), (_CPU_ONLY, "cuda", F32, None),  # CPU-only build on a GPU
    ({}, "cpu", F32, None), ({}, "cpu", BF16, None),                  # no build at all
    (_FULL, "mps", F32, None), (_FULL, "meta", F16, F16)])
def test_kernel_dtype_routes_every_device_and_dtype(kernels, device, dtype, expected):
    assert _ops.kernel_dtype(device, dtype, kernels) == expected


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_half_types_run_upcast_on_cpu(dtype):
    gen = torch.Generator().manual_seed(2)
    layer = SparseLinear.from_dense(nn.Linear(70, 50), _mask(50, 70, 0.3, gen)).to(dtype)
    x = torch.randn(33, 70, generator=gen).to(dtype).requires_grad_()
    g = torch.randn(33, 50, generator=gen).to(dtype)
    y = layer(x)
    y.backward(g)
    assert y.dtype == x.grad.dtype == layer.values.grad.dtype == dtype
    y_ref, dx_ref, dv_ref = rounded_reference(layer, x, g)
    torch.testing.assert_close(y.double(), y_ref, **half_tol(dtype, 70))
    torch.testing.assert_close(x.grad.double(), dx_ref, **half_tol(dtype, 50))
    torch.testing.assert_close(layer.values.grad.double(), dv_ref, **half_tol(dtype, 33))


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_autocast_cpu_matches_rounded_reference(dtype):
    gen = torch.Generator().manual_seed(3)
    layer = SparseLinear.from_dense(nn.Linear(40, 24), _mask(24, 40, 0.3, gen))
    x = torch.randn(9, 40, generator=gen)
    with torch.autocast("cpu", dtype=dtype):
        y = layer(x)
    assert y.dtype == dtype
    y.float().sum().backward()
    assert layer.values.grad.dtype == torch.float32
    rounded = SparseLinear.from_dense(layer.to_dense(), layer.mask()).to(dtype)
    y_ref, _, _ = rounded_reference(rounded, x.to(dtype), torch.ones(9, 24))
    torch.testing.assert_close(y.double(), y_ref, **half_tol(dtype, 40))


def test_upcast_refuses_mixed_dtypes():
    layer = SparseLinear.from_dense(nn.Linear(6, 4), torch.rand(4, 6) < 0.5)
    with pytest.raises(TypeError, match="share x's dtype"):
        _ops.spmm(layer.crow_indices, layer.col_indices, layer.values.detach(), torch.randn(3, 6, dtype=BF16))


# --------------------------------------------------------------------------- bad input to the ops
_ON_CUDA = pytest.param("cuda", marks=(pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available() or not sparse.cuda_kernels_available(), reason="no CUDA kernels")))


def _op_inputs(device):
    """Valid spmm/sddmm inputs: 4 rows (one empty) x 3 columns, 5 tokens."""
    mask = torch.tensor([[1, 0, 1], [0, 0, 0], [0, 1, 0], [1, 1, 1]], dtype=torch.bool)
    crow, col = sparse.linear.csr_pattern(mask)
    t = dict(crow=crow, col=col, values=torch.randn(6), x=torch.randn(5, 3), bias=torch.randn(4),
             g=torch.randn(5, 4))
    return {k: v.to(device) for k, v in t.items()}


def _huge_rows(t):  # 2^31 + 1 rows without the memory: a stride-0 view
    return t["crow"][:1].expand(2**31 + 2)


_SPMM_BAD = [  # (input replaced, how, message), all must fail before any kernel runs
    ("values", lambda t: t["values"][:-1], "one entry per non-zero"),
    ("values", lambda t: t["values"].view(2, 3), "one entry per non-zero"),
    ("values", lambda t: t["values"].double(), "values dtype Double differs from x dtype Float"),
    ("x", lambda t: t["x"][0], "x must be 2-D"),
    ("bias", lambda t: t["bias"][:-1], r"one entry per output row \(4\)"),
    ("bias", lambda t: t["bias"].view(2, 2), r"one entry per output row \(4\)"),
    ("bias", lambda t: t["bias"].double(), "bias dtype Double differs"),
    ("crow", lambda t: t["crow"].long(), "must be int32"),
    ("crow", lambda t: t["crow"][:0], r"rows \+ 1 entries"),
    ("col", lambda t: t["col"].view(2, 3), "col_indices must be 1-D"),
    ("crow", _huge_rows, "rows = 2147483649 exceeds the kernels' int32 limit"),
]
_SDDMM_BAD = [
    ("g", lambda t: t["g"][:-1], "g has 4 tokens but x has 5"),
    ("g", lambda t: t["g"][:, :-1], "g has 3 columns but the pattern has 4 rows"),
    ("g", lambda t: t["g"][0], "must be 2-D"),
    ("g", lambda t: t["g"].double(), "g dtype Double differs"),
    ("col", lambda t: t["col"].short(), "must be int32"),
    ("crow", _huge_rows, "exceeds the kernels' int32 limit"),
]


@pytest.mark.parametrize("device", ["cpu", _ON_CUDA])
@pytest.mark.parametrize("name,bad,match", _SPMM_BAD)
def test_spmm_rejects_bad_input(device, name, bad, match):
    t = _op_inputs(device)
    torch.ops.ldsparse.spmm(t["crow"], t["col"], t["values"], t["x"], t["bias"])  # valid as given
    t[name] = bad(t)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.ldsparse.spmm(t["crow"], t["col"], t["values"], t["x"], t["bias"])


@pytest.mark.parametrize("device", ["cpu", _ON_CUDA])
@pytest.mark.parametrize("name,bad,match", _SDDMM_BAD)
def test_sddmm_rejects_bad_input(device, name, bad, match):
    t = _op_inputs(device)
    torch.ops.ldsparse.sddmm(t["crow"], t["col"], t["g"], t["x"])
    t[name] = bad(t)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.ldsparse.sddmm(t["crow"], t["col"], t["g"], t["x"])


@pytest.mark.skipif(not sparse.extension_available(), reason="needs the compiled extension")
def test_cpu_ops_check_the_csr_ends_and_columns():
    """On the host the O(1) CSR ends are checked too (the kernels would read out of bounds)."""
    t = _op_inputs("cpu")
    crow = t["crow"].clone()
    crow[-1] += 1
    with pytest.raises(RuntimeError, match=r"end at the number of non-zeros \(6\), got 0 and 7"):
        torch.ops.ldsparse.spmm(crow, t["col"], t["values"], t["x"], None)
    with pytest.raises(RuntimeError, match="end at the number of non-zeros"):
        torch.ops.ldsparse.sddmm(crow, t["col"], t["g"], t["x"])
    with pytest.raises(RuntimeError, match=r"col_indices\[1\] = 2 is outside \[0, n_cols = 2\)"):
        torch.ops.ldsparse.csr_transpose(t["crow"], t["col"], 2)
    with pytest.raises(RuntimeError, match="n_cols must be >= 0"):
        torch.ops.ldsparse.csr_transpose(t["crow"], t["col"], -1)


def test_strided_csr_indices_are_accepted():
    t = _op_inputs("cpu")
    strided = {k: torch.stack([t[k], torch.zeros_like(t[k])], -1)[:, 0] for k in ("crow", "col")}
    assert not strided["crow"].is_contiguous()
    torch.testing.assert_close(
        torch.ops.ldsparse.spmm(strided["crow"], strided["col"], t["values"], t["x"], t["bias"]),
        torch.ops.ldsparse.spmm(t["crow"], t["col"], t["values"], t["x"], t["bias"]))
