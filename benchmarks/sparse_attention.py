"""Block-sparse causal attention (our CPU kernel) vs dense causal SDPA, forward + backward.

For each sequence length and thread count, in one process: dense
``scaled_dot_product_attention(is_causal=True)``, our kernel on random causal block layouts at
block densities 1, 1/2, 1/4, 1/8 (diagonal always in; density = active / causal block pairs),
and end-to-end hash-sparse attention (LSH + sort + gathers + kernel) at nb_hash 4 and 8.
Methods are timed round-robin (one call of each per round) so load from other processes hits
all alike; each number is the median over rounds. Dense runs twice (``dense_control``): the two
medians' spread is the run's noise floor. The kernel's time is fitted as
``a + b * density`` to report the speedup at 20 % density and the crossover density (where it
would equal dense; > 1 means faster than dense even with every causal block computed).
Prints one JSON object as the last line.

    python benchmarks/sparse_attention.py [--quick] [--threads 1 2] [--seq 1024 2048]
    python benchmarks/sparse_attention.py --device cuda [--quick]
    python benchmarks/sparse_attention.py --smoke [--device cuda]   # seconds: seq 128 (CUDA: 512), 2 heads, 1 round

On CUDA (bf16, seq 4096, 16 heads, head_dim 64, 128-blocks, batch 1): forward+backward of our
route -- ``block_sparse_attention(backend="auto")``, which takes FlexAttention or our kernel,
whichever it measured faster, with the layout's BlockMask built once -- at block densities
1, 1/2, 1/4, 1/8, against dense causal SDPA and SDPA again (the control). CUDA events,
round-robin, medians. The JSON names the route taken; the dense masked reference is reported as
"reference", never as "ours". At batch 1 the eager calls are bound by the host (Python and launches:
see ``host_issue_vs_total_ms``), so SDPA and our route at densities 1 and 1/8 are also captured in
CUDA graphs and replayed (``cuda_graph``): the device-bound figure a model step reaches when it is
graphed or queues enough work ahead. ``--batch`` scales the work per call. ``docs/benchmarks.md``
says how to read it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from _cuda_timing import cuda_round_robin, graphed_round_robin
from _harness import round_robin
from lightning_dynmo import sparse
from lightning_dynmo.sparse import BlockLayout, block_sparse_attention
from lightning_dynmo.sparse.hash_layout import draw_rotations, hash_sparse_attention

DENSITIES = (1.0, 0.5, 0.25, 0.125)
NB_HASH = (4, 8)
#: keys the last JSON line always has on CPU (tests/unit/test_benchmarks_smoke.py checks them on ``--smoke``)
RESULT_KEYS = ("device", "torch", "rounds", "shape", "threads", "seq", "speedup_vs_dense_at_20", "crossover_density",
               "noise_floor", "summaries", "ratios", "results", "seconds")


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
    dense = _step(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v, g)
    fns = {"dense": dense, "dense_control": dense}  # the same thing twice: the run's noise floor
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
        if name in ("dense", "dense_control"):
            continue
        rows.append({"seq": t, "threads": threads, "method": name, "density": round(density[name], 4),
                     "ms": round(value, 2), "dense_ms": round(ms["dense"], 2),
                     "speedup_vs_dense": round(ms["dense"] / value, 2)})
        print(json.dumps(rows[-1]), flush=True)
    a, slope = _fit([(r["density"], r["ms"]) for r in rows if r["method"].startswith("kernel")])
    summary = {"seq": t, "threads": threads, "dense_ms": round(ms["dense"], 2),
               "dense_control_ms": round(ms["dense_control"], 2),
               # |dense_control / dense - 1|: a speedup closer to 1 than this is noise
               "noise_floor": round(abs(ms["dense_control"] / ms["dense"] - 1), 3),
               "speedup_vs_dense_at_20": round(ms["dense"] / (a + 0.2 * slope), 2),
               "crossover_density": round((ms["dense"] - a) / slope, 2) if slope > 0 else None}
    print(json.dumps(summary), flush=True)
    return rows, summary


def _mask_build_ms(layout, t, repeats=20):
    """One uncached BlockMask build (what every call paid before the mask was kept on the layout)."""
    from lightning_dynmo.sparse.flex import flex_block_mask

    valid = (torch.arange(t, device=layout.device) < t).expand(layout.batch, layout.heads, t)
    flex_block_mask(layout, valid)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        flex_block_mask(layout, valid)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _host_issue_ms(fn, calls: int = 20) -> dict:
    """{issue, total}: ms per call to issue ``calls`` back-to-back calls, and until the GPU is done."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return {"issue": round((t1 - t0) * 1e3 / calls, 4), "total": round((t2 - t0) * 1e3 / calls, 4)}


def bench_cuda(args, rounds):
    """bf16 forward+backward of our route (``backend="auto"``) at each block density against dense
    causal SDPA, and SDPA again as the control (their ratio is the noise floor)."""
    from lightning_dynmo.sparse.attention import auto_route
    from lightning_dynmo.sparse.backend_choice import attention_choices, choice_key

    dev = torch.device("cuda", torch.cuda.current_device())
    b, h, d, bs = args.batch, args.heads, args.head_dim, args.block
    t = max(args.seq)
    gen = torch.Generator().manual_seed(t)
    q, k, v = (torch.randn(b, h, t, d, generator=gen).to(dev, torch.bfloat16).requires_grad_() for _ in range(3))
    g = torch.randn(b, h, t, d, generator=gen).to(dev, torch.bfloat16)
    sdpa = _step(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v, g)
    fns = {"sdpa": sdpa, "sdpa_control": sdpa}  # the same thing twice: the noise floor
    layouts, density = {}, {}
    for target in DENSITIES:
        layouts[target] = layout = random_layout(b, h, t, bs, target, gen).to(dev)
        density[target] = round(layout.density(), 4)
        fns[f"auto@{target:g}"] = _step(lambda q, k, v, lay=layout: block_sparse_attention(q, k, v, lay), q, k, v, g)
    fns["auto@1"]()  # the first call measures the candidates ("auto") and compiles; outside the timing
    route = auto_route(dev, torch.bfloat16, t, bs, d)
    if route == "kernel" and not args.quick:  # our kernel beside flex, for the record
        for target, layout in layouts.items():
            fns[f"flex@{target:g}"] = _step(lambda q, k, v, lay=layout: block_sparse_attention(q, k, v, lay, backend="flex"),
                                            q, k, v, g)
    elif not args.quick and sparse.attention_kernel_available(dev, torch.bfloat16, bs):
        for target, layout in layouts.items():
            fns[f"kernel@{target:g}"] = _step(
                lambda q, k, v, lay=layout: block_sparse_attention(q, k, v, lay, backend="kernel"), q, k, v, g)
    if route == "flex":  # the compiled flex call alone, on the same cached BlockMask: our wrapper's cost
        from lightning_dynmo.sparse.flex import _flex_fn, cached_block_mask
        flex = _flex_fn(dev)
        for target in (DENSITIES[0], DENSITIES[-1]):
            lay = layouts[target]
            fns[f"flex_raw@{target:g}"] = _step(
                lambda q, k, v, lay=lay: flex(q, k, v, block_mask=cached_block_mask(lay, dev, t, t), scale=d ** -0.5),
                q, k, v, g)
    ms = cuda_round_robin(fns, rounds)
    host = {name: _host_issue_ms(fns[name]) for name in ("sdpa", f"auto@{DENSITIES[-1]:g}",
                                                          f"flex_raw@{DENSITIES[-1]:g}") if name in fns}
    graphed = {}
    if not args.no_graphs:  # the same calls with the host taken out (_cuda_timing.cuda_graph_of)
        cands = {"sdpa": sdpa, "sdpa_control": sdpa}
        for target in (DENSITIES[0], DENSITIES[-1]):
            cands[f"auto@{target:g}"] = fns[f"auto@{target:g}"]
        graphed = graphed_round_robin(cands, rounds, probe=lambda: q.grad)
        got = graphed["ms"]
        if "sdpa" in got and "sdpa_control" in got:
            graphed["noise_floor"] = round(got["sdpa"] / got["sdpa_control"], 3)
        graphed["speedup_vs_sdpa_fwd_bwd"] = {
            name.split("@")[1]: round(got["sdpa"] / value, 2)
            for name, value in got.items() if name.startswith("auto@") and "sdpa" in got}
    ours = "ours" if route in ("flex", "kernel") else "reference"  # the dense masked fallback is never "ours"
    if ours == "reference":
        print(f"WARNING: backend='auto' ran the dense masked reference on CUDA "
              f"({sparse._ops.cuda_kernels_missing_reason()}); reported as 'reference', not 'ours'")
    rows = []
    for name, value in ms.items():
        rows.append({"method": name.replace("auto@", f"{ours}@"), "ms": round(value, 4),
                     "speedup_vs_sdpa_fwd_bwd": round(ms["sdpa"] / value, 2)})
        print(json.dumps(rows[-1]), flush=True)
    speedup = {f"{x:g}": round(ms["sdpa"] / ms[f"auto@{x:g}"], 2) for x in DENSITIES}
    times = [ms[f"auto@{x:g}"] for x in DENSITIES]
    built = _mask_build_ms(layouts[DENSITIES[-1]], t)
    lowest = ms[f"auto@{DENSITIES[-1]:g}"]
    key = choice_key("layout", dev, torch.bfloat16, t, bs, d)
    return {
        "device": torch.cuda.get_device_name(), "dtype": "bfloat16", "torch": torch.__version__, "quick": args.quick,
        "rounds": rounds, "shape": {"batch": b, "heads": h, "seq": t, "head_dim": d, "block": bs},
        "route": route if ours == "ours" else "reference",  # what backend="auto" ran: flex | kernel | reference
        "auto_measured_ms": attention_choices().get(key, {}).get("ms") or None,  # None: one candidate, no race
        "block_density": {f"{x:g}": density[x] for x in DENSITIES},
        "sdpa_ms": round(ms["sdpa"], 4), "sdpa_control_ms": round(ms["sdpa_control"], 4),
        "noise_floor": round(ms["sdpa"] / ms["sdpa_control"], 3),
        f"{ours}_ms": {f"{x:g}": round(ms[f"auto@{x:g}"], 4) for x in DENSITIES},
        ("speedup_vs_sdpa_fwd_bwd" if ours == "ours" else "reference_speedup_vs_sdpa_fwd_bwd"): speedup,
        "time_falls_with_density": all(a > b for a, b in zip(times, times[1:])),
        "target_2x_at_0.125_met": ours == "ours" and speedup[f"{DENSITIES[-1]:g}"] >= 2.0,
        # the per-call BlockMask build that the layout cache removes, against the cached call
        "mask_build_ms": round(built, 4), "mask_build_share_if_uncached": round(built / (built + lowest), 3),
        # host (Python + launch) ms per call and device-bound ms per call over back-to-back calls: where
        # issue ~ total, the GPU waits for the host and the kernel's speed does not show
        "host_issue_vs_total_ms": host,
        # the same forward+backward replayed from a CUDA graph (host work taken out): the device-bound
        # speedup; "failed" names a call that could not be captured, with why
        "cuda_graph": {**graphed, "route": route if ours == "ours" else "reference"} if graphed else None,
        "results": rows,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds")
    ap.add_argument("--smoke", action="store_true",
                    help="one short sequence, 2 heads, one round, 1 thread: checks that the script runs")
    ap.add_argument("--threads", type=int, nargs="+", default=None,
                    help="thread counts (default: 1 and all cores)")
    ap.add_argument("--seq", type=int, nargs="+", default=None, help="CPU: 1024 2048; CUDA: 4096 (the longest one)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=None, help="CPU: 8; CUDA: 16")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block", type=int, default=None, help="CPU: 64; CUDA: 128 (FlexAttention's tile)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--no-graphs", action="store_true",
                    help="CUDA: skip the CUDA-graph replay timings (the host-free figure)")
    args = ap.parse_args()
    on_cuda = args.device == "cuda"
    if args.smoke:  # CUDA: long enough for four 128-blocks at every density
        args.seq, args.heads, args.rounds = args.seq or [512 if on_cuda else 128], args.heads or 2, args.rounds or 1
        args.threads, args.block, args.quick = args.threads or [1], args.block or (128 if on_cuda else 32), True
    args.seq = args.seq or ([4096] if on_cuda else [1024, 2048])
    args.heads = args.heads or (16 if on_cuda else 8)
    args.block = args.block or (128 if on_cuda else 64)
    if on_cuda:
        if not torch.cuda.is_available():
            if args.smoke:
                print(json.dumps({"device": "cuda", "skipped": "no CUDA", "smoke": True}))
                return
            sys.exit("--device cuda: no CUDA GPU here")
        start = time.perf_counter()
        result = bench_cuda(args, args.rounds or (20 if args.quick else 100))
        result["seconds"] = round(time.perf_counter() - start, 1)
        result["smoke"] = args.smoke
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
        "torch": torch.__version__, "quick": args.quick, "smoke": args.smoke, "rounds": rounds,
        "shape": {"batch": args.batch, "heads": args.heads, "head_dim": args.head_dim, "block": args.block},
        "threads": threads, "seq": args.seq,
        # headline: the longest sequence, one thread and all threads
        "speedup_vs_dense_at_20": {th: s["speedup_vs_dense_at_20"] for th, s in at.items()},
        "crossover_density": {th: s["crossover_density"] for th, s in at.items()},
        "noise_floor": {th: s["noise_floor"] for th, s in at.items()},
        "summaries": summaries,
        "ratios": {f"T{r['seq']}/th{r['threads']}/{r['method']}": r["speedup_vs_dense"] for r in rows},
        "results": rows,
        "seconds": round(time.perf_counter() - start, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
