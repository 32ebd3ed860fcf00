"""Dense nn.Linear vs torch.sparse CSR vs lightning_dynmo SparseLinear, forward and
forward+backward, across sparsities, in one process with the same thread count.

Methods are timed round-robin (one call of each per round) so drift from other load on the
machine hits all of them alike; each number is the median over rounds.  Dense is timed twice
per round (``dense_control``): their spread is the run's noise floor.  Prints one JSON
object as the last line.

    python benchmarks/sparse_linear.py [--quick] [--threads 2]
    python benchmarks/sparse_linear.py --device cuda [--quick] [--figure]   # GPU: the seed's SpMM
        figure (M=N=K=4096, fp32, ours vs cuSPARSE vs cuBLAS; --figure writes a PNG) and the
        layer's forward+backward (benchmarks/_sparse_linear_cuda.py)
    python benchmarks/sparse_linear.py --smoke     # seconds: one 128x256 shape, 64 tokens, 90 and 50 %, 1 round
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import warnings

import torch
from torch import nn

from _harness import round_robin
from lightning_dynmo import sparse
from lightning_dynmo.sparse import SparseLinear

SPARSITIES = (0.5, 0.7, 0.8, 0.9, 0.95, 0.99)
#: keys the last JSON line always has on CPU (tests/unit/test_benchmarks_smoke.py checks them on ``--smoke``)
RESULT_KEYS = ("device", "threads", "rounds", "torch", "speedup_vs_dense_at_90", "speedup_vs_torch_sparse_at_90",
               "noise_floor_at_90", "noise_floor_max", "crossover_sparsity", "crossover_sparsity_fwd",
               "crossover_sparsity_by_shape", "speedup_vs_dense_at_90_by_shape", "results")
warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")


def _dense_step(layer, x, g, backward):
    def run():
        if not backward:
            with torch.no_grad():
                return layer(x)
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x).backward(g)
    return run


def _torch_sparse_step(w_csr, bias, x, g, backward):
    def run():
        if not backward:
            with torch.no_grad():
                return torch.sparse.mm(w_csr, x.t()).t() + bias
        w_csr.grad = None
        x.grad = None
        (torch.sparse.mm(w_csr, x.t()).t() + bias).backward(g)
    return run


def bench_shape(in_f, out_f, tokens, sparsities, rounds, torch_sparse_min):
    gen = torch.Generator().manual_seed(0)
    dense = nn.Linear(in_f, out_f)
    x = torch.randn(tokens, in_f, generator=gen).requires_grad_()
    g = torch.randn(tokens, out_f, generator=gen)
    rows = []
    for s in sparsities:
        mask = torch.rand(out_f, in_f, generator=gen) >= s
        ours = SparseLinear.from_dense(dense, mask)
        w_csr = (dense.weight.detach() * mask).to_sparse_csr().requires_grad_()
        bias = dense.bias.detach()
        with_ts = s >= torch_sparse_min
        row = {"in": in_f, "out": out_f, "tokens": tokens, "sparsity": s}
        for backward, tag in ((False, "fwd"), (True, "fwd_bwd")):
            # dense twice: the control pair whose spread is this run's noise floor
            fns = {"dense": _dense_step(dense, x, g, backward), "ours": _dense_step(ours, x, g, backward),
                   "dense_control": _dense_step(dense, x, g, backward)}
            if with_ts:
                fns["torch_sparse"] = _torch_sparse_step(w_csr, bias, x, g, backward)
            ms = round_robin(fns, rounds)
            for k in ("dense", "torch_sparse", "ours"):
                row[f"{k}_{tag}_ms"] = round(ms[k], 2) if k in ms else None
            row[f"noise_floor_{tag}"] = round(abs(ms["dense_control"] / ms["dense"] - 1), 3)
        row["speedup_vs_dense"] = round(row["dense_fwd_bwd_ms"] / row["ours_fwd_bwd_ms"], 2)
        if with_ts:
            row["speedup_vs_torch_sparse"] = round(row["torch_sparse_fwd_bwd_ms"] / row["ours_fwd_bwd_ms"], 2)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def _crossover(rows, key):
    wins = [r["sparsity"] for r in rows if r[f"ours_{key}_ms"] < r[f"dense_{key}_ms"]]
    return min(wins) if wins else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="GPT shapes only, fewer rounds")
    ap.add_argument("--smoke", action="store_true", help="one small shape, one round: checks that the script runs")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--figure", action="store_true", help="(cuda) write the SpMM figure as a PNG")
    ap.add_argument("--out-dir", default="benchmarks/results", help="(cuda) where --figure writes")
    ap.add_argument("--kernels", nargs="+", default=None, metavar="vN",
                    help="(cuda) the LDSPARSE_SPMM_KERNEL values to time (default: all; v1 always)")
    args = ap.parse_args()
    if args.device == "cuda":
        if args.smoke:  # the GPU figure has no small form of its own: its quick one
            args.quick = True
            if not torch.cuda.is_available():
                print(json.dumps({"device": "cuda", "skipped": "no CUDA", "smoke": True}))
                return
        import _sparse_linear_cuda
        print(json.dumps(dict(_sparse_linear_cuda.main(args), smoke=args.smoke)))
        return
    torch.set_num_threads(args.threads)
    if not sparse.extension_available():  # never report the fallback as "ours"
        sys.exit(f"compiled kernels missing ({sparse._ops.import_failure_cause('_C_cpu', sparse.extension_error())}); "
                 "SparseLinear would time the slow reference path, which is not our kernel")
    rounds = args.rounds or (1 if args.smoke else 3 if args.quick else 7)
    results = {}
    if args.smoke:
        results["128x256x64"] = bench_shape(128, 256, 64, (0.5, 0.9), rounds, 0.0)
    else:
        for in_f, out_f in ((768, 3072), (3072, 768)):
            results[f"{in_f}x{out_f}x2048"] = bench_shape(in_f, out_f, 2048, SPARSITIES, rounds, 0.0)
    if not (args.quick or args.smoke):  # torch.sparse takes tens of seconds per call here at low sparsity
        results["4096x4096x4096"] = bench_shape(4096, 4096, 4096, SPARSITIES, 3, 0.9)
    first = next(iter(results))  # the GPT-2 MLP's 768 -> 3072 (the smoke run's one shape)
    gpt = {r["sparsity"]: r for r in results[first]}
    summary = {
        "device": "cpu", "cpu": platform.processor() or platform.machine(),
        "isa": sparse._ops._C.cpu_isa() if sparse.extension_available() else None,
        "threads": args.threads, "quick": args.quick, "smoke": args.smoke, "rounds": rounds, "torch": torch.__version__,
        "speedup_vs_dense_at_90": gpt[0.9]["speedup_vs_dense"],
        "speedup_vs_torch_sparse_at_90": gpt[0.9]["speedup_vs_torch_sparse"],
        # |dense_control / dense - 1|, the same configuration timed twice side by side: a speedup
        # closer to 1 than this is noise
        "noise_floor_at_90": gpt[0.9]["noise_floor_fwd_bwd"],
        "noise_floor_max": max(r[f"noise_floor_{t}"] for v in results.values() for r in v for t in ("fwd", "fwd_bwd")),
        "crossover_sparsity": _crossover(results[first], "fwd_bwd"),
        "crossover_sparsity_fwd": _crossover(results[first], "fwd"),
        "crossover_sparsity_by_shape": {k: _crossover(v, "fwd_bwd") for k, v in results.items()},
        "speedup_vs_dense_at_90_by_shape": {
            k: next(r["speedup_vs_dense"] for r in v if r["sparsity"] == 0.9) for k, v in results.items()},
        "results": results,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
