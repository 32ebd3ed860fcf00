"""2:4 semi-structured (torch's cuSPARSELt/CUTLASS kernels) vs dense ``nn.Linear``, bf16, forward
and forward+backward, at GPT-2-medium's MLP shapes (1024->4096 and 4096->1024, 8192 tokens).

Variants per shape, timed with CUDA events round-robin (every variant once per round, the order
rotated each round; ratios paired within rounds, median over rounds):

* ``dense``       ``nn.Linear`` in bf16;
* ``dense_twin``  the same again: the control, whose ratio to ``dense`` is the noise floor;
* ``2:4``         ``PrunableLinear`` with the 2:4 mask of ``GradualPruning(pattern="2:4")`` and the
                  semi-structured route on: sparse forward, dense input and weight gradients;
                  the weight is **compressed again on every call**, as training does once per
                  optimizer step (``2:4_cached`` reuses it: what micro-batches after the first pay);
* ``2:4T``        a transposable 2:4 mask (2:4 in rows and columns of each 4x4 tile), so the
                  input gradient runs on the sparse kernels too (compressed every call).
* ``*_cutlass``   the same on torch's CUTLASS kernels (``LDSPARSE_SEMI_BACKEND=cutlass``) where the
                  others use cuSPARSELt: torch 2.11's cuSPARSELt matmul rebuilds its plan on every
                  call (pytorch/pytorch#177866), a fixed cost CUTLASS does not pay.

Forward+backward is also captured per variant in a CUDA graph and replayed
(``speedup_fwd_bwd_graphed``): the host's work (cuSPARSELt's per-call plan among it) taken out,
the figure a captured training step would see; a variant that cannot be captured is named in
``graph_capture_failed``. ``--no-graphs`` skips it.

Correctness: outputs and gradients of each 2:4 variant against the masked dense layer in bf16
(relative error by norm); a failure exits 1. Without CUDA it prints ``{"gpu": false}`` with
``cpu_check`` (the CPU side: both masks are 2:4, the transposable one in columns too, and the
layer's masked-dense fallback matches the reference) and exits 0 unless that check fails. Prints
one JSON object as the last line; ``speedup_fwd_bwd_2to4`` is per shape.

    python benchmarks/semi_structured.py [--rounds 50] [--tokens 8192]
    python benchmarks/semi_structured.py --smoke     # seconds: one 256x512 shape, 256 tokens, 3 rounds
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from _cuda_timing import graphed_round_robin
from _harness import bootstrap_ratio, resolution, rotated, speedup

SHAPES = ((1024, 4096), (4096, 1024))  # (in_features, out_features): GPT-2-medium's MLP
SMOKE_SHAPES = ((256, 512),)
TARGET = 1.1
#: keys the last JSON line has on a GPU (tests/unit/test_benchmarks_smoke.py checks them on ``--smoke``)
RESULT_KEYS = ("gpu", "device", "torch", "tokens", "shapes", "speedup_fwd_bwd_2to4",
               "speedup_fwd_bwd_2to4_transposable", "speedup_fwd_2to4", "noise_floor_fwd_bwd", "correct",
               "meets_target", "seconds")
#: ... and without one (``"skipped"``)
SKIP_RESULT_KEYS = ("gpu", "skipped", "torch", "cpu_check")


def _layer(in_f: int, out_f: int, mask_rule: str, seed: int, device: str = "cuda", dtype=torch.bfloat16):
    from lightning_dynmo.dynamic import PrunableLinear
    from lightning_dynmo.dynamic.nm_sparsity import nm_keep, transposable_2to4_keep

    torch.manual_seed(seed)
    layer = PrunableLinear(in_f, out_f, device=device, dtype=dtype)
    if mask_rule == "2:4":
        layer.set_mask(nm_keep(layer.weight.detach().abs(), 2, 4))
    else:
        layer.set_mask(transposable_2to4_keep(layer.weight.detach().abs()))
    layer.set_semi_structured(True)
    return layer


def _check(layer, x, g, route: bool = True) -> dict:
    """Relative errors (by norm) of the 2:4 route (``route=False``: whatever the layer runs here,
    its masked-dense fallback off CUDA) against masked dense in the same dtype."""
    why = layer.semi_structured_unavailable(x.device, x.dtype)
    if why is not None and route:
        raise RuntimeError(f"the 2:4 route cannot run here: {why}")
    xs = x.detach().clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    y = layer(xs)
    y.backward(g)
    w = layer.weight.detach().clone().requires_grad_()
    xr = x.detach().clone().requires_grad_()
    b = layer.bias.detach().clone().requires_grad_()
    yr = F.linear(xr, w * layer.weight_mask, b)
    yr.backward(g)
    rel = lambda a, r: float((a.detach().float() - r.detach().float()).norm()  # noqa: E731
                             / r.detach().float().norm().clamp_min(1e-30))
    return {"y": rel(y, yr), "grad_x": rel(xs.grad, xr.grad), "grad_w": rel(layer.weight.grad, w.grad),
            "grad_b": rel(layer.bias.grad, b.grad),
            "grad_w_zero_where_pruned": bool((layer.weight.grad[~layer.weight_mask] == 0).all()),
            "sparse_input_grad": getattr(getattr(layer, "_semi_cache", None), "sparse_t", None) is not None}


def cpu_check(in_f: int = 64, out_f: int = 128, tokens: int = 32) -> dict:
    """What runs without a GPU: both masks (2:4 in rows; the transposable one in columns too) and
    the layer's masked-dense fallback against the reference, fp32."""
    from lightning_dynmo.dynamic.nm_sparsity import satisfies_nm

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, in_f, generator=gen).requires_grad_()
    g = torch.randn(tokens, out_f, generator=gen)
    out = {}
    for rule in ("2:4", "2:4T"):
        layer = _layer(in_f, out_f, rule, 1, device="cpu", dtype=torch.float32)
        mask = layer.weight_mask
        errors = _check(layer, x, g, route=False)
        out[rule] = {"rows_2to4": satisfies_nm(mask, 2, 4), "columns_2to4": satisfies_nm(mask.t(), 2, 4),
                     "max_rel_error": max(v for v in errors.values() if isinstance(v, float)),
                     "grad_w_zero_where_pruned": errors["grad_w_zero_where_pruned"],
                     "route_unavailable": layer.semi_structured_unavailable(x.device, x.dtype)}
    out["ok"] = (all(out[r]["rows_2to4"] and out[r]["grad_w_zero_where_pruned"] and out[r]["max_rel_error"] < 1e-5
                     for r in ("2:4", "2:4T")) and out["2:4T"]["columns_2to4"])
    return out


def _step(layer, x, g, backward: bool, recompress: bool, backend: str = ""):
    def run():
        if backend:
            os.environ["LDSPARSE_SEMI_BACKEND"] = backend
        try:
            _run()
        finally:
            if backend:
                os.environ.pop("LDSPARSE_SEMI_BACKEND", None)

    def _run():
        if recompress and getattr(layer, "_semi_cache", None) is not None:
            layer._semi_cache.key = None  # an optimizer step changed the weight
        if not backward:
            with torch.no_grad():
                layer(x)
            return
        layer.weight.grad = None
        if layer.bias is not None:
            layer.bias.grad = None
        x.grad = None
        layer(x).backward(g)
    return run


def _time_round_robin(fns: dict, rounds: int) -> dict:
    """Milliseconds per call of each variant per round (CUDA events; order rotated per round)."""
    names = list(fns)
    for fn in fns.values():  # warm-up: cuSPARSELt plans, cuBLAS handles, allocator
        fn()
        fn()
    torch.cuda.synchronize()
    events = {k: [] for k in names}
    for r in range(rounds):
        for k in rotated(names, r):
            torch.cuda.synchronize()  # each call starts on an idle GPU: no overlap with the previous variant
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fns[k]()
            end.record()
            events[k].append((start, end))
    torch.cuda.synchronize()
    return {k: [s.elapsed_time(e) for s, e in v] for k, v in events.items()}


def bench_shape(in_f: int, out_f: int, tokens: int, rounds: int, graphs: list | None = None) -> dict:
    dt = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, in_f, device="cuda", dtype=dt, generator=gen).requires_grad_()
    g = torch.randn(tokens, out_f, device="cuda", dtype=dt, generator=gen)
    torch.manual_seed(1)
    dense = torch.nn.Linear(in_f, out_f, device="cuda", dtype=dt)
    twin = torch.nn.Linear(in_f, out_f, device="cuda", dtype=dt)
    rowwise, transposable = _layer(in_f, out_f, "2:4", 1), _layer(in_f, out_f, "2:4T", 1)
    checks = {"2:4": _check(rowwise, x, g), "2:4T": _check(transposable, x, g)}
    out = {"checks": checks, "backend": type(rowwise._semi_cache.sparse).__name__}
    cutlass = out["backend"] != "SparseSemiStructuredTensorCUTLASS"  # else the default is CUTLASS already
    if cutlass:
        from lightning_dynmo.sparse.semi_structured import semi_structured_unavailable
        os.environ["LDSPARSE_SEMI_BACKEND"] = "cutlass"
        try:
            why = semi_structured_unavailable(x.device, dt, out_f, in_f)
        finally:
            os.environ.pop("LDSPARSE_SEMI_BACKEND", None)
        if why is not None:
            out["cutlass_skipped"] = why
            cutlass = False
    if cutlass:
        rowwise_c, transposable_c = _layer(in_f, out_f, "2:4", 1), _layer(in_f, out_f, "2:4T", 1)
        os.environ["LDSPARSE_SEMI_BACKEND"] = "cutlass"
        try:
            checks["2:4_cutlass"] = _check(rowwise_c, x, g)
            checks["2:4T_cutlass"] = _check(transposable_c, x, g)
        finally:
            os.environ.pop("LDSPARSE_SEMI_BACKEND", None)
    for backward in (False, True):
        fns = {"dense": _step(dense, x, g, backward, False), "dense_twin": _step(twin, x, g, backward, False),
               "2:4": _step(rowwise, x, g, backward, True), "2:4_cached": _step(rowwise, x, g, backward, False),
               "2:4T": _step(transposable, x, g, backward, True)}
        if cutlass:
            fns.update({"2:4_cutlass": _step(rowwise_c, x, g, backward, True, "cutlass"),
                        "2:4_cutlass_cached": _step(rowwise_c, x, g, backward, False, "cutlass"),
                        "2:4T_cutlass": _step(transposable_c, x, g, backward, True, "cutlass")})
        ms = _time_round_robin(fns, rounds)
        tag = "fwd_bwd" if backward else "fwd"
        out[f"ms_{tag}"] = {k: round(statistics.median(v), 4) for k, v in ms.items()}
        # speedup = dense time / variant time, paired per round (speedup() takes rates: invert ms)
        rate = {k: [1.0 / t for t in v] for k, v in ms.items()}
        out[f"speedup_{tag}"] = {k: round(speedup(rate[k], [rate["dense"]]), 4) for k in fns
                                 if k.startswith("2:4")}
        out[f"speedup_{tag}_ci95"] = {k: bootstrap_ratio(rate[k], [rate["dense"]]) for k in ("2:4", "2:4T")}
        out[f"noise_floor_{tag}"] = round(resolution(rate["dense_twin"], rate["dense"]), 4)
        if backward and graphs is not None:  # captured later, after every eager timing (see main)
            graphs.append((f"{in_f}x{out_f}", fns, x))
    return out


def graphed_fwd_bwd(fns: dict, x, rounds: int) -> dict:
    """The forward+backward steps ``fns`` replayed from CUDA graphs: the host's share (cuSPARSELt's
    per-call plan among it) taken out; a variant that cannot be captured is named with why."""
    graphed = graphed_round_robin(fns, rounds, probe=lambda: x.grad)
    got = graphed["ms"]
    if "dense" in got:
        graphed["speedup"] = {k: round(got["dense"] / v, 4) for k, v in got.items() if k != "dense"}
    return graphed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph replay timings")
    ap.add_argument("--smoke", action="store_true", help="one small shape, 3 rounds: checks that the script runs")
    args = ap.parse_args()
    if args.smoke:
        args.rounds, args.tokens = 3, 256
    if not torch.cuda.is_available():
        check = cpu_check()
        print(json.dumps({"gpu": False, "skipped": "no CUDA GPU: 2:4 semi-structured kernels need one",
                          "torch": torch.__version__, "smoke": args.smoke, "cpu_check": check}))
        return 0 if check["ok"] else 1
    t0 = time.perf_counter()
    result = {"gpu": True, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "tokens": args.tokens, "dtype": "bfloat16", "rounds": args.rounds, "target": TARGET, "shapes": {},
              "smoke": args.smoke}
    graphs = None if args.no_graphs else []
    for in_f, out_f in SMOKE_SHAPES if args.smoke else SHAPES:
        result["shapes"][f"{in_f}x{out_f}"] = bench_shape(in_f, out_f, args.tokens, args.rounds, graphs)
    shapes = result["shapes"]
    # CUDA graphs last: a capture that fails can leave torch's default CUDA generator mid-capture,
    # which would break any later eager call that draws from it (benchmarks/block_profile.py saw it)
    for key, fns, x in graphs or ():
        shapes[key]["cuda_graph_fwd_bwd"] = graphed_fwd_bwd(fns, x, args.rounds)
    result["speedup_fwd_bwd_2to4"] = {k: v["speedup_fwd_bwd"]["2:4"] for k, v in shapes.items()}
    result["speedup_fwd_bwd_2to4_transposable"] = {k: v["speedup_fwd_bwd"]["2:4T"] for k, v in shapes.items()}
    result["speedup_fwd_2to4"] = {k: v["speedup_fwd"]["2:4"] for k, v in shapes.items()}
    result["noise_floor_fwd_bwd"] = {k: v["noise_floor_fwd_bwd"] for k, v in shapes.items()}
    graphed = {k: v["cuda_graph_fwd_bwd"].get("speedup", {}) for k, v in shapes.items() if "cuda_graph_fwd_bwd" in v}
    if graphed:  # device-bound: what a captured (or deeply queued) training step would see
        result["speedup_fwd_bwd_graphed"] = graphed
        result["graph_capture_failed"] = {k: v["cuda_graph_fwd_bwd"]["failed"] for k, v in shapes.items()
                                          if v.get("cuda_graph_fwd_bwd", {}).get("failed")}
    for name in ("2:4_cutlass", "2:4_cutlass_cached", "2:4_cached"):
        if all(name in v["speedup_fwd_bwd"] for v in shapes.values()):
            result[f"speedup_fwd_bwd_{name.replace(':', 'to')}"] = {k: v["speedup_fwd_bwd"][name] for k, v in shapes.items()}
    tol = 2e-2  # bf16 products summed in a different order
    correct = all(c["y"] < tol and c["grad_x"] < tol and c["grad_w"] < tol and c["grad_b"] < tol
                  and c["grad_w_zero_where_pruned"] for v in shapes.values() for c in v["checks"].values())
    transposed_sparse = all(v["checks"]["2:4T"]["sparse_input_grad"] for v in shapes.values())
    result["correct"] = correct and transposed_sparse
    result["meets_target"] = all(s >= TARGET for s in result["speedup_fwd_bwd_2to4"].values())
    result["meets_target_cutlass"] = all(s >= TARGET for s in result.get("speedup_fwd_bwd_2to4_cutlass", {0: 0}).values())
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result))
    return 0 if result["correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
