"""One SpMM shape for a profiler to attach to (Nsight Compute's `ncu`), no timing of its own.

    ncu --kernel-name regex:spmm_stream_kernel --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats python benchmarks/spmm_ncu_target.py --sparsity 0.99

Runs ``torch.ops.ldsparse.spmm`` (the kernel ``LDSPARSE_SPMM_KERNEL`` or ``--kernel`` picks) on the
seed's figure shape (M=N=K=4096, fp32) a few times after checking it against the dense product, so
the profiler sees warm launches. Why: v5's time on an H200 fits 0.9 ms + 13 ms x density
(benchmarks/results/2026-11-28-gpu.md); what the 0.9 ms is (copy latency, barriers, L2) is a
profiler's question. Prints one JSON object as its last line."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sparsity", type=float, default=0.9)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--kernel", default=None, help="LDSPARSE_SPMM_KERNEL for the run (v1..v5; default: as set)")
    ap.add_argument("--launches", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="one launch after the check")
    args = ap.parse_args()
    if args.quick:
        args.launches = 1
    if args.kernel:
        os.environ["LDSPARSE_SPMM_KERNEL"] = args.kernel
    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"gpu": False, "skipped": "no CUDA GPU"}))
        return 0
    from lightning_dynmo import sparse
    from lightning_dynmo.sparse.linear import csr_pattern

    if not sparse.cuda_kernels_available():
        raise SystemExit(f"CUDA kernels missing: {sparse._ops.cuda_kernels_missing_reason()}")
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(0)
    n = args.size
    x = torch.randn(n, n, device="cuda", generator=gen)
    mask = torch.rand(n, n, device="cuda", generator=gen) >= args.sparsity
    w = torch.randn(n, n, device="cuda", generator=gen) * mask
    crow, col = csr_pattern(mask)
    vals = w[mask].contiguous()
    y = torch.ops.ldsparse.spmm(crow, col, vals, x, None)
    ref = x @ w.t()
    err = float((y - ref).abs().max() / ref.abs().max())
    if err > 1e-4:
        raise SystemExit(f"spmm differs from the dense product (max rel err {err:.2e})")
    for _ in range(args.launches):
        torch.ops.ldsparse.spmm(crow, col, vals, x, None)
    torch.cuda.synchronize()
    print(json.dumps({"kernel": os.environ.get("LDSPARSE_SPMM_KERNEL") or "v5", "sparsity": args.sparsity,
                      "size": n, "nnz": int(col.numel()), "max_rel_err": err}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
