"""One SpMM shape for a profiler to attach to (Nsight Compute's `ncu`), no timing of its own.

    ncu --kernel-name regex:spmm_stream_kernel --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats python benchmarks/spmm_ncu_target.py --sparsity 0.99

Runs ``torch.ops.ldsparse.spmm`` (the kernel ``LDSPARSE_SPMM_KERNEL`` or ``--kernel`` picks) on the
seed's figure shape (M=N=K=4096, fp32) a few times after checking it against the dense product, so
the profiler sees warm launches. Why: v5's time on an H200 fits 0.9 ms + 13 ms x density
(benchmarks/results/2026-11-28-gpu.md); what the 0.9 ms is (copy latency, barriers, L2) is a
profiler's question. Prints one JSON object as its last line.

    python benchmarks/spmm_ncu_target.py --smoke     # seconds: size 256, one launch; without CUDA the same
                                                     # check on the CPU op, then "skipped"
"""
from __future__ import annotations

import argparse
import json
import os
import sys

#: keys the last JSON line has on a GPU (tests/unit/test_benchmarks_smoke.py checks them on ``--smoke``)
RESULT_KEYS = ("kernel", "sparsity", "size", "nnz", "max_rel_err")
#: ... and without one (``"skipped"``)
SKIP_RESULT_KEYS = ("gpu", "skipped", "cpu_check")


def checked_spmm(n: int, sparsity: float, device: str):
    """``torch.ops.ldsparse.spmm`` on an ``n x n`` weight of ``sparsity`` against the dense product:
    (the CSR pattern and values, the input, nnz, max relative error); exits when they differ."""
    import torch

    from lightning_dynmo.sparse.linear import csr_pattern

    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(n, n, device=device, generator=gen)
    mask = torch.rand(n, n, device=device, generator=gen) >= sparsity
    w = torch.randn(n, n, device=device, generator=gen) * mask
    crow, col = csr_pattern(mask)
    vals = w[mask].contiguous()
    y = torch.ops.ldsparse.spmm(crow, col, vals, x, None)
    ref = x @ w.t()
    err = float((y - ref).abs().max() / ref.abs().max())
    if err > 1e-4:
        raise SystemExit(f"spmm ({device}) differs from the dense product (max rel err {err:.2e})")
    return (crow, col, vals, x), int(col.numel()), err


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sparsity", type=float, default=0.9)
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--kernel", default=None, help="LDSPARSE_SPMM_KERNEL for the run (v1..v5; default: as set)")
    ap.add_argument("--launches", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="one launch after the check")
    ap.add_argument("--smoke", action="store_true", help="size 256, one launch: checks that the script runs")
    args = ap.parse_args()
    if args.quick or args.smoke:
        args.launches = 1
    if args.smoke:
        args.size = 256
    if args.kernel:
        os.environ["LDSPARSE_SPMM_KERNEL"] = args.kernel
    import torch

    from lightning_dynmo import sparse

    if not torch.cuda.is_available():
        out = {"gpu": False, "skipped": "no CUDA GPU"}
        if args.smoke:  # the CPU side: the same pattern, op call and check on the CPU kernel
            if not sparse.extension_available():
                raise SystemExit(f"compiled kernels missing: {sparse.extension_error()!r}")
            _, nnz, err = checked_spmm(128, args.sparsity, "cpu")
            out.update(smoke=True, cpu_check={"size": 128, "nnz": nnz, "max_rel_err": err})
        print(json.dumps(out))
        return 0
    if not sparse.cuda_kernels_available():
        raise SystemExit(f"CUDA kernels missing: {sparse._ops.cuda_kernels_missing_reason()}")
    torch.backends.cuda.matmul.allow_tf32 = False
    call, nnz, err = checked_spmm(args.size, args.sparsity, "cuda")
    for _ in range(args.launches):
        torch.ops.ldsparse.spmm(*call, None)
    torch.cuda.synchronize()
    print(json.dumps({"kernel": os.environ.get("LDSPARSE_SPMM_KERNEL") or "v5", "sparsity": args.sparsity,
                      "size": args.size, "nnz": nnz, "max_rel_err": err, "smoke": args.smoke}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
