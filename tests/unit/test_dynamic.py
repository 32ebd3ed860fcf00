"""Model-side dynamism mechanisms: pruning threshold (single process and 2 gloo ranks), cubic
schedule, PrunableLinear, early-exit blocks."""
from __future__ import annotations

import math
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings, strategies as st
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_dynmo.dynamic import (
    EarlyExitGPT,
    ExitBlock,
    PrunableLinear,
    cubic_sparsity,
    global_magnitude_threshold,
    make_prunable,
    sparse_kernels_available,
)
from lightning_dynmo.models import GPT, Block, GPTConfig



def brute_threshold(tensors, sparsity):
    allw = torch.cat([t.detach().reshape(-1).abs() for t in tensors])
    k = int(round(sparsity * allw.numel()))
    return -math.inf if k == 0 else float(allw.kthvalue(k).values)


# ---------------------------------------------------------------------------------- threshold
@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=4),
    sparsity=st.floats(0.0, 1.0),
    seed=st.integers(0, 10_000),
    ties=st.booleans(),
    wide=st.booleans(),
)
def test_threshold_equals_kthvalue(sizes, sparsity, seed, ties, wide):
    g = torch.Generator().manual_seed(seed)
    dtype = torch.float64 if wide else torch.float32
    ts = [torch.randn(n, generator=g, dtype=dtype) for n in sizes]
    if ties:
        ts = [torch.round(t * 3) / 3 for t in ts]  # many equal magnitudes, exact zeros
    if sum(sizes) == 0:
        assert global_magnitude_threshold(ts, sparsity) == -math.inf
        return
    assert global_magnitude_threshold(ts, sparsity) == brute_threshold(ts, sparsity)


def test_threshold_prunes_k_weights_and_validates():
    w = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    thr = global_magnitude_threshold([w], 0.37)
    assert int((w.abs() <= thr).sum()) == 370
    with pytest.raises(ValueError):
        global_magnitude_threshold([w], 1.5)


def _threshold_worker(rank, world, store_file, shards, sparsities, out):
    torch.set_num_threads(1)
    # a file rendezvous: no port to pick (and lose to another process) before it is bound
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        res = [global_magnitude_threshold(shards[rank], s) for s in sparsities]
        # an explicit sub-group (as a pipeline group would be) gives the same answer
        group = dist.new_group(list(range(world)))
        res_g = [global_magnitude_threshold(shards[rank], s, group=group) for s in sparsities]
        # a sequence of groups, summed in turn (fsdp: a shard's replicas, then the pipeline): here
        # the pair, then each rank alone
        solo = [dist.new_group([r]) for r in range(world)][rank]
        res_seq = [global_magnitude_threshold(shards[rank], s, group=[group, solo]) for s in sparsities]
        out[rank] = (res, res_g, res_seq)
    finally:
        dist.destroy_process_group()


def _spawn_and_join(fn, args, nprocs: int, timeout: float) -> None:
    """``mp.start_processes`` with a deadline: on timeout every child is killed and the test fails."""
    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise AssertionError(f"spawned ranks did not finish within {timeout} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join()


@pytest.mark.slow  # two spawned processes (~20 s): outside the fast loop
def test_threshold_two_gloo_ranks_equals_single_process(tmp_path):
    g = torch.Generator().manual_seed(7)
    shards = [
        [torch.randn(40, 30, generator=g), torch.randn(123, generator=g)],
        [torch.randn(17, 9, generator=g), torch.round(torch.randn(200, generator=g) * 4) / 4],
    ]
    sparsities = [0.0, 0.25, 0.5, 0.9, 0.999]
    expected = [global_magnitude_threshold(shards[0] + shards[1], s) for s in sparsities]
    assert expected == [brute_threshold(shards[0] + shards[1], s) for s in sparsities]
    manager = mp.Manager()
    out = manager.dict()
    _spawn_and_join(_threshold_worker, (2, str(tmp_path / "store"), shards, sparsities, out), nprocs=2, timeout=120)
    for rank in range(2):
        res, res_g, res_seq = out[rank]
        assert res == expected and res_g == expected and res_seq == expected


# ---------------------------------------------------------------------------------- schedule
def test_cubic_schedule():
    kw = dict(initial=0.0, final=0.8, start=10, n_steps=4, frequency=5)
    assert cubic_sparsity(0, **kw) == 0.0
    assert cubic_sparsity(10, **kw) == 0.0
    assert cubic_sparsity(30, **kw) == pytest.approx(0.8)
    assert cubic_sparsity(100, **kw) == pytest.approx(0.8)
    assert cubic_sparsity(20, **kw) == pytest.approx(0.8 + (0.0 - 0.8) * 0.5**3)
    vals = [cubic_sparsity(t, **kw) for t in range(10, 31, 5)]
    assert vals == sorted(vals)


# ---------------------------------------------------------------------------------- PrunableLinear
def test_prunable_linear_keeps_parameters_and_function():
    torch.manual_seed(0)
    block = Block(GPTConfig.preset("tiny"))
    params = {n: p for n, p in block.named_parameters()}
    x = torch.randn(2, 5, 32)
    ref = block(x)
    assert make_prunable(block) == 4
    assert make_prunable(block) == 0  # idempotent
    assert all(isinstance(m, PrunableLinear) for m in (block.attn.qkv, block.attn.proj, block.mlp.fc, block.mlp.proj))
    assert {n: p for n, p in block.named_parameters()} == params  # the very same Parameter objects
    assert torch.equal(block(x), ref)  # all-ones mask: bitwise identical
    assert "attn.qkv.weight_mask" in block.state_dict()


@pytest.mark.parametrize("sparse", [False, True])
def test_prunable_linear_mask_and_kernel(sparse):
    if sparse and not sparse_kernels_available():
        pytest.skip("sparse-kernel extension not available")
    torch.manual_seed(0)
    lin = PrunableLinear(24, 16)
    mask = torch.rand(16, 24) > 0.7
    lin.set_mask(mask)
    assert torch.all(lin.weight[~mask] == 0)
    dense = nn.Linear(24, 16)
    dense.load_state_dict({"weight": lin.weight.detach() * mask, "bias": lin.bias.detach()})
    lin.set_sparse_kernel(sparse)
    x = torch.randn(3, 7, 24, requires_grad=True)
    y = lin(x)
    y2 = dense(x)
    torch.testing.assert_close(y, y2, rtol=1e-5, atol=1e-6)
    y.square().sum().backward()
    assert torch.all(lin.weight.grad[~mask] == 0)
    gx = x.grad.clone()
    x.grad = None
    y2.square().sum().backward()
    torch.testing.assert_close(lin.weight.grad, dense.weight.grad * mask, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx, x.grad, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------- early exit
CFG = GPTConfig.preset("tiny")


def _batch(b=3, t=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, t), generator=g), torch.randint(0, 256, (b, t), generator=g)


@pytest.mark.parametrize("threshold", [None, 1.0, 1.5])
def test_early_exit_unreachable_threshold_equals_gpt(threshold):
    plain = GPT(CFG, seed=3)
    model = EarlyExitGPT(CFG, exit_threshold=threshold)  # different init ...
    model.load_state_dict(plain.state_dict())  # ... same parameters
    x, y = _batch()
    for m in (plain, model):
        m.train()
    lp = plain.pipeline_loss(plain(x), y)
    le = model.pipeline_loss(model(x), y)
    assert torch.equal(plain(x), model(x)) and torch.equal(lp, le)
    lp.backward()
    le.backward()
    gp = dict(plain.named_parameters())
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, gp[n].grad), n
    # same seed: same init, and the caller's RNG stream is untouched by the extra construction
    torch.manual_seed(11)
    a = EarlyExitGPT(CFG, seed=3)
    after_a = torch.rand(1)
    torch.manual_seed(11)
    GPT(CFG, seed=3)
    assert torch.equal(after_a, torch.rand(1))
    for (n1, p1), (n2, p2) in zip(a.named_parameters(), plain.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)


def test_every_layer_passes_the_hidden_state_and_the_exit_flag():
    model = EarlyExitGPT(CFG, seed=0, exit_threshold=0.5)
    x, _ = _batch()
    h = (x,)
    for i, layer in enumerate(model.pipeline_layers()):
        h = layer(*h)
        if 0 <= i < CFG.n_layer + 1:  # embedding and blocks: (hidden state, flag), the flag without gradient
            x_i, flag = h
            assert x_i.shape == (3, 16, CFG.n_embd) and flag.shape == (3, 16) and not flag.requires_grad
            assert set(flag.unique().tolist()) <= {0.0, 1.0}
        else:
            h = (h,)
    assert h[0].shape == (3, 16, CFG.vocab_size)


def test_exited_tokens_skip_the_block():
    torch.manual_seed(0)
    block = ExitBlock(CFG).eval()
    x = torch.randn(2, 16, CFG.n_embd)
    active = torch.zeros(2, 16, dtype=torch.bool)
    active[0, [0, 3, 4, 9]] = True
    active[1, [2, 5, 6, 7, 8, 15]] = True
    with FlopCounterMode(display=False) as full:
        out_full, _ = block(x, torch.ones(2, 16))
    block.reset_counters()
    with FlopCounterMode(display=False) as part:
        out, flag = block(x, active.float())
    # cost follows the active tokens: 6 packed rows of 16 instead of 16
    assert block.tokens_seen == 32 and block.tokens_active == 10 and block.tokens_computed == 2 * 6
    assert part.get_total_flops() < 0.5 * full.get_total_flops()
    # exited tokens carry their hidden state unchanged, the flag is passed on
    assert torch.equal(out[~active], x[~active])
    assert torch.equal(flag, active.float())
    # active tokens: the block applied to the sequence of active tokens alone (causal among them)
    plain = Block(CFG).eval()
    plain.load_state_dict(block.state_dict())
    for r in range(2):
        pos = active[r].nonzero().flatten()
        ref = plain(x[r : r + 1, pos])
        torch.testing.assert_close(out[r, pos], ref[0], rtol=1e-5, atol=1e-6)
    assert torch.equal(out_full, plain(x))
    # nobody active: identity, no compute
    block.reset_counters()
    with FlopCounterMode(display=False) as none:
        out0, _ = block(x, torch.zeros(2, 16))
    assert none.get_total_flops() == 0 and block.tokens_computed == 0 and torch.equal(out0, x)


def test_exit_decision_and_gradients():
    model = EarlyExitGPT(CFG, seed=0, exit_layers=[0, 1], exit_threshold=-1.0)  # everyone leaves after block 0
    x, y = _batch()
    h = model.layers[0](x)
    _, flag = model.layers[1](*h)
    assert torch.all(flag == 0)
    model.layers[1].reset_counters()
    loss = model.pipeline_loss(model(x), y)
    loss.backward()
    b0, b1 = model.layers[1], model.layers[2]
    assert b0.tokens_active == b0.tokens_seen and b1.tokens_active == 0 and b0.tokens_exited == b0.tokens_seen
    assert b0.attn.qkv.weight.grad is not None and b0.attn.qkv.weight.grad.abs().sum() > 0
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in b1.parameters())  # nobody reached it
    assert model.layers[0].wte.weight.grad.abs().sum() > 0
