"""What block-sparse attention derives from a layout is built once per layout, and rebuilt when
the layout changes; ``backend="auto"`` picks its back end by measurement, once per shape class.

CPU: FlexAttention's forward (``backend="flex"``) with the cached ``BlockMask`` equals the dense
reference before and after a layout change. CUDA (``cuda`` marker): the measured ``auto`` choice
is one of the built candidates, cached, and equal to the reference forward and backward."""
from __future__ import annotations

import pytest
import torch

from lightning_dynmo.sparse import backend_choice
from lightning_dynmo.sparse.attention import (auto_candidates, auto_route, block_sparse_attention, pick_backend,
                                              reference_block_sparse_attention, timed_step)
from lightning_dynmo.sparse.backend_choice import ENV_OVERRIDE, attention_choices, choice_key, fastest
from lightning_dynmo.sparse.flex import cached_block_mask, flex_available, flex_tile
from lightning_dynmo.sparse.layout import BlockLayout

needs_flex = pytest.mark.skipif(not flex_available(), reason="torch without flex_attention")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")


def layout_of(b, h, t, bs, seed, density=0.5):
    n = -(-t // bs)
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.rand(b, h, n, n, generator=gen) < density) | torch.eye(n, dtype=torch.bool)
    return BlockLayout.from_block_mask(mask, bs, t)


def qkv(b, h, t, d, seed, device="cpu", dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, t, d, generator=gen).to(device, dtype) for _ in range(3)]


def ran_mask_build(fn) -> bool:
    """Whether ``fn()`` ran the ops of a BlockMask build (argsort: kv/q block indices, which
    neither flex_attention nor the slot gathers run)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return any(e.name == "aten::argsort" for e in prof.events())


@pytest.fixture(autouse=True)
def fresh_choices():
    backend_choice.clear_attention_choices()
    yield
    backend_choice.clear_attention_choices()


# --------------------------------------------------------------------------- layout cache
def test_transpose_and_device_copy_are_cached_until_the_layout_changes():
    layout = layout_of(1, 2, 256, 32, seed=0)
    first = layout.transposed()
    assert layout.transposed() is first
    assert layout.to("meta") is layout.to("meta")
    layout.col_idx[-1] = 0  # in place: the version counter moves
    assert layout.transposed() is not first
    again = layout.transposed()
    layout.row_ptr = layout.row_ptr.clone()  # another tensor, same values
    assert layout.transposed() is not again


@needs_flex
def test_flex_block_mask_is_built_once_per_layout():
    b, h, t, d, bs = 1, 2, 200, 16, 32
    layout = layout_of(b, h, t, bs, seed=1)
    q, k, v = qkv(b, h, t, d, seed=1)
    slots = -(-t // flex_tile(bs)) * flex_tile(bs)
    call = lambda: block_sparse_attention(q, k, v, layout, backend="flex")  # noqa: E731
    assert ran_mask_build(call)
    out = call()
    mask = cached_block_mask(layout, q.device, slots, t)
    for _ in range(2):  # later calls build nothing and keep that mask
        assert not ran_mask_build(call)
        torch.testing.assert_close(call(), out)
        assert cached_block_mask(layout, q.device, slots, t) is mask
    torch.testing.assert_close(out, reference_block_sparse_attention(q, k, v, layout), rtol=1e-5, atol=1e-6)


def band_and_sink(b, h, n, bs):
    """Two layouts with the same row counts: each query block i sees blocks i-2..i (a band), or
    blocks 0, 1 and i (attention sinks): one can be written into the other's tensors in place."""
    i = torch.arange(n)
    band = (i[:, None] - i[None, :] <= 2) & (i[None, :] <= i[:, None])
    sink = ((i[None, :] <= 1) | (i[None, :] == i[:, None])) & (i[None, :] <= i[:, None])
    return (BlockLayout.from_block_mask(m.expand(b, h, n, n), bs) for m in (band, sink))


@needs_flex
@pytest.mark.parametrize("change", ["in_place", "new_tensors"])
def test_a_changed_layout_gets_a_new_block_mask_and_the_new_result(change):
    b, h, d, bs, n = 1, 2, 16, 32, 8
    t = n * bs
    layout, other = band_and_sink(b, h, n, bs)
    q, k, v = qkv(b, h, t, d, seed=2)
    slots = -(-t // flex_tile(bs)) * flex_tile(bs)
    before = block_sparse_attention(q, k, v, layout, backend="flex")
    mask = cached_block_mask(layout, q.device, slots, t)
    if change == "in_place":
        assert torch.equal(layout.row_ptr, other.row_ptr)
        layout.col_idx.copy_(other.col_idx)
    else:
        layout.row_ptr, layout.col_idx = other.row_ptr.clone(), other.col_idx.clone()
    assert ran_mask_build(lambda: block_sparse_attention(q, k, v, layout, backend="flex"))
    after = block_sparse_attention(q, k, v, layout, backend="flex")
    assert cached_block_mask(layout, q.device, slots, t) is not mask
    torch.testing.assert_close(after, reference_block_sparse_attention(q, k, v, other), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(after, before)


@needs_flex
def test_slot_map_mask_is_kept_for_the_same_map_only():
    b, h, t, d, bs, slots = 1, 2, 100, 16, 16, 128
    layout = layout_of(b, h, slots, bs, seed=4, density=0.4)
    gen = torch.Generator().manual_seed(4)
    maps = []
    for _ in range(2):
        perm = torch.stack([torch.randperm(slots, generator=gen) for _ in range(b * h)]).view(b, h, slots)
        maps.append(torch.where(perm < t, perm, -1).to(torch.int32))
    q, k, v = qkv(b, h, t, d, seed=4)
    for slot_token in maps:
        ref = reference_block_sparse_attention(q, k, v, layout, slot_token=slot_token)
        call = lambda: block_sparse_attention(q, k, v, layout, slot_token=slot_token, backend="flex")  # noqa: E731
        assert ran_mask_build(call)  # a new map: a new mask
        assert not ran_mask_build(call)
        torch.testing.assert_close(call(), ref, rtol=1e-5, atol=1e-6)
    held = [v for k, v in layout._derived.items() if k[0] == "flex_slot_mask"]
    assert len(held) == 1 and held[0]["slot_token"] is maps[-1]  # one entry: the last map


# --------------------------------------------------------------------------- auto choice
def test_auto_on_the_cpu_takes_the_kernels_without_measuring():
    assert auto_candidates("cpu", torch.float32, 64, 64) == ("kernel",)
    b, h, t, d, bs = 1, 2, 128, 16, 32
    layout = layout_of(b, h, t, bs, seed=5)
    q, k, v = qkv(b, h, t, d, seed=5)
    out = block_sparse_attention(q, k, v, layout)  # backend="auto"
    torch.testing.assert_close(out, reference_block_sparse_attention(q, k, v, layout), rtol=1e-5, atol=1e-6)
    assert attention_choices() == {}


@needs_flex
def test_cuda_candidates_name_flex_and_only_a_built_kernel():
    from lightning_dynmo.sparse.attention import attention_kernel_available

    built = attention_kernel_available("cuda", torch.bfloat16, 128)
    assert auto_candidates("cuda", torch.bfloat16, 128, 64) == (("flex", "kernel") if built else ("flex",))
    assert auto_candidates("cuda", torch.bfloat16, 128, 8) == ("kernel",)  # flex cannot compile head_dim < 16


def test_fastest_measures_once_per_key_and_picks_the_faster_run():
    a, b = torch.randn(32, 32), torch.randn(384, 384)
    trials = {"big": lambda: (lambda: b @ b @ b), "small": lambda: (lambda: a @ a)}  # ~1700x the flops
    key = choice_key("layout", torch.device("cpu"), torch.float32, 1000, 64, 64)
    assert fastest(key, trials, torch.device("cpu")) == "small"
    assert set(attention_choices()[key]["ms"]) == {"big", "small"}
    calls = []
    assert fastest(key, {"big": lambda: calls.append(1)}, torch.device("cpu")) == "small" and not calls  # cached
    # one bucket per power of two of the sequence length
    assert choice_key("layout", "cpu", torch.float32, 1000, 64, 64) == choice_key("layout", "cpu", torch.float32,
                                                                                    1024, 64, 64)
    assert choice_key("layout", "cpu", torch.float32, 1025, 64, 64) != key


def test_timed_step_runs_forward_and_backward_on_copies():
    q, k, v = (x.requires_grad_() for x in qkv(1, 1, 64, 16, seed=6))
    layout = layout_of(1, 1, 64, 16, seed=6)
    run = timed_step(lambda *x: reference_block_sparse_attention(*x, layout), q, k, v)
    run()
    assert q.grad is None  # the caller's tensors are untouched


def test_env_override_pins_the_choice_and_rejects_what_is_not_there(monkeypatch):
    q = torch.randn(1, 1, 64, 16)
    never = lambda name: pytest.fail("measured although pinned")  # noqa: E731
    monkeypatch.setenv(ENV_OVERRIDE, "kernel")
    assert pick_backend("auto", "layout", q, 16, never) == "kernel"
    monkeypatch.setenv(ENV_OVERRIDE, "flex")
    with pytest.raises(ValueError, match="LDSPARSE_ATTENTION_BACKEND='flex' is not available here"):
        pick_backend("auto", "layout", q, 16, never)
    assert pick_backend("kernel", "layout", q, 16, never) == "kernel"  # an explicit backend wins


# --------------------------------------------------------------------------- GPU
@pytest.mark.cuda
@cuda
@needs_flex
def test_auto_on_cuda_is_measured_cached_and_exact():
    # the benchmark's shape (benchmarks/sparse_attention.py --device cuda): scripts/gpu_check.sh (steps cuda_tests,
    # attention)
    # runs this test first, and the benchmark then finds the compiled flex kernels in inductor's cache
    b, h, t, d, bs = 1, 16, 4096, 64, 128
    layout = layout_of(b, h, t, bs, seed=7, density=0.25).to("cuda")
    base = qkv(b, h, t, d, seed=7, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(b, h, t, d, generator=torch.Generator().manual_seed(8)).to("cuda", torch.bfloat16)
    results = []
    for auto in (True, False):
        q, k, v = (x.clone().float().requires_grad_() if not auto else x.clone().requires_grad_() for x in base)
        out = (block_sparse_attention(q, k, v, layout) if auto
               else torch.nan_to_num(reference_block_sparse_attention(q, k, v, layout)))
        out.backward(grad.to(out.dtype))
        results.append([out.float(), q.grad.float(), k.grad.float(), v.grad.float()])
    for what, a, r in zip(("out", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(a, r, rtol=2e-2, atol=2e-2, msg=lambda m: f"auto {what}: {m}")
    dev = base[0].device
    candidates = auto_candidates(dev, torch.bfloat16, bs, d)
    route = auto_route(dev, torch.bfloat16, t, bs, d)
    assert route in candidates  # never "reference" on a GPU with flex
    key = choice_key("layout", dev, torch.bfloat16, t, bs, d)
    if len(candidates) > 1:  # raced once; not again
        choice = attention_choices()[key]
        assert choice["backend"] == route and set(choice["ms"]) == set(candidates)
        block_sparse_attention(*base, layout)
        assert attention_choices()[key] == choice
    else:
        assert key not in attention_choices()  # one candidate: nothing to measure
    slots = -(-t // flex_tile(bs)) * flex_tile(bs)
    mask = cached_block_mask(layout, dev, slots, t)
    block_sparse_attention(*base, layout, backend="flex")
    assert cached_block_mask(layout, dev, slots, t) is mask
