"""What building FlexAttention's BlockMask costs beside the attention call (CPU, forward only).

The profile behind keeping the mask on the layout (``lightning_dynmo.sparse.flex``): at the
GPU benchmark's shape (seq 4096, 16 heads, head_dim 64, 128-blocks, fp32 here), for block
densities 1 and 1/8, the median time of ``flex_block_mask`` and of a compiled FlexAttention
forward with a prebuilt mask, the build's share of a call that builds it, and how many top-level
aten ops one build runs (each one a kernel launch on a GPU). FlexAttention has no CPU backward,
so this is forward only; ``benchmarks/sparse_attention.py --device cuda`` reports the build's
share on a GPU. One JSON object on the last line.

    python benchmarks/flex_mask_build.py [--quick]
    python benchmarks/flex_mask_build.py --smoke     # seconds (most of it the compile): seq 256, 2 heads
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from lightning_dynmo.sparse import BlockLayout
from lightning_dynmo.sparse.flex import flex_available, flex_block_mask

#: keys the last JSON line always has (tests/unit/test_benchmarks_smoke.py checks them on ``--smoke``)
RESULT_KEYS = ("device", "torch", "threads", "shape", "results", "seconds")


def random_layout(b, h, t, bs, density, gen):
    n = -(-t // bs)
    p = max(0.0, (density * n * (n + 1) / 2 - n) / max(1, n * (n - 1) / 2))
    return BlockLayout.from_block_mask((torch.rand(b, h, n, n, generator=gen) < p) | torch.eye(n, dtype=torch.bool), bs, t)


def median_ms(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="seq 256, 2 heads, one repeat: checks that the script runs")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if args.smoke:
        args.seq, args.heads = 256, 2
    if not flex_available():
        raise SystemExit(f"torch {torch.__version__} has no flex_attention")
    from torch.nn.attention.flex_attention import flex_attention

    torch.set_num_threads(args.threads)
    compiled = torch.compile(flex_attention, dynamic=False)
    b, h, t, d, bs = 1, args.heads, args.seq, 64, 128
    repeats = 1 if args.smoke else 3 if args.quick else 7
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, t, d, generator=gen) for _ in range(3))
    valid = torch.ones(b, h, t, dtype=torch.bool)
    start, rows = time.perf_counter(), {}
    for density in (1.0, 0.125):
        layout = random_layout(b, h, t, bs, density, gen)
        mask = flex_block_mask(layout, valid)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            flex_block_mask(layout, valid)
        ops = sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)
        build = median_ms(lambda: flex_block_mask(layout, valid), 4 * repeats)
        with torch.no_grad():
            attend = median_ms(lambda: compiled(q, k, v, block_mask=mask), repeats)
        rows[f"{density:g}"] = {"block_density": round(layout.density(), 4), "mask_build_ms": round(build, 3),
                                "flex_forward_ms": round(attend, 2), "build_share": round(build / (build + attend), 4),
                                "build_top_level_aten_ops": ops}
        print(json.dumps({"density": density, **rows[f"{density:g}"]}), flush=True)
    print(json.dumps({"device": "cpu", "torch": torch.__version__, "threads": args.threads,
                      "shape": {"batch": b, "heads": h, "seq": t, "head_dim": d, "block": bs},
                      "results": rows, "smoke": args.smoke, "seconds": round(time.perf_counter() - start, 1)}))


if __name__ == "__main__":
    main()
