"""The GPU half of benchmarks/sparse_linear.py: the seed's SpMM figure and the layer's
forward+backward on CUDA.

* SpMM (DynMo paper, figure 2; Sputnik's setup): y = x W^T with M = N = K = 4096 in fp32 with
  TF32 off, W unstructured at each sparsity: ours (``torch.ops.ldsparse.spmm``; the default kernel
  and the staged v2 kernel, ``LDSPARSE_SPMM_KERNEL=v2``), cuSPARSE
  (``torch.sparse.mm`` on a CSR weight: W x^T) and cuBLAS (``x @ W.t()``), plus cuBLAS timed a
  second time as the run's noise floor.
* Layer: ``SparseLinear`` vs ``nn.Linear`` forward+backward, at 4096 (fp32) and at the GPT-2
  MLP shapes with 8192 tokens (fp32 and bf16).
Every configuration checks ours against the dense masked product first; a mismatch stops the
benchmark (a fast wrong kernel is no figure).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import warnings

import torch
from torch import nn

from _cuda_timing import cuda_round_robin
from lightning_dynmo import sparse
from lightning_dynmo.sparse import SparseLinear
from lightning_dynmo.sparse.linear import csr_pattern

FIGURE_SPARSITIES = (0.5, 0.7, 0.75, 0.8, 0.9, 0.95, 0.98, 0.99)
warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")


def _check(ours: torch.Tensor, ref: torch.Tensor, what: str, rtol: float) -> float:
    err = float((ours.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))
    if not math.isfinite(err) or err > rtol:
        raise SystemExit(f"{what}: ours differs from the dense masked reference (max rel err {err:.2e} > {rtol})")
    return err


def spmm_figure(sparsities, rounds: int, size: int = 4096) -> list[dict]:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(size, size, device=dev, generator=gen)
    w = torch.randn(size, size, device=dev, generator=gen)
    rows = []
    for s in sparsities:
        mask = torch.rand(size, size, device=dev, generator=gen) >= s
        wm = w * mask
        crow, col = csr_pattern(mask)
        vals = wm[mask].contiguous()
        w_csr = wm.to_sparse_csr()
        ref = x @ wm.t()
        err = _check(torch.ops.ldsparse.spmm(crow, col, vals, x, None), ref, f"spmm at sparsity {s}", 1e-4)
        with _spmm_kernel("v2"):
            err_v2 = _check(torch.ops.ldsparse.spmm(crow, col, vals, x, None), ref, f"spmm v2 at sparsity {s}", 1e-4)

        def v2():
            with _spmm_kernel("v2"):
                return torch.ops.ldsparse.spmm(crow, col, vals, x, None)
        ms = cuda_round_robin({
            "cublas": lambda: x @ wm.t(),
            "ours": lambda: torch.ops.ldsparse.spmm(crow, col, vals, x, None),
            "ours_v2": v2,
            "cusparse": lambda: torch.sparse.mm(w_csr, x.t()),
            "cublas_control": lambda: x @ wm.t(),
        }, rounds)
        row = {"sparsity": s, **{f"{k}_ms": round(v, 4) for k, v in ms.items()}, "max_rel_err": err,
               "max_rel_err_v2": err_v2, "v2_speedup_vs_cublas": round(ms["cublas"] / ms["ours_v2"], 2),
               "speedup_vs_cublas": round(ms["cublas"] / ms["ours"], 2),
               "speedup_vs_cusparse": round(ms["cusparse"] / ms["ours"], 2),
               "cusparse_vs_cublas": round(ms["cublas"] / ms["cusparse"], 2),
               "noise_floor": round(abs(ms["cublas_control"] / ms["cublas"] - 1), 3)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


@contextlib.contextmanager
def _spmm_kernel(name: str):
    """LDSPARSE_SPMM_KERNEL for the calls inside (the CUDA op reads it per call)."""
    old = os.environ.get("LDSPARSE_SPMM_KERNEL")
    os.environ["LDSPARSE_SPMM_KERNEL"] = name
    try:
        yield
    finally:
        if old is None:
            del os.environ["LDSPARSE_SPMM_KERNEL"]
        else:
            os.environ["LDSPARSE_SPMM_KERNEL"] = old


def _fwd_bwd(layer, x, g):
    def run():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x).backward(g)
    return run


def layer_fwd_bwd(in_f: int, out_f: int, tokens: int, dtype, sparsities, rounds: int) -> list[dict]:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    dense = nn.Linear(in_f, out_f, device=dev, dtype=dtype)
    x = torch.randn(tokens, in_f, device=dev, dtype=dtype).requires_grad_()
    g = torch.randn(tokens, out_f, device=dev, dtype=dtype)
    rows = []
    for s in sparsities:
        mask = torch.rand(out_f, in_f, device=dev) >= s
        ours = SparseLinear.from_dense(dense, mask)
        masked = nn.Linear(in_f, out_f, device=dev, dtype=dtype)
        with torch.no_grad():
            masked.weight.copy_(dense.weight * mask)
            masked.bias.copy_(dense.bias)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        _check(ours(x), masked(x), f"SparseLinear {in_f}x{out_f} {dtype} at {s}", tol)
        x.grad = None
        ours(x).backward(g)
        gx, gv = x.grad.clone(), ours.values.grad.clone()
        x.grad = None
        masked(x).backward(g)
        _check(gx, x.grad, f"SparseLinear input grad {in_f}x{out_f} {dtype} at {s}", tol)
        _check(gv, masked.weight.grad[mask], f"SparseLinear weight grad {in_f}x{out_f} {dtype} at {s}", tol)
        ms = cuda_round_robin({"dense": _fwd_bwd(dense, x, g), "ours": _fwd_bwd(ours, x, g),
                               "dense_control": _fwd_bwd(dense, x, g)}, rounds)
        row = {"in": in_f, "out": out_f, "tokens": tokens, "dtype": str(dtype).replace("torch.", ""),
               "sparsity": s, **{f"{k}_fwd_bwd_ms": round(v, 4) for k, v in ms.items()},
               "speedup_vs_dense": round(ms["dense"] / ms["ours"], 2),
               "noise_floor": round(abs(ms["dense_control"] / ms["dense"] - 1), 3)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def _plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s = [r["sparsity"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(s, [r["speedup_vs_cublas"] for r in rows], "o-", label="ours v1 (ldsparse.spmm)")
    ax.plot(s, [r["v2_speedup_vs_cublas"] for r in rows], "^-", label="ours v2 (staged, LDSPARSE_SPMM_KERNEL=v2)")
    ax.plot(s, [r["cusparse_vs_cublas"] for r in rows], "s--", label="cuSPARSE (torch.sparse.mm)")
    ax.axhline(1.0, color="gray", lw=1, label="cuBLAS (dense)")
    ax.set_yscale("log")
    ax.set_xlabel("sparsity")
    ax.set_ylabel("speedup over cuBLAS (fp32, TF32 off)")
    ax.set_title(f"SpMM M=N=K=4096 on {torch.cuda.get_device_name()}")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(args) -> dict:
    if not torch.cuda.is_available():
        return {"gpu": False, "skipped": "no CUDA GPU"}
    if not sparse.cuda_kernels_available():  # never time the reference path as "ours"
        raise SystemExit(f"CUDA kernels missing ({sparse._ops.cuda_kernels_missing_reason()}); "
                         "SparseLinear would time the densifying reference path, which is not our kernel")
    torch.backends.cuda.matmul.allow_tf32 = False
    rounds = args.rounds or (5 if args.quick else 15)
    figure = spmm_figure(FIGURE_SPARSITIES, rounds)
    by = {r["sparsity"]: r for r in figure}
    layers = {
        "4096x4096x4096_fp32": layer_fwd_bwd(4096, 4096, 4096, torch.float32, (0.75, 0.9, 0.95, 0.99), rounds),
        "768x3072x8192_fp32": layer_fwd_bwd(768, 3072, 8192, torch.float32, (0.9,), rounds),
        "3072x768x8192_fp32": layer_fwd_bwd(3072, 768, 8192, torch.float32, (0.9,), rounds),
        "768x3072x8192_bf16": layer_fwd_bwd(768, 3072, 8192, torch.bfloat16, (0.9,), rounds),
    }
    big = {r["sparsity"]: r for r in layers["4096x4096x4096_fp32"]}
    summary = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "quick": args.quick, "rounds": rounds, "tf32": False,
        "spmm_speedup_vs_cublas_at_75": by[0.75]["speedup_vs_cublas"],
        "spmm_speedup_vs_cublas_at_90": by[0.9]["speedup_vs_cublas"],
        "spmm_kernel": os.environ.get("LDSPARSE_SPMM_KERNEL", "v1"),
        "spmm_v2_speedup_vs_cublas_at_75": by[0.75]["v2_speedup_vs_cublas"],
        "spmm_v2_speedup_vs_cublas_at_90": by[0.9]["v2_speedup_vs_cublas"],
        "spmm_min_speedup_vs_cusparse": min(r["speedup_vs_cusparse"] for r in figure),
        "spmm_crossover_vs_cublas": min((r["sparsity"] for r in figure if r["speedup_vs_cublas"] >= 1), default=None),
        "fwd_bwd_speedup_vs_dense_at_90": big[0.9]["speedup_vs_dense"],
        "fwd_bwd_crossover_vs_dense": min((r["sparsity"] for r in layers["4096x4096x4096_fp32"]
                                          if r["speedup_vs_dense"] >= 1), default=None),
        "gpt_mlp_fwd_bwd_speedup_at_90": {k: v[0]["speedup_vs_dense"] for k, v in layers.items() if "8192" in k},
        "noise_floor": max(r["noise_floor"] for r in figure),
        "figure": figure, "layers": layers,
    }
    if args.figure:
        os.makedirs(args.out_dir, exist_ok=True)
        path = os.path.join(args.out_dir, "spmm_figure_cuda.png")
        _plot(figure, path)
        summary["png"] = path
    return summary
