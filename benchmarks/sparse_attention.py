"""Block-sparse causal attention (our CPU kernel) vs dense causal SDPA, forward + backward.

For each sequence length and thread count, in one process: dense
``scaled_dot_product_attention(is_causal=True)``, our kernel on random causal block layouts at
block densities 1, 1/2, 1/4, 1/8 (diagonal always in; density = active / causal block pairs),
and end-to-end hash-sparse attention (LSH + sort + gathers + kernel) at nb_hash 4 and 8.
Methods are timed round-robin (one call of each per round) so load from other processes hits
all alike; each number is the median over rounds. The kernel's time is fitted as
``a + b * density`` to report the speedup at 20 % density and the crossover density (where it
would equal dense; > 1 means faster than dense even with every causal block computed).
Prints one JSON object as the last line.

    python benchmarks/sparse_attention.py [--quick] [--threads 1 2] [--seq 1024 2048]
    python benchmarks/sparse_attention.py --device cuda [--quick]   # GPU: bf16, ours vs SDPA vs
                                                                     # flex_attention (same BlockMask)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

from _harness import round_robin
from lightning_dynmo import sparse
from lightning_dynmo.sparse import BlockLayout, block_sparse_attention
from lightning_dynmo.sparse.hash_layout import draw_rotations, hash_sparse_attention

DENSITIES = (1.0, 0.5, 0.25, 0.125)
OURS_CUDA = "ours"  # "reference" when the CUDA kernel is missing (bench_cuda)
NB_HASH = (4, 8)


def random_layout(b, h, t, bs, density, gen):
    """Causal block layout with the diagonal and each lower block kept with a probability
    chosen so that active / causal block pairs is about ``density``."""
    n = -(-t // bs)
    p = max(0.0, (density * n * (n + 1) / 2 - n) / max(1, n * (n - 1) / 2))
    mask = (torch.rand(b, h, n, n, generator=gen) < p) | torch.eye(n, dtype=torch.bool)
    return BlockLayout.from_block_mask(mask, bs, t)


def _step(fn, q, k, v, g):
    def run():
        for x in (q, k, v):
            x.grad = None
        fn(q, k, v).backward(g)
    return run


def _fit(points):
    """Least squares t = a + b d over (density, ms) points."""
    n = len(points)
    md = sum(d for d, _ in points) / n
    mt = sum(t for _, t in points) / n
    b = sum((d - md) * (t - mt) for d, t in points) / max(1e-12, sum((d - md) ** 2 for d, _ in points))
    return mt - b * md, b


def bench(t, threads, args, rounds):
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(t)
    b, h, d, bs = args.batch, args.heads, args.head_dim, args.block
    q, k, v = (torch.randn(b, h, t, d, generator=gen).requires_grad_() for _ in range(3))
    g = torch.randn(b, h, t, d, generator=gen)
    fns = {"dense": _step(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v, g)}
    density = {}
    for target in DENSITIES:
        layout = random_layout(b, h, t, bs, target, gen)
        layout.transposed()  # the layout is given; its transpose is cached like the model would
        density[f"kernel@{target:g}"] = layout.density()
        fns[f"kernel@{target:g}"] = _step(lambda q, k, v, lay=layout: block_sparse_attention(q, k, v, lay), q, k, v, g)
    for nb in NB_HASH:
        rot = draw_rotations(h, d, nb, torch.Generator().manual_seed(nb))
        _, plan = hash_sparse_attention(q.detach(), k.detach(), v.detach(), rot, nb, bs)
        density[f"hash@nb{nb}"] = plan.density
        fns[f"hash@nb{nb}"] = _step(lambda q, k, v, rot=rot, nb=nb: hash_sparse_attention(q, k, v, rot, nb, bs)[0],
                                    q, k, v, g)
    ms = round_robin(fns, rounds)
    rows = []
    for name, value in ms.items():
        if name == "dense":
            continue
        rows.append({"seq": t, "threads": threads, "method": name, "density": round(density[name], 4),
                     "ms": round(value, 2), "dense_ms": round(ms["dense"], 2),
                     "speedup_vs_dense": round(ms["dense"] / value, 2)})
        print(json.dumps(rows[-1]), flush=True)
    a, slope = _fit([(r["density"], r["ms"]) for r in rows if r["method"].startswith("kernel")])
    summary = {"seq": t, "threads": threads, "dense_ms": round(ms["dense"], 2),
               "speedup_vs_dense_at_20": round(ms["dense"] / (a + 0.2 * slope), 2),
               "crossover_density": round((ms["dense"] - a) / slope, 2) if slope > 0 else None}
    print(json.dumps(summary), flush=True)
    return rows, summary


def _cuda_round_robin(fns: dict, rounds: int) -> dict:
    for fn in fns.values():  # warm-up (and compilation)
        fn()
        fn()
    torch.cuda.synchronize()
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times[k].append(start.elapsed_time(end))
    return {k: statistics.median(v) for k, v in times.items()}


def bench_cuda(args, rounds):
    global OURS_CUDA
    dev = torch.device("cuda")
    if not sparse.attention_kernel_available("cuda", torch.bfloat16, args.block):
        OURS_CUDA = "reference"
        print(f"WARNING: no CUDA attention kernel ({sparse._ops.cuda_kernels_missing_reason()}); the "
              "'kernel' backend is the dense masked reference and is reported as 'reference', not 'ours'")
    rows, summaries = [], []
    b, h, d, bs = args.batch, args.heads, args.head_dim, args.block
    for t in args.seq:
        gen = torch.Generator().manual_seed(t)
        q, k, v = (torch.randn(b, h, t, d, generator=gen).to(dev, torch.bfloat16).requires_grad_() for _ in range(3))
        g = torch.randn(b, h, t, d, generator=gen).to(dev, torch.bfloat16)
        fns = {"dense": _step(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v, g)}
        density = {}
        for target in DENSITIES:
            layout = random_layout(b, h, t, bs, target, gen).to(dev)
            layout.transposed()
            density[f"{OURS_CUDA}@{target:g}"] = density[f"flex@{target:g}"] = layout.density()
            # our CUDA kernel vs the route "auto" takes on CUDA (lightning_dynmo.sparse.flex: the
            # same attention as FlexAttention with a BlockMask of 128-slot tiles)
            # backend="kernel" without our CUDA kernel is the dense masked reference: never "ours"
            for name, backend in ((OURS_CUDA, "kernel"), ("flex", "flex")):
                fns[f"{name}@{target:g}"] = _step(
                    lambda q, k, v, lay=layout, be=backend: block_sparse_attention(q, k, v, lay, backend=be), q, k, v, g)
        ms = _cuda_round_robin(fns, rounds)
        for name, value in ms.items():
            if name == "dense":
                continue
            rows.append({"seq": t, "method": name, "density": round(density[name], 4), "ms": round(value, 3),
                         "dense_ms": round(ms["dense"], 3), "speedup_vs_dense": round(ms["dense"] / value, 2)})
            print(json.dumps(rows[-1]), flush=True)
        summaries.append({"seq": t, "dense_ms": round(ms["dense"], 3),
                          f"{OURS_CUDA}_vs_flex": {f"{d:g}": round(ms[f"flex@{d:g}"] / ms[f"{OURS_CUDA}@{d:g}"], 2)
                                                   for d in DENSITIES}})
        print(json.dumps(summaries[-1]), flush=True)
    return {"device": torch.cuda.get_device_name(), "dtype": "bfloat16", "torch": torch.__version__,
            "kernel": OURS_CUDA,
            "quick": args.quick, "rounds": rounds,
            "shape": {"batch": b, "heads": h, "head_dim": d, "block": bs}, "seq": args.seq,
            "summaries": summaries,
            "ratios": {f"T{r['seq']}/{r['method']}": r["speedup_vs_dense"] for r in rows}, "results": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds")
    ap.add_argument("--threads", type=int, nargs="+", default=None,
                    help="thread counts (default: 1 and all cores)")
    ap.add_argument("--seq", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = ap.parse_args()
    if args.device == "cuda":
        start = time.perf_counter()
        result = bench_cuda(args, args.rounds or (5 if args.quick else 20))
        result["seconds"] = round(time.perf_counter() - start, 1)
        print(json.dumps(result))
        return
    threads = args.threads or sorted({1, len(os.sched_getaffinity(0))})
    rounds = args.rounds or (3 if args.quick else 9)
    if not sparse.attention_kernel_available("cpu", torch.float32, args.block):  # never time the fallback as ours
        sys.exit(f"attention kernels missing ({sparse._ops.import_failure_cause('_C_cpu', sparse.extension_error())}); "
                 "block_sparse_attention would run the dense reference path, which is not our kernel")
    start = time.perf_counter()
    rows, summaries = [], []
    for th in threads:
        for t in args.seq:
            r, s = bench(t, th, args, rounds)
            rows += r
            summaries.append(s)
    longest = max(args.seq)
    at = {s["threads"]: s for s in summaries if s["seq"] == longest}
    result = {
        "device": "cpu", "cpu": platform.processor() or platform.machine(),
        "isa": sparse._ops._C.cpu_isa() if sparse.extension_available() else None,
        "torch": torch.__version__, "quick": args.quick, "rounds": rounds,
        "shape": {"batch": args.batch, "heads": args.heads, "head_dim": args.head_dim, "block": args.block},
        "threads": threads, "seq": args.seq,
        # headline: the longest sequence, one thread and all threads
        "speedup_vs_dense_at_20": {th: s["speedup_vs_dense_at_20"] for th, s in at.items()},
        "crossover_density": {th: s["crossover_density"] for th, s in at.items()},
        "summaries": summaries,
        "ratios": {f"T{r['seq']}/th{r['threads']}/{r['method']}": r["speedup_vs_dense"] for r in rows},
        "results": rows,
        "seconds": round(time.perf_counter() - start, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
