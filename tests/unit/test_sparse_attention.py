"""Block-sparse causal attention (kernels + reference) and hash layouts agree with dense
attention under the same mask; ground truth is ``F.scaled_dot_product_attention`` with an
explicit boolean mask, not our own reference."""
import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from lightning_dynmo import sparse
from lightning_dynmo.models import GPT, Block, GPTConfig
from lightning_dynmo.models.gpt import HashSparseSelfAttention, SparseAttentionBlock, set_hash_step
from lightning_dynmo.protocol import ReportsLoad
from lightning_dynmo.sparse.attention import block_attention_op, block_sparse_attention
from lightning_dynmo.sparse.layout import BlockLayout
from lightning_dynmo.sparse.hash_layout import (HASH_CENTERS, causal_center, draw_rotations, hash_buckets,
                                                hash_sort_plan, hash_sparse_attention, local_window_layout)

from tests.support.sparse import cpu_isa, run_without_extension

KERNEL = sparse.attention_kernel_available("cpu", torch.float32)
needs_kernel = pytest.mark.skipif(not KERNEL, reason="needs the compiled attention kernels")


def random_layout(b, h, t, bs, density, gen, diagonal=True, empty_rows=0):
    """Random causal block layout; `empty_rows` query blocks of head (0, 0) see nothing."""
    n = -(-t // bs)
    mask = torch.rand(b, h, n, n, generator=gen) < density
    if diagonal:
        mask |= torch.eye(n, dtype=torch.bool)
    if empty_rows:
        mask[0, 0, torch.randperm(n, generator=gen)[:empty_rows]] = False
    return BlockLayout.from_block_mask(mask, bs, t)


def qkv(b, h, t, d, dtype, gen, contiguous=True):
    if contiguous:
        return [torch.randn(b, h, t, d, generator=gen, dtype=dtype).requires_grad_() for _ in range(3)]
    # GPT's layout: one [B, T, 3C] projection viewed per head (non-contiguous, strided).
    x = torch.randn(b, t, 3 * h * d, generator=gen, dtype=dtype).requires_grad_()
    return [z.view(b, t, h, d).transpose(1, 2) for z in x.split(h * d, dim=2)]


def check_against_sdpa(q, k, v, layout, atol, rtol, fn=block_sparse_attention):
    out = fn(q, k, v, layout)
    mask = layout.token_mask()
    qr, kr, vr = (x.detach().clone().requires_grad_() for x in (q, k, v))
    ref = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask)
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), g)
    refs = torch.autograd.grad(ref, (qr, kr, vr), g)
    for name, a, r in zip("qkv", grads, refs):
        torch.testing.assert_close(a, r, atol=atol, rtol=rtol, msg=lambda m: f"d{name}: {m}")
    return out


# --------------------------------------------------------------------------- kernels
def test_extension_has_attention_kernels():
    if os.environ.get("LDSPARSE_REQUIRE_EXT", "1") == "0":
        pytest.skip("LDSPARSE_REQUIRE_EXT=0")
    assert KERNEL, f"attention kernels missing (extension error: {sparse.extension_error()!r})"


CASES = [  # b, h, t, d, block, density, empty_rows
    (1, 1, 16, 16, 16, 1.0, 0),     # a single block
    (1, 1, 64, 8, 64, 1.0, 0),      # a single block, head_dim below one vector
    (2, 3, 100, 24, 16, 0.4, 0),    # B, H > 1, ragged last block (100 = 6 * 16 + 4)
    (1, 2, 257, 64, 64, 0.3, 0),    # ragged by one token
    (2, 2, 130, 5, 32, 0.6, 2),     # odd head_dim, two empty query blocks
    (1, 3, 96, 32, 16, 0.0, 3),     # diagonal only, plus empty rows
    (1, 1, 300, 80, 128, 0.7, 0),   # block 128, head_dim not a power of two
    (3, 1, 33, 16, 32, 0.5, 1),     # ragged block of one token, one empty row
]


@needs_kernel
@pytest.mark.parametrize("b,h,t,d,bs,density,empty", CASES)
@pytest.mark.parametrize("contiguous", [True, False])
def test_kernel_matches_sdpa_fp32(b, h, t, d, bs, density, empty, contiguous):
    gen = torch.Generator().manual_seed(t * 31 + d)
    layout = random_layout(b, h, t, bs, density, gen, empty_rows=empty)
    q, k, v = qkv(b, h, t, d, torch.float32, gen, contiguous)
    out = check_against_sdpa(q, k, v, layout, atol=1e-5, rtol=1e-5)
    if empty:  # query blocks without key blocks output exactly 0
        rows = (layout.token_mask().sum(-1) == 0)
        assert rows.any() and torch.all(out.detach()[rows] == 0)


@needs_kernel
@pytest.mark.parametrize("b,h,t,d,bs,density,empty", CASES[2:6])
def test_kernel_matches_sdpa_fp64(b, h, t, d, bs, density, empty):
    gen = torch.Generator().manual_seed(t)
    layout = random_layout(b, h, t, bs, density, gen, empty_rows=empty)
    check_against_sdpa(*qkv(b, h, t, d, torch.float64, gen), layout, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("b,h,t,d,bs,density,empty", CASES[2:6])
def test_reference_matches_sdpa(b, h, t, d, bs, density, empty):
    gen = torch.Generator().manual_seed(t)
    layout = random_layout(b, h, t, bs, density, gen, empty_rows=empty)
    check_against_sdpa(*qkv(b, h, t, d, torch.float64, gen), layout, atol=1e-12, rtol=1e-10,
                       fn=sparse.reference_block_sparse_attention)


@needs_kernel
@pytest.mark.parametrize("t,bs,empty", [(37, 16, 1), (32, 32, 0), (50, 16, 0)])
def test_gradcheck_fp64(t, bs, empty):
    gen = torch.Generator().manual_seed(t)
    layout = random_layout(1, 2, t, bs, 0.5, gen, empty_rows=empty)
    q, k, v = qkv(1, 2, t, 5, torch.float64, gen)
    assert torch.autograd.gradcheck(lambda q, k, v: block_sparse_attention(q, k, v, layout), (q, k, v),
                                    fast_mode=True)


@needs_kernel
@pytest.mark.parametrize("isa", ["default", "avx2"])
def test_narrower_isa_builds_agree(isa):
    with cpu_isa(isa):
        gen = torch.Generator().manual_seed(3)
        for dtype, tol in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
            for bs in (16, 64):
                layout = random_layout(2, 2, 150, bs, 0.5, gen, empty_rows=1)
                check_against_sdpa(*qkv(2, 2, 150, 40, dtype, gen), layout, atol=tol, rtol=tol)


@needs_kernel
def test_deterministic_and_threads():
    gen = torch.Generator().manual_seed(5)
    layout = random_layout(1, 2, 512, 32, 0.5, gen)
    q, k, v = qkv(1, 2, 512, 32, torch.float32, gen)
    g = torch.randn(1, 2, 512, 32, generator=gen)
    prev = torch.get_num_threads()

    def run(threads):
        torch.set_num_threads(threads)
        out = block_sparse_attention(q, k, v, layout)
        return (out, *torch.autograd.grad(out, (q, k, v), g))

    try:
        first, again, one = run(2), run(2), run(1)
    finally:
        torch.set_num_threads(prev)
    for a, b, c in zip(first, again, one):
        assert torch.equal(a, b)  # same threads: bitwise
        torch.testing.assert_close(a, c, atol=1e-6, rtol=1e-6)  # dQ chunking differs by rounding


@needs_kernel
def test_op_registration_opcheck_and_compile():
    gen = torch.Generator().manual_seed(0)
    layout = random_layout(1, 2, 48, 16, 0.6, gen, empty_rows=1)
    q, k, v = qkv(1, 2, 48, 8, torch.float32, gen)
    args = (q, k, v, layout.row_ptr, layout.col_idx, *layout.transposed(), 16, 0.3)
    torch.library.opcheck(block_attention_op, args)
    torch.library.opcheck(torch.ops.ldsparse.block_attn_fwd.default,
                          (q.detach(), k.detach(), v.detach(), layout.row_ptr, layout.col_idx, 16, 0.3))
    perm = torch.randperm(48, generator=gen).to(torch.int32).expand(1, 2, 48).contiguous()
    torch.library.opcheck(block_attention_op, (*args, perm))
    compiled = torch.compile(lambda q, k, v: block_attention_op(q, k, v, *args[3:])[0],
                             backend="aot_eager", fullgraph=True)
    out = compiled(q, k, v)
    out.sum().backward()
    eager = block_attention_op(*args)[0]
    torch.testing.assert_close(out, eager)


def test_layout_roundtrip_and_transpose():
    gen = torch.Generator().manual_seed(1)
    n = 7
    mask = torch.rand(2, 3, n, n, generator=gen) < 0.5
    layout = BlockLayout.from_block_mask(mask, 16, 100)
    assert torch.equal(layout.block_mask(), mask & torch.ones(n, n, dtype=torch.bool).tril())
    col_ptr, row_idx = layout.transposed()
    # the transpose, as a layout of the transposed mask, is the same set of block pairs
    dense = torch.zeros(6, n, n, dtype=torch.bool)
    cp = col_ptr.reshape(6, n + 1)
    for bh in range(6):
        for c in range(n):
            dense[bh, row_idx[cp[bh, c]:cp[bh, c + 1]].long(), c] = True
    assert torch.equal(dense.reshape(2, 3, n, n), layout.block_mask())
    assert layout.density() == pytest.approx(int(layout.block_mask().sum()) / (6 * n * (n + 1) / 2))


def test_bad_input_errors():
    q = torch.randn(1, 2, 40, 8)
    layout = random_layout(1, 2, 40, 16, 1.0, torch.Generator().manual_seed(0))
    with pytest.raises(TypeError, match="int32"):
        BlockLayout(layout.row_ptr.long(), layout.col_idx, 16, 40)
    with pytest.raises(ValueError, match=r"ceil\(T / block_size\) \+ 1"):
        BlockLayout(layout.row_ptr, layout.col_idx, 16, 100)
    with pytest.raises(ValueError, match="does not fit seq_len"):
        BlockLayout.from_block_mask(torch.ones(1, 2, 2, 2, dtype=torch.bool), 16, 40)
    with pytest.raises(ValueError, match="layout is for"):
        block_sparse_attention(q, q, q, random_layout(1, 3, 40, 16, 1.0, torch.Generator()))
    with pytest.raises(ValueError, match="same shape|one shape"):
        block_sparse_attention(q, q[:, :, :20], q, layout)
    with pytest.raises(ValueError, match="block_size is required"):
        block_sparse_attention(q, q, q, layout.block_mask())
    with pytest.raises(ValueError, match="nb_hash"):
        hash_sort_plan(torch.zeros(1, 1, 8, dtype=torch.long), 0, 16)
    with pytest.raises(ValueError, match="rotations"):
        hash_buckets(q, torch.randn(2, 8, 3), nb_hash=4)


@needs_kernel
def test_bad_layout_errors_from_the_op():
    q = torch.randn(1, 1, 40, 8)
    layout = random_layout(1, 1, 40, 16, 1.0, torch.Generator().manual_seed(0))
    fwd = torch.ops.ldsparse.block_attn_fwd
    with pytest.raises(RuntimeError, match="must be int32"):
        fwd(q, q, q, layout.row_ptr.long(), layout.col_idx, 16, 1.0)
    with pytest.raises(RuntimeError, match=r"shape \[B, H, ceil\(S / block_size\) \+ 1\]"):
        fwd(q, q, q, layout.row_ptr[..., :-1].contiguous(), layout.col_idx, 16, 1.0)
    with pytest.raises(RuntimeError, match="block_size must be 16, 32, 64 or 128"):
        fwd(q, q, q, layout.row_ptr, layout.col_idx, 20, 1.0)
    upper = torch.tensor([[[0, 2, 3, 4]]], dtype=torch.int32)  # block (0, 1): key after query
    with pytest.raises(RuntimeError, match="not causal"):
        fwd(q, q, q, upper, torch.tensor([0, 1, 1, 2], dtype=torch.int32), 16, 1.0)
    dup = torch.tensor([[[0, 1, 3, 4]]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="strictly increasing"):
        fwd(q, q, q, dup, torch.tensor([0, 1, 1, 2], dtype=torch.int32), 16, 1.0)
    with pytest.raises(RuntimeError, match="float32 or float64"):
        fwd(q.half(), q.half(), q.half(), layout.row_ptr, layout.col_idx, 16, 1.0)
    slots = torch.arange(40, dtype=torch.int32).reshape(1, 1, 40)
    fwd(q, q, q, layout.row_ptr, layout.col_idx, 16, 1.0, slots)  # identity map: fine
    for bad, match in [(slots.long(), "slot_token must be int32"), (slots.clamp(max=38), "two slots"),
                       (torch.where(slots == 5, -1, slots), "every token needs a slot"),
                       (slots + 1, "slot_token values")]:
        with pytest.raises(RuntimeError, match=match):
            fwd(q, q, q, layout.row_ptr, layout.col_idx, 16, 1.0, bad)


def random_slots(b, h, t, pad, gen):
    """slot -> token maps: a random permutation of each head's tokens with `pad` empty slots."""
    maps = []
    for _ in range(b * h):
        m = torch.cat([torch.randperm(t, generator=gen), torch.full((pad,), -1)])
        maps.append(m[torch.randperm(t + pad, generator=gen)])
    return torch.stack(maps).reshape(b, h, t + pad).to(torch.int32)


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_slot_token_permutation_matches_sdpa(kernel, dtype, tol):
    """Attention on a permuted, padded slot sequence, inputs and outputs in token order."""
    if kernel and not KERNEL:
        pytest.skip("needs the compiled attention kernels")
    gen = torch.Generator().manual_seed(11)
    b, h, t, d, pad, bs = 2, 2, 70, 12, 25, 16
    slot_token = random_slots(b, h, t, pad, gen)
    layout = random_layout(b, h, t + pad, bs, 0.5, gen, empty_rows=1)
    q, k, v = qkv(b, h, t, d, dtype, gen, contiguous=False)
    fn = block_sparse_attention if kernel else sparse.reference_block_sparse_attention
    out = fn(q, k, v, layout, scale=0.3, slot_token=slot_token)
    slot_of = torch.zeros(b, h, t, dtype=torch.long)
    for i in range(b * h):
        m = slot_token.reshape(b * h, -1)[i].long()
        slot_of.reshape(b * h, t)[i, m[m >= 0]] = torch.nonzero(m >= 0).squeeze(1)
    sm = layout.token_mask()  # on slots
    rows = sm.gather(2, slot_of.unsqueeze(-1).expand(b, h, t, t + pad))
    mask = rows.gather(3, slot_of.unsqueeze(-2).expand(b, h, t, t))
    qr, kr, vr = (x.detach().clone().requires_grad_() for x in (q, k, v))
    ref = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask, scale=0.3)
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    g = torch.randn(out.shape, generator=gen, dtype=dtype)
    for a, r in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (qr, kr, vr), g)):
        torch.testing.assert_close(a, r, atol=tol, rtol=tol)


def test_block_size_without_kernel_uses_reference():
    gen = torch.Generator().manual_seed(2)
    layout = random_layout(1, 2, 45, 12, 0.5, gen, empty_rows=1)
    assert not sparse.attention_kernel_available("cpu", torch.float32, 12)
    check_against_sdpa(*qkv(1, 2, 45, 6, torch.float64, gen), layout, atol=1e-12, rtol=1e-10)


def test_package_works_without_extension():
    """A broken build must not break the feature: everything falls back to the reference."""
    run_without_extension(
        "warnings.simplefilter('ignore')\n"
        "import torch, torch.nn.functional as F\n"
        "from lightning_dynmo import sparse\n"
        "from lightning_dynmo.models import GPT, GPTConfig\n"
        "assert not sparse.extension_available() and not sparse.attention_kernel_available()\n"
        "torch.manual_seed(0); n = 3\n"
        "lay = sparse.BlockLayout.from_block_mask(torch.rand(1, 2, n, n) < 0.5, 16, 40)\n"
        "q, k, v = (torch.randn(1, 2, 40, 8, requires_grad=True) for _ in range(3))\n"
        "out = sparse.block_sparse_attention(q, k, v, lay); out.sum().backward()\n"
        "torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=lay.token_mask()))\n"
        "rot = sparse.draw_rotations(2, 8, 3)\n"
        "y, plan = sparse.hash_sparse_attention(q, k, v, rot, 3, 16)\n"
        "m = GPT(GPTConfig.preset('tiny', attention='hash_sparse', attention_block=16, nb_hash=2), seed=0)\n"
        "m(torch.randint(0, 256, (2, 32))).sum().backward()\n"
        "assert m.layers[1].load_factor() > 0\n")


# --------------------------------------------------------------------------- hash layouts
@settings(max_examples=40, deadline=None, derandomize=True)
@given(b=st.integers(1, 2), h=st.integers(1, 3), t=st.integers(1, 150), nb=st.integers(1, 6),
       bs=st.sampled_from([16, 32]), skew=st.booleans(), seed=st.integers(0, 2**16))
def test_hash_plan_is_causal_and_same_bucket(b, h, t, nb, bs, skew, seed):
    gen = torch.Generator().manual_seed(seed)
    if skew:  # one big bucket and a few stragglers
        buckets = torch.where(torch.rand(b, h, t, generator=gen) < 0.8, 0,
                              torch.randint(0, nb, (b, h, t), generator=gen))
    else:
        buckets = torch.randint(0, nb, (b, h, t), generator=gen)
    plan = hash_sort_plan(buckets, nb, bs)
    mask = plan.token_mask()
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    assert not (mask & ~causal).any(), "attends to a later token"
    same = buckets.unsqueeze(-1) == buckets.unsqueeze(-2)
    assert torch.equal(mask, same & causal)  # exactly Pagliardini's hash-sparse rule
    assert torch.all(mask.diagonal(dim1=-2, dim2=-1)), "a token does not see itself"
    # the layout: every non-padding block row holds its diagonal block; slots are a bijection
    lay = plan.layout
    bm = lay.block_mask()
    used = torch.zeros(b, h, lay.n_blocks, dtype=torch.bool).scatter_(-1, plan.slot // bs, True)
    assert torch.all(bm.diagonal(dim1=-2, dim2=-1)[used])
    assert torch.equal(plan.source.gather(-1, plan.slot), torch.arange(t).expand(b, h, t))
    assert int((plan.source < t).sum()) == b * h * t


@settings(max_examples=15, deadline=None, derandomize=True)
@given(nb=st.integers(1, 8), bs=st.sampled_from([16, 32]), seed=st.integers(0, 2**16))
def test_hash_density_is_about_one_over_nb(nb, bs, seed):
    t = 2048
    n = t // bs
    buckets = torch.randint(0, nb, (2, 2, t), generator=torch.Generator().manual_seed(seed))
    d = hash_sort_plan(buckets, nb, bs).density
    # convexity gives the lower bound; ceil() padding (<= 1 block per bucket) and +-20 % bucket
    # imbalance the upper one; both -> 1 / nb as the sequence grows
    assert n / ((n + 1) * nb) <= d <= (1.2 * n * n / nb + 3 * n + 2 * nb) / (n * (n + 1))
    assert abs(d - 1 / nb) <= 0.5 / nb + 3 / n


def test_lsh_buckets_are_balanced_and_deterministic():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4096, 32, generator=gen)
    for nb in (1, 2, 3, 4, 8):
        rot = draw_rotations(3, 32, nb, torch.Generator().manual_seed(1))
        bk = hash_buckets(x, rot, nb)
        assert bk.dtype == torch.int64 and bk.min() >= 0 and bk.max() < nb
        assert torch.equal(bk, hash_buckets(x * 3.0, rot, nb))  # angular: scale-free
        share = torch.bincount(bk.flatten(), minlength=nb).float() / bk.numel()
        if nb % 2 == 0:  # +-R pairs: balanced in expectation for isotropic keys
            assert share.max() < 1.5 / nb and share.min() > 0.5 / nb


def test_causal_center_is_the_running_mean_and_std():
    x = torch.randn(2, 3, 40, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64) + 5.0
    want = torch.stack([x[:, :, t] - x[:, :, :t + 1].mean(2) for t in range(40)], dim=2)
    torch.testing.assert_close(causal_center(x), want.float())
    std = torch.stack([x[:, :, :t + 1].std(2, correction=0) for t in range(40)], dim=2)
    torch.testing.assert_close(causal_center(x, scale=True), (want / torch.sqrt(std ** 2 + 1e-6)).float(),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("nb", [2, 4, 8])
def test_causal_centering_undoes_a_shared_key_direction(nb):
    """Keys sharing one strong direction (what training grows) fall into one bucket when hashed
    raw; minus their causal running mean they spread over the buckets again."""
    gen = torch.Generator().manual_seed(nb)
    shared = torch.randn(3, 1, 32, generator=gen)
    x = 0.25 * torch.randn(2, 3, 2048, 32, generator=gen) + 10.0 * shared / shared.norm(dim=-1, keepdim=True)
    rot = draw_rotations(3, 32, nb, torch.Generator().manual_seed(1))

    def top_share(center):  # [B, H]: the largest bucket's share of the tokens
        return F.one_hot(hash_buckets(x, rot, nb, center), nb).float().mean(2).amax(-1)

    # collapsed: one bucket holds nearly all of a head's tokens (except in a head whose hash
    # directions happen to be orthogonal to the shared one)
    assert top_share("none").mean() > 0.8
    for center in ("causal", "causal_std"):
        assert top_share(center).max() < 1.6 / nb
    with pytest.raises(ValueError, match="hash center must be one of"):
        hash_buckets(x, rot, nb, "mean")


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("b,h,t,d,bs,nb", [(2, 3, 100, 16, 16, 4), (1, 2, 300, 32, 32, 3), (1, 1, 5, 4, 16, 1)])
def test_hash_sparse_attention_matches_sdpa(dtype, tol, b, h, t, d, bs, nb):
    gen = torch.Generator().manual_seed(t)
    x = torch.randn(b, t, 3 * h * d, generator=gen, dtype=dtype).requires_grad_()
    q, k, v = (z.view(b, t, h, d).transpose(1, 2) for z in x.split(h * d, dim=2))  # non-contiguous
    rot = draw_rotations(h, d, nb, torch.Generator().manual_seed(1), dtype=dtype)
    y, plan = hash_sparse_attention(q, k, v, rot, nb, bs)
    same = plan.buckets.unsqueeze(-1) == plan.buckets.unsqueeze(-2)
    mask = same & torch.ones(t, t, dtype=torch.bool).tril()
    xr = x.detach().clone().requires_grad_()
    qr, kr, vr = (z.view(b, t, h, d).transpose(1, 2) for z in xr.split(h * d, dim=2))
    ref = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask)
    torch.testing.assert_close(y, ref, atol=tol, rtol=tol)
    g = torch.randn(y.shape, generator=gen, dtype=dtype)
    (gx,) = torch.autograd.grad(y, x, g)
    (gr,) = torch.autograd.grad(ref, xr, g)
    torch.testing.assert_close(gx, gr, atol=tol, rtol=tol)


def _perturb_future(x, cut, gen):
    """``x`` with every position after ``cut`` (dim 1) redrawn: a different future."""
    x2 = x.clone()
    if x.dtype == torch.long:
        x2[:, cut + 1:] = torch.randint(0, 256, x2[:, cut + 1:].shape, generator=gen)
    else:
        x2[:, cut + 1:] = torch.randn(x2[:, cut + 1:].shape, generator=gen, dtype=x.dtype)
    return x2


def _unaligned_block_rule(buckets, nb, bs):
    """The leaky alternative: tokens packed by (bucket, position) with no per-bucket padding,
    token i sees j <= i when their blocks share a bucket. Where a bucket starts depends on how
    many tokens -- future ones too -- fall in earlier buckets."""
    b, h, t = buckets.shape
    perm = torch.argsort(buckets * t + torch.arange(t), dim=-1)
    blk = torch.empty_like(perm).scatter_(-1, perm, torch.arange(t).expand(b, h, t)) // bs
    occ = torch.zeros(b, h, -(-t // bs), nb)
    occ[torch.arange(b)[:, None, None], torch.arange(h)[None, :, None], blk, buckets] = 1
    share = (occ @ occ.transpose(-1, -2)) > 0
    rows = share.gather(2, blk.unsqueeze(-1).expand(b, h, t, share.shape[-1]))
    return rows.gather(3, blk.unsqueeze(-2).expand(b, h, t, t)) & torch.ones(t, t, dtype=torch.bool).tril()


CAUSAL_CASES = [(seed, t, nb, bs) for seed, (t, nb, bs) in enumerate(
    [(50, 2, 16), (100, 3, 16), (160, 5, 16), (100, 2, 32), (160, 3, 32), (77, 4, 16), (130, 8, 16), (200, 3, 32)])]


def test_hash_sparse_layer_output_ignores_future_tokens():
    """Changing only the tokens after position ``cut`` leaves outputs at positions <= cut
    bit-identical, forward and backward. The leaky block-level rule fails the same probe on
    these cases (so the probe is strong enough to catch a bucket-boundary leak)."""
    leaks = 0
    for seed, t, nb, bs in CAUSAL_CASES:
        center = HASH_CENTERS[seed % len(HASH_CENTERS)]
        cfg = GPTConfig.preset("tiny", attention="hash_sparse", attention_block=bs, nb_hash=nb, block_size=256,
                               hash_center=center)
        layer = HashSparseSelfAttention(cfg, seed)
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(2, t, cfg.n_embd, generator=gen)
        cut = int(torch.randint(1, t - 1, (1,), generator=gen))
        x2 = _perturb_future(x, cut, gen)
        outs, grads = [], []
        for inp in (x, x2):
            inp = inp.clone().requires_grad_()
            y = layer(inp)
            y[:, :cut + 1].square().sum().backward()
            outs.append(y[:, :cut + 1].detach())
            grads.append(inp.grad)
        assert torch.equal(outs[0], outs[1]), f"case {(seed, t, nb, bs, cut, center)}: the past depends on the future"
        assert torch.equal(grads[0][:, :cut + 1], grads[1][:, :cut + 1])
        assert not grads[0][:, cut + 1:].any() and not grads[1][:, cut + 1:].any()
        rot = layer.current_rotations()
        qkv = [layer.qkv(z).view(2, t, 3, cfg.n_head, -1)[:, :, 1].transpose(1, 2) for z in (x, x2)]
        bk = [hash_buckets(k, rot, nb, center) for k in qkv]
        assert torch.equal(bk[0][..., :cut + 1], bk[1][..., :cut + 1])
        masks = [hash_sort_plan(b, nb, bs).token_mask()[..., :cut + 1, :] for b in bk]
        assert torch.equal(masks[0], masks[1])
        leaky = [_unaligned_block_rule(b, nb, bs)[..., :cut + 1, :] for b in bk]
        leaks += not torch.equal(leaky[0], leaky[1])
    assert leaks >= len(CAUSAL_CASES) // 2, f"the probe caught the leaky rule in only {leaks} cases"


@pytest.mark.parametrize("nb,bs,redraw,center", [(2, 16, False, "causal"), (3, 16, True, "none"),
                                                 (5, 32, False, "causal_std")])
def test_hash_sparse_gpt_logits_ignore_future_tokens(nb, bs, redraw, center):
    """A whole hash-sparse GPT (every layer hash-bucketed), training mode: logits at positions
    <= cut do not move when only later tokens change."""
    m = sparse_tiny(nb_hash=nb, attention_block=bs, hash_redraw=redraw, block_size=160, hash_center=center).train()
    set_hash_step(m, 3)
    gen = torch.Generator().manual_seed(nb)
    for t in (64, 150):
        x = torch.randint(0, 256, (2, t), generator=gen)
        for cut in (t // 5, t // 2, t - 3):
            x2 = _perturb_future(x, cut, gen)
            torch.testing.assert_close(m(x2)[:, :cut + 1], m(x)[:, :cut + 1], atol=0, rtol=0)


def test_local_window_layout():
    lay = local_window_layout(1, 2, 100, 16, window_blocks=1)
    bm = lay.block_mask()[0, 0]
    n = 7
    want = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        want[i, max(0, i - 1):i + 1] = True
    assert torch.equal(bm, want)


# --------------------------------------------------------------------------- GPT option
def sparse_tiny(**kw):
    cfg = dict(attention="hash_sparse", attention_block=16, nb_hash=2)
    cfg.update(kw)
    return GPT(GPTConfig.preset("tiny", **cfg), seed=0)


def test_gpt_config_fields_roundtrip():
    cfg = GPTConfig.preset("tiny", attention=["dense", "hash_sparse", "dense", "hash_sparse"], nb_hash=3)
    assert cfg.attention == ("dense", "hash_sparse", "dense", "hash_sparse")
    d = cfg.to_dict()
    assert d["attention"] == ["dense", "hash_sparse", "dense", "hash_sparse"] and d["nb_hash"] == 3
    assert GPTConfig.from_any(d) == cfg
    m = GPT(cfg, seed=0)
    kinds = [type(l) for l in m.layers[1:-2]]
    assert kinds == [Block, SparseAttentionBlock, Block, SparseAttentionBlock]
    assert GPT(**m.hparams).config == cfg
    for bad, match in [(dict(attention="flash"), "attention must be"), (dict(attention=("dense",)), "entries"),
                       (dict(nb_hash=0), "nb_hash"), (dict(attention_block=0), "attention_block"),
                       (dict(hash_center="mean"), "hash_center")]:
        with pytest.raises(ValueError, match=match):
            GPTConfig.preset("tiny", **bad)


def test_gpt_hash_sparse_one_bucket_equals_dense():
    dense = GPT(GPTConfig.preset("tiny"), seed=0)
    sp = sparse_tiny(nb_hash=1)
    for a, b in zip(dense.parameters(), sp.parameters()):
        assert torch.equal(a, b)  # the rotations come from their own generator
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(sp(x), dense(x), atol=1e-5, rtol=1e-5)


def test_gpt_hash_sparse_is_causal_and_trains():
    m = sparse_tiny().eval()
    x = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(1))
    x2 = x.clone()
    x2[0, 20] = (x2[0, 20] + 1) % 256
    torch.testing.assert_close(m(x)[:, :20], m(x2)[:, :20], atol=1e-6, rtol=0)
    m.train()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    y = torch.roll(x, -1, 1)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = m.pipeline_loss(m(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


def test_sparse_block_reports_load():
    m = sparse_tiny(n_layer=2, attention=("hash_sparse", "dense"), nb_hash=4)
    sparse_block, dense_block = m.layers[1], m.layers[2]
    assert isinstance(sparse_block, ReportsLoad) and not isinstance(dense_block, ReportsLoad)
    assert isinstance(sparse_block.attn, HashSparseSelfAttention) and isinstance(sparse_block.attn, ReportsLoad)
    assert sparse_block.load_factor() is None
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2))
    m.eval()
    with torch.no_grad():
        m(x)
    assert sparse_block.load_factor() is None  # eval / no-grad passes do not count
    m.train()
    m(x).sum().backward()
    d = sparse_block.attention_density()
    assert d == sparse_block.attn.last_density and 0 < d
    lf = sparse_block.load_factor()
    assert 0 < lf and (lf < 1) == (d < 1)
    m(x)
    assert sparse_block.attn.load_window.count == 2
    sparse_block.reset_load()
    assert sparse_block.load_factor() is None and sparse_block.attention_density() is None


def test_hash_rotations_are_layer_state():
    m = sparse_tiny()
    names = dict(m.layers[1].named_buffers())
    assert set(names) == {"attn.rotations", "attn.hash_step"}
    assert not torch.equal(m.layers[1].attn.rotations, m.layers[2].attn.rotations)
    # a fresh model loading the state dict computes the same function
    other = GPT(GPTConfig.preset("tiny", attention="hash_sparse", attention_block=16, nb_hash=2), seed=1)
    other.load_state_dict(m.state_dict())
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    assert torch.equal(other.eval()(x), m.eval()(x))


def test_hash_redraw_is_a_function_of_layer_and_step():
    """Rotations follow (layer, optimizer step) only: forwards within a step (micro-batches,
    recomputation) agree and change no state; another step draws new ones; the model's fixed
    rotations serve evaluation."""
    a, b = sparse_tiny(hash_redraw=True).train(), sparse_tiny(hash_redraw=True).train()
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(4))
    state = {k: v.clone() for k, v in a.state_dict().items()}
    ya1, ya1_again = a(x), a(x)
    assert torch.equal(ya1, ya1_again)  # one step, one draw
    assert all(torch.equal(v, state[k]) for k, v in a.state_dict().items())  # forward changes no state
    set_hash_step(a, 1)
    assert int(a.layers[1].attn.hash_step) == 1
    ya2 = a(x)
    assert not torch.equal(ya1, ya2)  # new rotations, new buckets
    assert torch.equal(b(x), ya1)
    set_hash_step(b, 1)
    assert torch.equal(b(x), ya2)  # same step -> same rotations, whatever ran before
    assert not torch.equal(a.layers[1].attn.current_rotations(), a.layers[2].attn.current_rotations())
    a.eval()
    assert a.layers[1].attn.current_rotations() is a.layers[1].attn.rotations


def test_lightning_sets_the_hash_step_each_batch():
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    seen = []

    class Probe(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(int(pl_module.layers[1].attn.hash_step))

    data = torch.randint(0, 256, (6, 33), generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=2)
    trainer = L.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Probe()])
    trainer.fit(sparse_tiny(hash_redraw=True), loader)
    assert seen == [0, 1, 2]


def test_per_layer_nb_hash():
    cfg = GPTConfig.preset("tiny", attention="hash_sparse", attention_block=16, nb_hash=[1, 2, 4, 8])
    assert cfg.nb_hash == (1, 2, 4, 8) and cfg.to_dict()["nb_hash"] == [1, 2, 4, 8]
    assert GPTConfig.from_any(cfg.to_dict()) == cfg
    m = GPT(cfg, seed=0)
    assert [m.layers[i + 1].attn.nb_hash for i in range(4)] == [1, 2, 4, 8]
    assert [tuple(m.layers[i + 1].attn.rotations.shape) for i in range(4)] == [(2, 16, 1), (2, 16, 1), (2, 16, 2),
                                                                             (2, 16, 4)]
    for bad, match in [([1, 2], "entries"), ([1, 0, 2, 2], "nb_hash"), ([1, 1.5, 2, 2], "nb_hash")]:
        with pytest.raises(ValueError, match=match):
            GPTConfig.preset("tiny", nb_hash=bad)
