"""Where SparseLinear's forward+backward spends its time on CPU: each compiled op on its own.

Per op (spmm = forward, spmm_t = the input gradient through the cached transpose, sddmm = the
weight gradient), the thread CPU time of one call with 1 thread (steadier than wall time on a
shared machine: time the thread waits for a core does not count), minimum over 3 rounds of
``--reps`` calls.  Each op runs in a block of calls: interleaving single calls of different ops
made the allocator hand the 768->3072 spmm's 25 MB output back as fresh pages, whose page faults
(+6-9 ms of kernel time) then counted as kernel time.  ``spmm`` is timed twice (``spmm_control``); their spread is
the noise floor.  Also prints GFMA/s (nnz x tokens multiply-adds per op).  Compare kernel builds
by running it with each build's tree on PYTHONPATH, one after the other.  Prints one JSON object
as the last line.

    LDSPARSE_ISA=avx2 python benchmarks/sparse_linear_ops.py [--sparsity 0.9] [--tokens 2048]
    python benchmarks/sparse_linear_ops.py --smoke     # seconds: 64 tokens, one call per round
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from lightning_dynmo import sparse
from lightning_dynmo.sparse import SparseLinear

#: keys the last JSON line always has (tests/unit/test_benchmarks_smoke.py checks them on ``--smoke``)
RESULT_KEYS = ("isa", "threads", "sparsity", "tokens", "torch", "shapes")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sparsity", type=float, default=0.9)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="64 tokens, one call per round: checks that the script runs")
    args = ap.parse_args()
    if args.smoke:
        args.tokens, args.reps = 64, 1
    torch.set_num_threads(1)
    if not sparse.extension_available():  # never time the reference path as a kernel
        sys.exit(f"compiled kernels missing: {sparse.extension_error()!r}")
    ops = torch.ops.ldsparse
    gen = torch.Generator().manual_seed(0)
    result = {"isa": sparse._ops._C.cpu_isa(), "threads": 1, "sparsity": args.sparsity,
              "tokens": args.tokens, "torch": torch.__version__, "smoke": args.smoke, "shapes": {}}
    for in_f, out_f in ((768, 3072), (3072, 768)):
        layer = SparseLinear.from_dense(torch.nn.Linear(in_f, out_f),
                                        torch.rand(out_f, in_f, generator=gen) >= args.sparsity)
        x = torch.randn(args.tokens, in_f, generator=gen)
        g = torch.randn(args.tokens, out_f, generator=gen)
        v = layer.values.detach()
        vt = torch.index_select(v, 0, layer.perm_t)
        b = layer.bias.detach()
        calls = {
            "spmm": lambda: ops.spmm(layer.crow_indices, layer.col_indices, v, x, b),
            "spmm_t": lambda: ops.spmm(layer.crow_indices_t, layer.col_indices_t, vt, g, None),
            "sddmm": lambda: ops.sddmm(layer.crow_indices, layer.col_indices, g, x),
            "spmm_control": lambda: ops.spmm(layer.crow_indices, layer.col_indices, v, x, b),
        }
        times = {k: [] for k in calls}
        for _ in range(3):  # rounds of one block of calls per op
            for k, fn in calls.items():
                fn()
                for _ in range(args.reps):
                    start = time.thread_time()
                    fn()
                    times[k].append((time.thread_time() - start) * 1e3)
        ms = {k: min(t) for k, t in times.items()}
        fma = layer.nnz * args.tokens
        result["shapes"][f"{in_f}x{out_f}"] = {
            **{f"{k}_ms": round(ms[k], 2) for k in ("spmm", "spmm_t", "sddmm")},
            **{f"{k}_gfma_s": round(fma / ms[k] / 1e6, 1) for k in ("spmm", "spmm_t", "sddmm")},
            "total_ms": round(ms["spmm"] + ms["spmm_t"] + ms["sddmm"], 2),
            "noise_floor": round(abs(ms["spmm_control"] / ms["spmm"] - 1), 3),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
