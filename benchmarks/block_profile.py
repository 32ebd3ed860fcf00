"""Measure one GPT block's per-layer cost profile at the DynMo paper's scale (appendix A).

    python benchmarks/block_profile.py [--device cuda] [--out profile.json] [--quick]
    python benchmarks/block_profile.py --smoke     # seconds: tiny shapes, one repeat, on CUDA if there is one

The paper's GPT: hidden 1024, 32 heads, sequence 2048, micro-batch 2 (GPT-2 vocabulary, padded
to 50304 as in nanoGPT/Megatron). This script times, with device events (median of repeats after
warm-up), the layers that the simulator's scenarios (``lightning_dynmo.sim.scenarios``) are
built from:

* ``block``: one pre-LN transformer block (this package's ``Block``: LN, QKV, causal SDPA, proj,
  LN, 4x GELU MLP) forward and backward at token fractions ``f`` of the sequence (the block runs
  on the ``f T`` packed tokens, as early exit and mixture-of-depths blocks do); backward with the
  input gradient (a middle block) and weight gradients only (the first trainable block after a
  frozen prefix);
* ``attention_core``: causal scaled-dot-product attention alone at the same fractions (its share
  of the block, and how it scales with T^2);
* ``mlp``: LN + MLP alone at token counts (the work of one MoE expert that receives n tokens);
* ``embedding`` (token + position), ``final_norm``, ``head_loss`` (LM head + fp32 cross-entropy).

Every time is milliseconds per micro-batch. The last line of output is the JSON profile; the one
committed in ``lightning_dynmo/sim/scenarios/profiles/`` came from this script on an H100 (see its
``device`` field).
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from pathlib import Path


FRACTIONS = (1.0, 0.75, 0.5, 0.375, 0.25, 0.1875, 0.125, 0.0625)
MLP_TOKENS = (512, 1024, 2048, 4096, 6144, 8192, 12288, 16384, 24576, 32768)
#: keys the last JSON line always has (tests/unit/test_benchmarks_smoke.py checks them on ``--smoke``)
RESULT_KEYS = ("device", "dtype", "hidden", "seq", "block", "attention_core", "mlp", "embedding", "final_norm",
               "head_loss", "params", "not_graphed", "seconds")


def _modules():
    """This package's GPT layers (the ones training uses)."""
    from lightning_dynmo.models.gpt import Block, Embedding, FinalNorm, GPTConfig, Head

    return Block, Embedding, FinalNorm, GPTConfig, Head


class Timer:
    def __init__(self, device, warmup: int, reps: int):
        import torch

        self.torch, self.device, self.warmup, self.reps = torch, device, warmup, reps

    def __call__(self, setup, run) -> float:
        """Median ms of ``run(state)``; ``setup()`` (untimed) makes a fresh state each repeat."""
        torch = self.torch
        times = []
        for i in range(self.warmup + self.reps):
            state = setup()
            if self.device.type == "cuda":
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                run(state)
                b.record()
                torch.cuda.synchronize()
                ms = a.elapsed_time(b)
            else:
                t0 = time.perf_counter()
                run(state)
                ms = (time.perf_counter() - t0) * 1e3
            if i >= self.warmup:
                times.append(ms)
        return statistics.median(times)


NOT_GRAPHED: list[str] = []  # measurements that could not be captured as CUDA graphs (eager times)
_GENERATORS: dict = {}


def randn(*shape, device, dtype, requires_grad=False):
    """Inputs from a private generator: a CUDA-graph capture that fails (recorded in NOT_GRAPHED)
    leaves the default CUDA generator mid-capture ("Offset increment outside graph capture"), and
    the eager measurements after it must still be able to draw inputs (torch 2.11, H200)."""
    import torch

    key = str(device)
    if key not in _GENERATORS:
        _GENERATORS[key] = torch.Generator(device=device).manual_seed(0)
    return torch.randn(tuple(shape), device=device, dtype=dtype, generator=_GENERATORS[key], requires_grad=requires_grad)


class _WithLoss:
    """``module`` followed by ``loss_fn`` as one callable module (what gets graphed)."""

    @staticmethod
    def wrap(module, loss_fn):
        import torch

        if loss_fn is None:
            return module

        class Wrapped(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = module

            def forward(self, x):
                return loss_fn(self.inner(x))

        return Wrapped()


def fwd_bwd(timer, module, make_input, needs_input_grad=True, loss_fn=None, graphed=True):
    """(forward ms, backward ms) of ``module`` (then ``loss_fn``) on a fresh input each repeat.

    On CUDA with ``graphed`` the forward and the backward are each captured once as a CUDA graph
    (``torch.cuda.make_graphed_callables``) and replayed: the times are the device's kernel time,
    without Python's kernel-launch overhead (which at these sizes is as long as the kernels and
    would hide how work scales with tokens). Eager times are kept beside them in the profile."""
    torch = timer.torch
    fn = _WithLoss.wrap(module, loss_fn)
    if graphed and timer.device.type == "cuda":
        try:  # on a copy: graphing replaces the module's forward in place
            fn = torch.cuda.make_graphed_callables(copy.deepcopy(fn), (make_input(needs_input_grad),))
        except Exception as err:  # noqa: BLE001 -- measured eagerly instead, and said so
            NOT_GRAPHED.append(f"{type(module).__name__}: {type(err).__name__}: {err}"[:300])

    def bsetup():
        y = fn(make_input(needs_input_grad))
        return y, randn(*y.shape, device=y.device, dtype=y.dtype)

    def brun(state):
        y, g = state
        y.backward(g)

    fw = timer(lambda: make_input(needs_input_grad), lambda x: fn(x))
    bw = timer(bsetup, brun)
    module.zero_grad(set_to_none=True)
    return fw, bw


def measure(device_name: str, quick: bool, smoke: bool = False) -> dict:
    import torch
    import torch.nn.functional as F

    Block, Embedding, FinalNorm, GPTConfig, Head = _modules()
    device = torch.device(device_name)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hidden, heads, seq, mb, vocab = 1024, 32, 2048, 2, 50304
    mlp_tokens = MLP_TOKENS
    if quick:  # a short run of the script itself, not a profile
        hidden, heads, seq, vocab = 128, 4, 256, 512
    if smoke:  # the smallest run that goes through every measurement
        hidden, heads, seq, vocab, quick, mlp_tokens = 32, 2, 32, 64, True, (16, 32, 64)
    timer = Timer(device, warmup=1 if smoke else 2 if quick else 5, reps=1 if smoke else 3 if quick else 20)
    cfg = GPTConfig(vocab_size=vocab, block_size=seq, n_layer=1, n_head=heads, n_embd=hidden, dropout=0.0)
    torch.manual_seed(0)
    block = Block(cfg).to(device, dtype)
    out: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "dtype": str(dtype).replace("torch.", ""),
        "hidden": hidden, "heads": heads, "seq": seq, "micro_batch": mb, "vocab": vocab, "mlp_ratio": 4,
        "units": "milliseconds per micro-batch (median of repeats, after warm-up)",
    }

    def act(tokens):
        return lambda grad: randn(mb, tokens, hidden, device=device, dtype=dtype, requires_grad=grad)

    class Core(torch.nn.Module):
        """Causal attention alone: [mb, t, 3C] (q|k|v) -> [mb, t, C], as inside the block."""

        def forward(self, qkv):
            b, t, _ = qkv.shape
            q, k, v = (z.view(b, t, heads, hidden // heads).transpose(1, 2) for z in qkv.split(hidden, dim=2))
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, hidden)

    core = Core()
    rows = {"fractions": [], "forward_ms": [], "backward_ms": [], "backward_weights_only_ms": [],
            "eager_forward_ms": [], "eager_backward_ms": []}
    attn = {"fractions": [], "forward_ms": [], "backward_ms": []}
    for f in FRACTIONS[:3] if quick else FRACTIONS:
        t = max(1, round(f * seq))
        fw, bw = fwd_bwd(timer, block, act(t))
        _, bw_w = fwd_bwd(timer, block, act(t), needs_input_grad=False)
        efw, ebw = fwd_bwd(timer, block, act(t), graphed=False)
        rows["eager_forward_ms"].append(efw)
        rows["eager_backward_ms"].append(ebw)
        rows["fractions"].append(f)
        rows["forward_ms"].append(fw)
        rows["backward_ms"].append(bw)
        rows["backward_weights_only_ms"].append(bw_w)
        afw, abw = fwd_bwd(timer, core, lambda grad, t=t: randn(mb, t, 3 * hidden, device=device, dtype=dtype,
                                                             requires_grad=grad))
        attn["fractions"].append(f)
        attn["forward_ms"].append(afw)
        attn["backward_ms"].append(abw)
    out["block"], out["attention_core"] = rows, attn

    ln_mlp = torch.nn.Sequential(block.ln_2, block.mlp)
    mlp = {"tokens": [], "forward_ms": [], "backward_ms": []}
    for n in mlp_tokens[:3] if quick else mlp_tokens:
        fw, bw = fwd_bwd(timer, ln_mlp, lambda grad, n=n: randn(1, n, hidden, device=device, dtype=dtype,
                                                              requires_grad=grad))
        mlp["tokens"].append(n)
        mlp["forward_ms"].append(fw)
        mlp["backward_ms"].append(bw)
    out["mlp"] = mlp
    del block, ln_mlp

    emb = Embedding(cfg).to(device, dtype)
    idx = torch.randint(0, vocab, (mb, seq), device=device)
    fw, bw = fwd_bwd(timer, emb, lambda grad: idx, needs_input_grad=False)
    out["embedding"] = {"forward_ms": fw, "backward_ms": bw}
    norm = FinalNorm(cfg).to(device, dtype)
    fw, bw = fwd_bwd(timer, norm, act(seq))
    out["final_norm"] = {"forward_ms": fw, "backward_ms": bw}
    head = Head(cfg).to(device, dtype)
    targets = torch.randint(0, vocab, (mb * seq,), device=device)

    def ce(logits):
        return F.cross_entropy(logits.float().view(-1, vocab), targets)

    fw, bw = fwd_bwd(timer, head, act(seq), loss_fn=ce)
    out["head_loss"] = {"forward_ms": fw, "backward_ms": bw}
    out["params"] = {
        "block": sum(p.numel() for p in Block(cfg).parameters()),
        "embedding": sum(p.numel() for p in emb.parameters()),
        "final_norm": sum(p.numel() for p in norm.parameters()),
        "head": sum(p.numel() for p in head.parameters()),
    }
    out["not_graphed"] = list(NOT_GRAPHED)
    if device.type == "cuda":  # the device's dense bf16 matmul rate, for reference
        a = torch.randn(8192, 8192, device=device, dtype=dtype)
        b = torch.randn(8192, 8192, device=device, dtype=dtype)
        ms = timer(lambda: None, lambda _: a @ b)
        out["matmul_8192_tflops"] = 2 * 8192**3 / (ms * 1e-3) / 1e12
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="default: cuda (--smoke: cuda if there is one, else cpu)")
    ap.add_argument("--out", default=None, help="also write the profile JSON here")
    ap.add_argument("--quick", action="store_true", help="small shapes: checks the script, not a profile")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, one repeat: checks that the script runs")
    args = ap.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if not args.smoke or torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    prof = measure(args.device, args.quick, args.smoke)
    prof["smoke"] = args.smoke
    prof["seconds"] = round(time.perf_counter() - t0, 1)
    if args.out:
        Path(args.out).write_text(json.dumps(prof, indent=1) + "\n")
    print(json.dumps(prof))


if __name__ == "__main__":
    main()
