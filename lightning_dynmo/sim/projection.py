"""The paper-scale projection: every dynamism case x model depth x pipeline depth, simulated with
data parallelism, all balancers and re-packing; a Markdown report, one PNG and a JSON summary.

Driven by ``recipes/paper_scale.py`` (Hydra, ``conf/paper_scale.yaml``); :func:`project` takes a
plain dict with the same keys, so tests run it on a tiny grid. Everything here is *simulated*: the
per-layer costs are a measured H100 profile of the paper's GPT block changed by synthetic models
of each case (:mod:`lightning_dynmo.sim.scenarios`, which lists every parameter's source).
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

from .scenarios import (CASES, PER_ITERATION, Profile, compare, dense, load_profile, repack_projection)
from .simulate import DataParallel, Link

#: The DynMo paper's figures (seeds/001), for side-by-side reading only (never used as targets).
PAPER = {
    "speedup": {"moe": 1.23, "pruning": 3.18, "freezing": 2.23, "sparse_attention": 4.02, "early_exit": 4.52,
                "mod": 1.17},
    "bubble": {"moe": (0.25, 0.08), "mod": (0.18, 0.04)},
    "packing": {"pruning": (8, 5.8)},
    "note": "early exit and sparse attention speedups are over the model without the dynamism "
            "(paper 4.1); the others over the best of static Megatron-LM / DeepSpeed",
}

DEFAULTS: dict = {
    "quick": False,
    "profile": "h100_gpt_h1024_s2048_mb2",
    "head_scale": 1.0,
    "cases": list(CASES),
    "layers": [24, 32, 48],
    "stages": [8, 16, 24],
    "headline": {"layers": 48, "stages": 24},
    "schedule": "1f1b",
    "microbatches_per_stage": 4,
    "static": ["megatron", "uniform", "param"],
    "dynamic": ["partition_time", "partition_param", "diffusion_time", "diffusion_param"],
    "snapshots": 12,
    "per_iteration_snapshots": 24,
    "horizon": 10,
    "data_parallel": {"replicas": 30, "moe_replicas": 8, "bandwidth": 45e9, "latency": 1e-5,
                      "bytes_per_param": 4.0, "overlap": True},
    "network": {"gpus_per_node": 4, "nvlink": {"latency": 5e-6, "bandwidth": 3.6e11},
                "infiniband": {"latency": 1e-5, "bandwidth": 4.5e10}},
    "repack": {"stages": 8, "capacity_gb": 80.0, "tolerance": 0.05, "reference": "start",
               "cases": ["pruning", "freezing", "early_exit"]},
    "sensitivity_head_scale": [0.5, 0.0],
}


def merged(cfg: dict | None) -> dict:
    """``cfg`` over :data:`DEFAULTS` (one level of nesting), with ``quick`` shrinking the grid."""
    out = json.loads(json.dumps(DEFAULTS))
    for k, v in (cfg or {}).items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = {**out[k], **v}
        else:
            out[k] = v
    unknown = set(out) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown paper_scale keys {sorted(unknown)}; valid: {sorted(DEFAULTS)}")
    bad = [c for c in out["cases"] if c not in CASES]
    if bad:
        raise ValueError(f"unknown cases {bad}; valid: {sorted(CASES)}")
    if out["quick"]:
        h = out["headline"]
        out["layers"] = sorted({h["layers"]})
        out["stages"] = sorted({8, h["stages"]})
        out["dynamic"] = [d for d in out["dynamic"] if d in ("partition_time", "diffusion_time")] or out["dynamic"][:1]
        out["snapshots"] = min(out["snapshots"], 6)
        out["per_iteration_snapshots"] = min(out["per_iteration_snapshots"], 8)
        out["sensitivity_head_scale"] = out["sensitivity_head_scale"][:1]
    return out


def links(stages: int, net: dict) -> list[Link]:
    """One link per pipeline rank: NVLink inside a node, InfiniBand where rank r+1 is on the next
    node (consecutive ranks fill nodes of ``gpus_per_node``)."""
    nv, ib = Link(**net["nvlink"]), Link(**net["infiniband"])
    g = int(net["gpus_per_node"])
    return [ib if (r + 1) % g == 0 or r == stages - 1 else nv for r in range(stages)]


def _trajectory(case: str, layers: int, profile: Profile, cfg: dict):
    if case in PER_ITERATION:
        return CASES[case](layers, profile, snapshots=int(cfg["per_iteration_snapshots"]))
    if case == "pruning":
        return CASES[case](layers, profile)
    return CASES[case](layers, profile, snapshots=int(cfg["snapshots"]))


def _dp(case: str, cfg: dict) -> DataParallel:
    d = cfg["data_parallel"]
    replicas = d["moe_replicas"] if case in ("moe", "mod") else d["replicas"]
    return DataParallel(int(replicas), float(d["bandwidth"]), float(d["bytes_per_param"]), float(d["latency"]),
                        overlap=bool(d["overlap"]))


def _profile(cfg: dict, head_scale: float | None = None) -> Profile:
    p = load_profile(str(cfg["profile"]))
    k = float(cfg["head_scale"] if head_scale is None else head_scale)
    return p if k == 1.0 else dataclasses.replace(p, head=(k * p.head[0], k * p.head[1]))


def _cell(case: str, layers: int, stages: int, profile: Profile, cfg: dict) -> dict:
    traj = _trajectory(case, layers, profile, cfg)
    kw = dict(link=links(stages, cfg["network"]), dp=_dp(case, cfg), horizon=float(cfg["horizon"]))
    m = int(cfg["microbatches_per_stage"]) * stages
    c = compare(traj, stages, cfg["schedule"], m, static=cfg["static"], dynamic=cfg["dynamic"], **kw)
    ref = compare(dense(layers, profile), stages, cfg["schedule"], m, static=cfg["static"], dynamic=cfg["dynamic"],
                  **kw)
    its = sum(c.iterations)
    per_it = {n: t / its for n, t in c.step_time.items()}
    dense_static = min(ref.step_time[n] for n in cfg["static"]) / sum(ref.iterations)
    return {
        "case": case, "layers": layers, "stages": stages, "gpus": stages * _dp(case, cfg).replicas,
        "seconds_per_iteration": per_it,
        "speedup_vs_static": c.best_speedup,
        "speedup": c.speedup,
        "speedup_vs": {n: c.step_time[n] / c.step_time[c.best_dynamic] for n in cfg["static"]},
        "speedup_vs_dense_static": dense_static / per_it[c.best_dynamic],
        "best_static": c.best_static, "best_dynamic": c.best_dynamic,
        "bubble": c.bubble_fraction, "bubble_static": c.bubble_fraction[c.best_static],
        "bubble_dynamic": c.bubble_fraction[c.best_dynamic], "inherent_bubble": c.inherent_bubble,
        "rebalances": c.rebalances, "migration_seconds": c.migration_seconds,
        "series": {n: c.series[n] for n in (c.best_static, c.best_dynamic)}, "iterations": c.iterations,
        "dense_speedup_vs_static": ref.best_speedup,
    }


def project(cfg: dict | None = None, out_dir: str | Path | None = None) -> dict:
    """Run the grid; with ``out_dir`` also write ``report.md``, ``paper_scale.png`` and
    ``results.json``. Returns the summary (the recipe's JSON line) with the cells under ``cells``."""
    cfg = merged(cfg)
    t0 = time.perf_counter()
    profile = _profile(cfg)
    cells = [
        _cell(case, L, S, profile, cfg)
        for case in cfg["cases"] for L in cfg["layers"] for S in cfg["stages"]
        if S <= L + 3
    ]
    h = cfg["headline"]
    head = {c["case"]: c for c in cells if c["layers"] == h["layers"] and c["stages"] == h["stages"]}
    sens = {}
    for k in cfg["sensitivity_head_scale"]:
        p = _profile(cfg, k)
        sens[str(k)] = {case: round(_cell(case, h["layers"], h["stages"], p, cfg)["speedup_vs_static"], 4)
                        for case in cfg["cases"]}
    rp = cfg["repack"]
    packing = {}
    for case in rp["cases"]:
        if case not in cfg["cases"]:
            continue
        for L in cfg["layers"]:
            traj = _trajectory(case, L, profile, cfg)
            r = repack_projection(traj, int(rp["stages"]), cfg["schedule"], link=links(int(rp["stages"]), cfg["network"]),
                                  dp=_dp(case, cfg), capacity=float(rp["capacity_gb"]) * 1e9,
                                  tolerance=float(rp["tolerance"]), reference=str(rp["reference"]))
            packing.setdefault(case, {})[str(L)] = {
                "stages": int(rp["stages"]), "reference": r.reference, "ranks_over_time": r.ranks, "iterations": r.iterations,
                "mean_gpus": round(r.mean_ranks, 3), "gpu_hours_saved_fraction": round(r.gpu_hours_saved_fraction, 4),
                "min_throughput_ratio": round(min(r.throughput_ratio), 4),
                "peak_stage_memory_gb": round(max(r.peak_stage_memory_gb), 2), "decisions": r.reasons,
            }
    summary = {
        "benchmark": "paper_scale",
        "simulated": True,
        "costs": f"per-layer costs {profile.source}; dynamism: synthetic models "
                 "(lightning_dynmo/sim/scenarios/__init__.py lists every parameter and its source)",
        "profile": profile.name,
        "head_scale": cfg["head_scale"],
        "schedule": cfg["schedule"],
        "headline": {"layers": h["layers"], "stages": h["stages"]},
        "projected_speedup_vs_static": {c: round(x["speedup_vs_static"], 4) for c, x in head.items()},
        "speedup_vs_megatron": {c: round(x["speedup_vs"].get("megatron", math.nan), 4) for c, x in head.items()},
        "speedup_vs_deepspeed_param": {c: round(x["speedup_vs"].get("param", math.nan), 4) for c, x in head.items()},
        "speedup_vs_dense_static": {c: round(x["speedup_vs_dense_static"], 4) for c, x in head.items()},
        "best_dynamic_balancer": {c: x["best_dynamic"] for c, x in head.items()},
        "bubble_static": {c: round(x["bubble_static"], 4) for c, x in head.items()},
        "bubble_dynamic": {c: round(x["bubble_dynamic"], 4) for c, x in head.items()},
        "inherent_bubble": round(next(iter(head.values()))["inherent_bubble"], 4) if head else None,
        "dense_model_speedup_vs_static": round(next(iter(head.values()))["dense_speedup_vs_static"], 4) if head else None,
        "packing": {c: {L: {k: v[k] for k in ("stages", "mean_gpus", "gpu_hours_saved_fraction", "min_throughput_ratio")}
                        for L, v in d.items()} for c, d in packing.items()},
        "sensitivity_head_scale": sens,
        "paper": PAPER,
        "grid": {"cases": cfg["cases"], "layers": cfg["layers"], "stages": cfg["stages"],
                 "balancers": [*cfg["static"], *cfg["dynamic"]]},
        "quick": bool(cfg["quick"]),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        summary["plot"] = str(out / "paper_scale.png")
        summary["report"] = str(out / "report.md")
        plot(cells, packing, cfg, summary["plot"])
        Path(summary["report"]).write_text(report(summary, cells, packing, cfg, profile))
        (out / "results.json").write_text(json.dumps({"summary": summary, "cells": cells, "packing": packing,
                                                      "config": cfg}, indent=1, default=str))
    summary["cells"] = cells
    summary["packing_detail"] = packing
    return summary


# ------------------------------------------------------------------------------ outputs
def plot(cells: list[dict], packing: dict, cfg: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L = cfg["headline"]["layers"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12.5, 4.2))
    for case in cfg["cases"]:
        pts = sorted((c["stages"], c["speedup_vs_static"]) for c in cells if c["case"] == case and c["layers"] == L)
        if pts:
            ax.plot(*zip(*pts), marker="o", label=case)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("pipeline stages")
    ax.set_ylabel("speedup, best dynamic / best static")
    ax.set_title(f"{L}-layer GPT (simulated)")
    ax.legend(fontsize=8)
    for case, d in packing.items():
        v = d.get(str(L)) or next(iter(d.values()))
        x, acc = [], 0.0
        for it in v["iterations"]:
            x.append(acc)
            acc += it
        ax2.step(x + [acc], v["ranks_over_time"] + v["ranks_over_time"][-1:], where="post",
                 label=f"{case} (mean {v['mean_gpus']:.2f})")
    ax2.set_xlabel("iteration")
    ax2.set_ylabel("pipeline GPUs in use (per replica)")
    ax2.set_title("re-packing (simulated)")
    ax2.set_ylim(0, int(cfg["repack"]["stages"]) + 0.5)
    ax2.legend(fontsize=8)
    fig.suptitle(f"Simulated from measured per-layer costs ({cfg['profile']}) and synthetic dynamism models",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _f(x, fmt=".2f"):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def report(summary: dict, cells: list[dict], packing: dict, cfg: dict, profile: Profile) -> str:
    h = summary["headline"]
    lines = [
        "# Paper-scale projection (simulated)",
        "",
        "**Everything below is simulated**, not measured at scale. Per-layer costs: "
        f"{profile.source}; GPT with hidden {profile.hidden}, {profile.heads} heads, sequence {profile.seq}, "
        f"micro-batch {profile.micro_batch}, vocabulary {profile.vocab} (the DynMo paper's appendix A), "
        "embedding and LM head + loss included as pipeline layers"
        + (f" (head cost x {cfg['head_scale']})" if cfg["head_scale"] != 1.0 else "") + ". "
        "How each dynamism changes those costs over training is a synthetic model whose parameters and "
        "sources are listed in `lightning_dynmo/sim/scenarios/__init__.py`. Schedule "
        f"`{cfg['schedule']}`, {cfg['microbatches_per_stage']} x stages micro-batches, data parallelism "
        f"{cfg['data_parallel']['replicas']}-way ({cfg['data_parallel']['moe_replicas']}-way for MoE/MoD, expert "
        f"parallel over it), {cfg['network']['gpus_per_node']} GPUs per node (NVLink inside, InfiniBand between), "
        "migrations charged, static partitions decided once.",
        "",
        f"## Headline: {h['layers']} layers on {h['stages']} pipeline stages",
        "",
        "| case | speedup vs best static | vs Megatron | vs DeepSpeed param | vs dense model (static) | "
        "bubble static -> dynamic | paper |",
        "|---|---|---|---|---|---|---|",
    ]
    for case in cfg["cases"]:
        if case not in summary["projected_speedup_vs_static"]:
            continue
        pb = PAPER["bubble"].get(case)
        paper = f"{PAPER['speedup'][case]}x" + (f"; bubble {pb[0]:.0%} -> {pb[1]:.0%}" if pb else "")
        lines.append(
            f"| {case} | **{_f(summary['projected_speedup_vs_static'][case], '.3f')}x** "
            f"({summary['best_dynamic_balancer'][case]}) | {_f(summary['speedup_vs_megatron'][case], '.3f')}x | "
            f"{_f(summary['speedup_vs_deepspeed_param'][case], '.3f')}x | "
            f"{_f(summary['speedup_vs_dense_static'][case], '.3f')}x | "
            f"{summary['bubble_static'][case]:.1%} -> {summary['bubble_dynamic'][case]:.1%} | {paper} |")
    lines += [
        "",
        f"The schedule's own bubble with equal stages is {_f(summary['inherent_bubble'], '.1%')} (1F1B: (p-1)/(m+p-1)); "
        "the paper's bubbles are for a zero-bubble schedule. The *dense* model (no dynamism) already gains "
        f"{_f(summary['dense_model_speedup_vs_static'], '.3f')}x from time-based balancing over the best static "
        "split, because the LM head + loss is one heavy layer.",
        "",
        "## All cells: speedup of the best dynamic balancer over the best static partition",
        "",
        "| case | layers | " + " | ".join(f"{s} stages" for s in cfg["stages"]) + " |",
        "|---|---|" + "---|" * len(cfg["stages"]),
    ]
    for case in cfg["cases"]:
        for L in cfg["layers"]:
            row = {c["stages"]: c for c in cells if c["case"] == case and c["layers"] == L}
            lines.append(f"| {case} | {L} | " + " | ".join(
                f"{row[s]['speedup_vs_static']:.3f}x ({row[s]['best_dynamic']})" if s in row else "-"
                for s in cfg["stages"]) + " |")
    lines += ["", "## Per balancer (seconds per iteration, headline cell)", "",
              "| case | " + " | ".join([*cfg["static"], *cfg["dynamic"]]) + " |",
              "|---|" + "---|" * (len(cfg["static"]) + len(cfg["dynamic"]))]
    for case in cfg["cases"]:
        c = next((c for c in cells if c["case"] == case and c["layers"] == h["layers"] and c["stages"] == h["stages"]), None)
        if c:
            lines.append(f"| {case} | " + " | ".join(f"{c['seconds_per_iteration'][n] * 1e3:.1f} ms"
                                                     for n in [*cfg["static"], *cfg["dynamic"]]) + " |")
    lines += ["", "## Re-packing (gradual shrinking of the work; pipeline GPUs per replica over training)", "",
              "| case | layers | start | mean GPUs | GPU-hours saved | worst throughput ratio | peak stage memory |",
              "|---|---|---|---|---|---|---|"]
    for case, d in packing.items():
        for L, v in d.items():
            lines.append(f"| {case} | {L} | {v['stages']} | {v['mean_gpus']:.2f} | {v['gpu_hours_saved_fraction']:.1%} | "
                         f"{v['min_throughput_ratio']:.3f} | {v['peak_stage_memory_gb']:.1f} GB |")
    lines += ["", f"Paper: gradual pruning packs 8 -> {PAPER['packing']['pruning'][1]} GPUs on average.", ""]
    if summary["sensitivity_head_scale"]:
        lines += ["## Sensitivity: cost of the LM head + loss", "",
                  "| head cost x | " + " | ".join(cfg["cases"]) + " |", "|---|" + "---|" * len(cfg["cases"]),
                  f"| {cfg['head_scale']} (run) | " + " | ".join(
                      _f(summary["projected_speedup_vs_static"].get(c), ".3f") for c in cfg["cases"]) + " |"]
        for k, d in summary["sensitivity_head_scale"].items():
            lines.append(f"| {k} | " + " | ".join(_f(d.get(c), ".3f") for c in cfg["cases"]) + " |")
        lines += ["", "(0: blocks only, as a model without embedding/head layers would be.)", ""]
    lines += ["![paper scale](paper_scale.png)", "", f"Simulated in {summary['seconds']} s.", ""]
    return "\n".join(lines)
