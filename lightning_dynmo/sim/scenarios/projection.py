"""The paper-scale projection: every dynamism case x model depth x pipeline depth, simulated with
data parallelism, all balancers and re-packing; a Markdown report, one PNG and a JSON summary.

Driven by ``recipes/paper_scale.py`` (Hydra, ``conf/paper_scale.yaml``); :func:`project` takes a
plain dict with the same keys, so tests run it on a tiny grid. Everything here is *simulated*: the
per-layer costs are a measured H100 profile of the paper's GPT block changed by synthetic models
of each case (:mod:`lightning_dynmo.sim.scenarios`, which lists every parameter's source).

Each cell is simulated at the headline ``granularity`` (``fine``, the default: five pieces per
block; ``sublayer``: attention and MLP halves; both with the LM head + loss in ``head_chunks``
vocabulary chunks) and,
with ``compare_block``, at the coarser granularities beside it; the headline cell is also run
under the zero-bubble ``schedules``. Two yardsticks come with every cell: ``fluid_ceiling``, the
speedup over the best static partition if every rank held exactly its share of the work (the
schedule's own bubble kept, transfers and all-reduce free), and ``dense_efficiency``, that ideal
over the best partition's step time for the model without dynamism. The report and plot are :mod:`.report`'s.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

from .report import PAPER, plot, report
from . import (CASES, PER_ITERATION, Profile, Snapshot, compare, dense, load_profile,
                        repack_projection)
from lightning_dynmo.protocol.granularity import check_granularity
from lightning_dynmo.plan.balancers import BalanceProblem, get_balancer
from lightning_dynmo.plan.cost_model import CostModel
from lightning_dynmo.sim.simulate import DataParallel, Link

DEFAULTS: dict = {
    "quick": False,
    "profile": "h100_gpt_h1024_s2048_mb2",
    "head_scale": 1.0,
    "cases": list(CASES),
    "layers": [24, 32, 48],
    "stages": [8, 16, 24],
    "headline": {"layers": 48, "stages": 24},
    "schedule": "1f1b",
    "schedules": ["zbv", "zero_bubble"],
    "pipeline_granularity": "fine",
    "head_chunks": 16,
    "compare_block": True,
    "microbatches_per_stage": 4,
    "static": ["megatron", "uniform", "param", "static_time"],
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
    check_granularity(out["pipeline_granularity"], out["head_chunks"])
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


def layouts(cfg: dict) -> dict[str, dict]:
    """The granularities simulated, headline first: name -> ``granularity`` / ``head_chunks``."""
    chunks = int(cfg["head_chunks"])
    first = cfg["pipeline_granularity"]
    out = {first: {"granularity": first, "head_chunks": chunks if first != "block" else 1}}
    if cfg["compare_block"]:  # the coarser granularities beside the headline one
        for g in ("sublayer", "block")[("fine", "sublayer", "block").index(first):]:
            out.setdefault(g, {"granularity": g, "head_chunks": chunks if g != "block" else 1})
    return out


def _trajectory(case: str, layers: int, profile: Profile, cfg: dict, layout: dict):
    if case in PER_ITERATION:
        return CASES[case](layers, profile, snapshots=int(cfg["per_iteration_snapshots"]), **layout)
    if case == "pruning":
        return CASES[case](layers, profile, **layout)
    return CASES[case](layers, profile, snapshots=int(cfg["snapshots"]), **layout)


def _dp(case: str, cfg: dict) -> DataParallel:
    d = cfg["data_parallel"]
    replicas = d["moe_replicas"] if case in ("moe", "mod") else d["replicas"]
    return DataParallel(int(replicas), float(d["bandwidth"]), float(d["bytes_per_param"]), float(d["latency"]),
                        overlap=bool(d["overlap"]))


def _profile(cfg: dict, head_scale: float | None = None) -> Profile:
    p = load_profile(str(cfg["profile"]))
    k = float(cfg["head_scale"] if head_scale is None else head_scale)
    return p if k == 1.0 else dataclasses.replace(p, head=(k * p.head[0], k * p.head[1]))


def ideal_seconds(trajectory: list[Snapshot], stages: int, microbatches: int, inherent: float) -> float:
    """Iteration-weighted step time if every rank held exactly 1/stages of the work: its
    per-micro-batch share times m, over 1 - the schedule's own bubble (free links, no
    all-reduce)."""
    return math.fsum(s.iterations * s.costs.time_sum(0, s.costs.num_layers) / stages * microbatches / (1 - inherent)
                     for s in trajectory)


def stage_max_over_mean(trajectory: list[Snapshot], stages: int, balancer: str) -> float:
    """Heaviest stage over the mean stage (per micro-batch compute, free links), iteration-weighted:
    how far ``balancer``'s split of whole pieces is from every stage holding exactly its share."""
    model = CostModel(4 * stages)
    acc = 0.0
    for s in trajectory:
        c = s.costs
        part = get_balancer(balancer)(BalanceProblem(c, stages, model)).partition
        acc += s.iterations * max(model.stage_times(c, part)) * stages / c.time_sum(0, c.num_layers)
    return acc / math.fsum(s.iterations for s in trajectory)


def _cell(case: str, layers: int, stages: int, profile: Profile, cfg: dict, layout: dict,
          schedule: str | None = None) -> dict:
    schedule = schedule or cfg["schedule"]
    traj = _trajectory(case, layers, profile, cfg, layout)
    kw = dict(link=links(stages, cfg["network"]), dp=_dp(case, cfg), horizon=float(cfg["horizon"]))
    m = int(cfg["microbatches_per_stage"]) * stages
    c = compare(traj, stages, schedule, m, static=cfg["static"], dynamic=cfg["dynamic"], **kw)
    dense_traj = dense(layers, profile, **layout)
    ref = compare(dense_traj, stages, schedule, m, static=cfg["static"], dynamic=cfg["dynamic"], **kw)
    its = sum(c.iterations)
    per_it = {n: t / its for n, t in c.step_time.items()}
    dense_static = min(ref.step_time[n] for n in cfg["static"]) / sum(ref.iterations)
    return {
        "case": case, "layers": layers, "stages": stages, "gpus": stages * _dp(case, cfg).replicas,
        "granularity": layout["granularity"], "head_chunks": layout["head_chunks"], "schedule": schedule,
        "pipeline_layers": traj[0].costs.num_layers,
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
        "fluid_ceiling": c.step_time[c.best_static] / ideal_seconds(traj, stages, m, c.inherent_bubble),
        "dense_efficiency": ideal_seconds(dense_traj, stages, m, ref.inherent_bubble) / min(ref.step_time.values()),
        "dense_best": min(ref.step_time, key=ref.step_time.get),
        "stage_max_over_mean": {n: stage_max_over_mean(traj, stages, n) for n in ("partition_time", "uniform")},
    }


def _versus_block(cells: list[dict]) -> None:
    """Adds ``speedup_vs_block_static`` to every finer cell: today's best static split at block
    granularity over this cell's best dynamic one (what the finer cuts and balancing give
    together; ``speedup_vs_static`` compares at the same granularity)."""
    block = {(c["case"], c["layers"], c["stages"], c["schedule"]): c for c in cells if c["granularity"] == "block"}
    for c in cells:
        b = block.get((c["case"], c["layers"], c["stages"], c["schedule"]))
        if b is not None and c["granularity"] != "block":
            c["speedup_vs_block_static"] = (b["seconds_per_iteration"][b["best_static"]]
                                            / c["seconds_per_iteration"][c["best_dynamic"]])


def _figures(cells: dict[str, dict]) -> dict:
    """The JSON figures of one set of headline cells (case -> cell)."""
    first = next(iter(cells.values()), None)
    return {
        "projected_speedup_vs_static": {c: round(x["speedup_vs_static"], 4) for c, x in cells.items()},
        "fluid_ceiling": {c: round(x["fluid_ceiling"], 4) for c, x in cells.items()},
        "bubble_static": {c: round(x["bubble_static"], 4) for c, x in cells.items()},
        "bubble_dynamic": {c: round(x["bubble_dynamic"], 4) for c, x in cells.items()},
        "stage_max_over_mean": {c: {n: round(v, 4) for n, v in x["stage_max_over_mean"].items()}
                                for c, x in cells.items()},
        "best_dynamic_balancer": {c: x["best_dynamic"] for c, x in cells.items()},
        **({"speedup_vs_block_static": {c: round(x["speedup_vs_block_static"], 4) for c, x in cells.items()}}
           if all("speedup_vs_block_static" in x for x in cells.values()) and cells else {}),
        "dense_efficiency": round(first["dense_efficiency"], 4) if first else None,
        "inherent_bubble": round(first["inherent_bubble"], 4) if first else None,
        "pipeline_layers": first["pipeline_layers"] if first else None,
    }


def project(cfg: dict | None = None, out_dir: str | Path | None = None) -> dict:
    """Run the grid; with ``out_dir`` also write ``report.md``, ``paper_scale.png`` and
    ``results.json``. Returns the summary (the recipe's JSON line) with the cells under ``cells``."""
    cfg = merged(cfg)
    t0 = time.perf_counter()
    profile = _profile(cfg)
    lays = layouts(cfg)
    finest = next(iter(lays))
    cells = [
        _cell(case, L, S, profile, cfg, lay)
        for lay in lays.values() for case in cfg["cases"] for L in cfg["layers"] for S in cfg["stages"]
        if S <= L + 3
    ]
    h = cfg["headline"]
    _versus_block(cells)

    def headline(granularity: str, schedule: str) -> dict[str, dict]:
        return {c["case"]: c for c in cells if c["layers"] == h["layers"] and c["stages"] == h["stages"]
                and c["granularity"] == granularity and c["schedule"] == schedule}

    head = headline(finest, cfg["schedule"])
    by_schedule = {}
    for sched in cfg["schedules"]:
        if sched == cfg["schedule"]:
            continue
        for name, lay in lays.items():
            cells += [_cell(case, h["layers"], h["stages"], profile, cfg, lay, sched) for case in cfg["cases"]]
        _versus_block(cells)
        by_schedule[sched] = {name: _figures(headline(name, sched)) for name in lays}
    sens = {}
    for k in cfg["sensitivity_head_scale"]:
        p = _profile(cfg, k)
        sens[str(k)] = {case: round(_cell(case, h["layers"], h["stages"], p, cfg, lays[finest])["speedup_vs_static"], 4)
                        for case in cfg["cases"]}
    packing = _packing(cfg, profile, lays[finest])
    summary = {
        "benchmark": "paper_scale",
        "simulated": True,
        "costs": f"per-layer costs {profile.source}; dynamism: synthetic models "
                 "(lightning_dynmo/sim/scenarios/__init__.py lists every parameter and its source)",
        "profile": profile.name,
        "head_scale": cfg["head_scale"],
        "schedule": cfg["schedule"],
        "granularity": finest,
        "head_chunks": lays[finest]["head_chunks"],
        "headline": {"layers": h["layers"], "stages": h["stages"]},
        **_figures(head),
        "speedup_vs_megatron": {c: round(x["speedup_vs"].get("megatron", math.nan), 4) for c, x in head.items()},
        "speedup_vs_deepspeed_param": {c: round(x["speedup_vs"].get("param", math.nan), 4) for c, x in head.items()},
        "speedup_vs_uniform": {c: round(x["speedup_vs"].get("uniform", math.nan), 4) for c, x in head.items()},
        "speedup_vs_static_time": {c: round(x["speedup_vs"].get("static_time", math.nan), 4) for c, x in head.items()},
        "speedup_vs_dense_static": {c: round(x["speedup_vs_dense_static"], 4) for c, x in head.items()},
        "dense_model_speedup_vs_static": round(next(iter(head.values()))["dense_speedup_vs_static"], 4)
        if head else None,
        "granularities": {name: _figures(headline(name, cfg["schedule"])) for name in lays},
        "schedules": by_schedule,
        "packing": {c: {L: {k: v[k] for k in ("stages", "mean_gpus", "gpu_hours_saved_fraction",
                                              "min_throughput_ratio")}
                        for L, v in d.items()} for c, d in packing.items()},
        "sensitivity_head_scale": sens,
        "paper": PAPER,
        "grid": {"cases": cfg["cases"], "layers": cfg["layers"], "stages": cfg["stages"],
                 "balancers": [*cfg["static"], *cfg["dynamic"]], "granularities": list(lays),
                 "schedules": [cfg["schedule"], *by_schedule]},
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


def _packing(cfg: dict, profile: Profile, layout: dict) -> dict:
    """Re-packing of the shrinking cases onto fewer ranks, per model depth."""
    rp = cfg["repack"]
    packing: dict = {}
    for case in rp["cases"]:
        if case not in cfg["cases"]:
            continue
        for L in cfg["layers"]:
            traj = _trajectory(case, L, profile, cfg, layout)
            r = repack_projection(traj, int(rp["stages"]), cfg["schedule"],
                                  link=links(int(rp["stages"]), cfg["network"]),
                                  dp=_dp(case, cfg), capacity=float(rp["capacity_gb"]) * 1e9,
                                  tolerance=float(rp["tolerance"]), reference=str(rp["reference"]))
            packing.setdefault(case, {})[str(L)] = {
                "stages": int(rp["stages"]), "reference": r.reference, "ranks_over_time": r.ranks,
                "iterations": r.iterations,
                "mean_gpus": round(r.mean_ranks, 3), "gpu_hours_saved_fraction": round(r.gpu_hours_saved_fraction, 4),
                "min_throughput_ratio": round(min(r.throughput_ratio), 4),
                "peak_stage_memory_gb": round(max(r.peak_stage_memory_gb), 2), "decisions": r.reasons,
            }
    return packing
