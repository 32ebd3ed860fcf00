"""One GPU, one process: a GPT training step on CUDA in bf16, eager and under torch.compile.

    python scripts/gpu_train_check.py [--quick]

Why: the CPU suite never runs the model's CUDA paths (SDPA/flash kernels under autocast, fused
AdamW, inductor on a GPU). This trains the same GPT from the same seed on the same batches twice,
eager and compiled, and reports step times, tokens/s, the compile speedup and the largest loss
difference (bf16, so a tolerance of a few 1e-2). Also one hash-sparse GPT step through
FlexAttention (the CUDA route of hash-sparse attention) forward + backward. Last line: JSON.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from lightning_dynmo.models import GPT, GPTConfig


def _batches(cfg: GPTConfig, batch: int, n: int, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One random batch, n times: random tokens cannot be predicted, a repeated batch can be
    memorised, so a falling loss shows that the steps train."""
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=g).to(device)
    return [(seq[:, :-1], seq[:, 1:])] * n


def train(cfg: GPTConfig, batches, compile_model: bool, warmup: int) -> dict:
    torch.manual_seed(0)
    model = GPT(cfg, seed=0).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    step_fn = torch.compile(model) if compile_model else model
    losses, times = [], []
    for i, (x, y) in enumerate(batches):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = step_fn(x)
        loss = model.pipeline_loss(logits.float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    timed = sorted(times[warmup:])
    ms = 1e3 * timed[len(timed) // 2]
    tokens = batches[0][0].numel()
    return {"losses": losses, "ms_per_step": ms, "tokens_per_s": tokens / (ms * 1e-3),
            "first_step_s": times[0]}


def hash_sparse_step(quick: bool) -> dict:
    cfg = GPTConfig(vocab_size=256, block_size=256 if quick else 1024, n_layer=2, n_head=4, n_embd=128,
                    attention="hash_sparse", attention_block=64, nb_hash=4, attention_backend="flex")
    model = GPT(cfg, seed=0).cuda()
    x = torch.randint(0, 256, (2, cfg.block_size), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(x)
    loss = model.pipeline_loss(logits.float(), x)
    loss.backward()
    grads_finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)
    return {"loss": float(loss), "grads_finite": grads_finite}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny model: checks the script")
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"gpu": False, "skipped": "no CUDA GPU"}))
        return
    if args.quick:
        cfg, batch = GPTConfig.preset("tiny"), 4
    else:  # GPT-2 small shapes, 8 x 1024 tokens per step
        cfg, batch = GPTConfig.preset("gpt2"), 8
    torch.backends.cuda.matmul.allow_tf32 = True
    batches = _batches(cfg, batch, args.steps, "cuda")
    warmup = max(1, args.steps // 3)
    eager = train(cfg, batches, False, warmup)
    compiled = train(cfg, batches, True, warmup)
    diff = max(abs(a - b) for a, b in zip(eager["losses"], compiled["losses"]))
    out = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "model": "tiny" if args.quick else "gpt2",
        "tokens_per_step": batches[0][0].numel(),
        "eager_ms_per_step": round(eager["ms_per_step"], 2), "compiled_ms_per_step": round(compiled["ms_per_step"], 2),
        "eager_tokens_per_s": round(eager["tokens_per_s"]), "compiled_tokens_per_s": round(compiled["tokens_per_s"]),
        "compile_speedup": round(eager["ms_per_step"] / compiled["ms_per_step"], 3),
        "compile_first_step_s": round(compiled["first_step_s"], 1),
        "loss_first": round(eager["losses"][0], 4), "loss_last_eager": round(eager["losses"][-1], 4),
        "loss_last_compiled": round(compiled["losses"][-1], 4), "max_loss_diff_eager_vs_compiled": round(diff, 4),
        "losses_agree": diff < 5e-2,  # bf16: the two runs differ in rounding only
        "trains": all(r["losses"][-1] < r["losses"][0] - 0.5 for r in (eager, compiled)),
        "hash_sparse_flex": hash_sparse_step(args.quick),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
    }
    print(json.dumps(out))
    if not (out["losses_agree"] and out["trains"] and out["hash_sparse_flex"]["grads_finite"]):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
