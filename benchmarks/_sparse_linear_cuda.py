"""The GPU half of benchmarks/sparse_linear.py: the seed's SpMM figure and the layer's
forward+backward on CUDA.

* SpMM (DynMo paper, figure 2; Sputnik's setup): y = x W^T with M = N = K = 4096 in fp32 with
  TF32 off, W unstructured at each sparsity: ours (``torch.ops.ldsparse.spmm`` with each kernel
  ``LDSPARSE_SPMM_KERNEL`` offers: v1 tiled, v2 staged, v3-v5 entry stream), cuSPARSE
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


_PROBE = """
import torch, sys
from lightning_dynmo.sparse.linear import csr_pattern
g = torch.Generator().manual_seed(0)
for tokens, k, rows, d in ((513, 300, 130, 0.1), (256, 64, 64, 1.0), (1, 33, 7, 0.5)):
    mask = torch.rand(rows, k, generator=g) < d
    w = torch.randn(rows, k, generator=g) * mask
    x = torch.randn(tokens, k, generator=g)
    crow, col = (t.cuda() for t in csr_pattern(mask))
    y = torch.ops.ldsparse.spmm(crow, col, w[mask].cuda(), x.cuda(), None).cpu()
    torch.testing.assert_close(y, x @ w.t(), atol=1e-4, rtol=1e-4)
torch.cuda.synchronize()
"""


def healthy_kernels(wanted=None) -> tuple[str, ...]:
    """The kernels that give the dense product on a few small cases, each tried in its own process:
    a kernel that faults poisons its CUDA context, and must not take the others' figures with it."""
    import subprocess
    import sys
    ok = []
    unknown = set(wanted or ()) - set(KERNELS)
    if unknown:
        raise SystemExit(f"--kernels: unknown {sorted(unknown)}; choose from {list(KERNELS)}")
    for k in KERNELS:
        if wanted and k not in wanted and k != "v1":
            continue
        r = subprocess.run([sys.executable, "-c", _PROBE], env={**os.environ, "LDSPARSE_SPMM_KERNEL": k},
                           capture_output=True, text=True, timeout=120)
        if r.returncode == 0:
            ok.append(k)
        else:
            print(json.dumps({"kernel": k, "probe": "FAILED", "stderr_tail": r.stderr[-1500:]}), flush=True)
    return tuple(ok)


def spmm_figure(sparsities, rounds: int, kernels, size: int = 4096) -> list[dict]:
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
        fns = {"cublas": lambda: x @ wm.t()}
        errs = {}
        for k in kernels:
            with _spmm_kernel(k):
                errs[k] = _check(torch.ops.ldsparse.spmm(crow, col, vals, x, None), ref, f"spmm {k} at sparsity {s}",
                                 1e-4)
            fns[f"ours_{k}"] = _with_kernel(k, lambda: torch.ops.ldsparse.spmm(crow, col, vals, x, None))
        fns["cusparse"] = lambda: torch.sparse.mm(w_csr, x.t())
        fns["cublas_control"] = lambda: x @ wm.t()
        ms = cuda_round_robin(fns, rounds)
        row = {"sparsity": s, **{f"{k}_ms": round(v, 4) for k, v in ms.items()},
               **{f"max_rel_err_{k}": e for k, e in errs.items()},
               **{f"speedup_vs_cublas_{k}": round(ms["cublas"] / ms[f"ours_{k}"], 2) for k in kernels},
               **{f"speedup_vs_cusparse_{k}": round(ms["cusparse"] / ms[f"ours_{k}"], 2) for k in kernels},
               "cusparse_vs_cublas": round(ms["cublas"] / ms["cusparse"], 2),
               "noise_floor": round(abs(ms["cublas_control"] / ms["cublas"] - 1), 3)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


KERNELS = ("v1", "v2", "v3", "v4", "v5")  # LDSPARSE_SPMM_KERNEL values (fp32; bf16 always runs v1)


def _with_kernel(name: str, fn):
    def run():
        with _spmm_kernel(name):
            return fn()
    return run


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


def layer_fwd_bwd(in_f: int, out_f: int, tokens: int, dtype, sparsities, rounds: int, kernels) -> list[dict]:
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
        timed = kernels if dtype == torch.float32 else ("v1",)  # v2-v5: fp32 only
        fns = {"dense": _fwd_bwd(dense, x, g)}
        for k in timed:
            with _spmm_kernel(k):
                _check(ours(x), masked(x), f"SparseLinear {k} {in_f}x{out_f} {dtype} at {s}", tol)
                x.grad = None
                ours.zero_grad(set_to_none=True)
                ours(x).backward(g)
            gx, gv = x.grad.clone(), ours.values.grad.clone()
            x.grad = None
            masked.zero_grad(set_to_none=True)
            masked(x).backward(g)
            _check(gx, x.grad, f"SparseLinear {k} input grad {in_f}x{out_f} {dtype} at {s}", tol)
            _check(gv, masked.weight.grad[mask], f"SparseLinear {k} weight grad {in_f}x{out_f} {dtype} at {s}", tol)
            fns[f"ours_{k}"] = _with_kernel(k, _fwd_bwd(ours, x, g))
        fns["dense_control"] = _fwd_bwd(dense, x, g)
        ms = cuda_round_robin(fns, rounds)
        row = {"in": in_f, "out": out_f, "tokens": tokens, "dtype": str(dtype).replace("torch.", ""),
               "sparsity": s, **{f"{k}_fwd_bwd_ms": round(v, 4) for k, v in ms.items()},
               **{f"speedup_vs_dense_{k}": round(ms["dense"] / ms[f"ours_{k}"], 2) for k in timed},
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
    labels = {"v1": "ours v1 (tiled)", "v2": "ours v2 (staged)", "v3": "ours v3 (entry stream 64x256)",
              "v4": "ours v4 (entry stream 128x128)", "v5": "ours v5 (entry stream 256x128)"}
    for k, marker in zip(KERNELS, "o^Dvs"):
        if f"speedup_vs_cublas_{k}" not in rows[0]:
            continue
        ax.plot(s, [r[f"speedup_vs_cublas_{k}"] for r in rows], marker + "-",
                label=f"{labels[k]}, LDSPARSE_SPMM_KERNEL={k}")
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
    kernels = healthy_kernels(getattr(args, "kernels", None))
    if "v1" not in kernels:
        raise SystemExit("the default SpMM kernel (v1) fails its probe: no figure")
    figure = spmm_figure(FIGURE_SPARSITIES, rounds, kernels)
    by = {r["sparsity"]: r for r in figure}
    layers = {
        "4096x4096x4096_fp32": layer_fwd_bwd(4096, 4096, 4096, torch.float32, (0.75, 0.9, 0.95, 0.99), rounds, kernels),
        "768x3072x8192_fp32": layer_fwd_bwd(768, 3072, 8192, torch.float32, (0.9,), rounds, kernels),
        "3072x768x8192_fp32": layer_fwd_bwd(3072, 768, 8192, torch.float32, (0.9,), rounds, kernels),
        "768x3072x8192_bf16": layer_fwd_bwd(768, 3072, 8192, torch.bfloat16, (0.9,), rounds, kernels),
    }
    big = {r["sparsity"]: r for r in layers["4096x4096x4096_fp32"]}
    summary = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "quick": args.quick, "rounds": rounds, "tf32": False,
        "default_kernel": os.environ.get("LDSPARSE_SPMM_KERNEL") or "v5",
        "kernels_timed": list(kernels),
        "kernels_failing_probe": [k for k in (args.kernels or KERNELS) if k not in kernels],
        "spmm_speedup_vs_cublas_at_75": {k: by[0.75][f"speedup_vs_cublas_{k}"] for k in kernels},
        "spmm_speedup_vs_cublas_at_90": {k: by[0.9][f"speedup_vs_cublas_{k}"] for k in kernels},
        "spmm_min_speedup_vs_cusparse": {k: min(r[f"speedup_vs_cusparse_{k}"] for r in figure) for k in kernels},
        "spmm_crossover_vs_cublas": {k: min((r["sparsity"] for r in figure if r[f"speedup_vs_cublas_{k}"] >= 1),
                                            default=None) for k in kernels},
        "fwd_bwd_speedup_vs_dense_at_90": {k: big[0.9][f"speedup_vs_dense_{k}"] for k in kernels},
        "fwd_bwd_crossover_vs_dense": {k: min((r["sparsity"] for r in layers["4096x4096x4096_fp32"]
                                               if r[f"speedup_vs_dense_{k}"] >= 1), default=None) for k in kernels},
        "gpt_mlp_fwd_bwd_speedup_at_90": {name: {key[len("speedup_vs_dense_"):]: v for key, v in rows[0].items()
                                                 if key.startswith("speedup_vs_dense_")}
                                          for name, rows in layers.items() if "8192" in name},
        "noise_floor": max(r["noise_floor"] for r in figure),
        "figure": figure, "layers": layers,
    }
    if args.figure:
        os.makedirs(args.out_dir, exist_ok=True)
        path = os.path.join(args.out_dir, "spmm_figure_cuda.png")
        _plot(figure, path)
        summary["png"] = path
    return summary
