"""Stragglers at 24 stages, simulated: dynmo's speed-aware re-split vs one partition for the run.

    python benchmarks/straggler_projection.py [--stages 24] [--react-steps 10]
    python benchmarks/straggler_projection.py --smoke     # seconds: 8 stages, 16 blocks, no sweeps

Pure simulation (:mod:`lightning_dynmo.sim.scenarios.straggler`), CPU-cheap: the paper's GPT (48
blocks, the shipped H100 profile's costs, fine granularity with 16 head chunks), 1F1B, 4 x stages
micro-batches, NVLink inside nodes of 4 and InfiniBand between them, 30 data-parallel replicas
(the paper-scale projection's settings, ``lightning_dynmo/sim/scenarios/projection.py``), 10,000
iterations. Two traces:

* ``slow_rank``: pipeline rank 12 (the middle) at 0.5x for the middle 30 % of the run, then
  recovered (a throttled or shared device: its slowest replica sets the stage's pace);
* ``mixed``: two device kinds for the whole run, nodes alternating between 1.0 and 0.6 (half the
  ranks each). 0.6 is an assumption: the mild end of a job that mixes device generations or power
  caps; the ``mixed_sweep`` shows the gain at other ratios, so nothing rests on the choice.

dynmo starts on the even split (time-balanced at equal speeds) and re-splits ``--react-steps``
after each change (10: the bound ``tests/distributed/test_straggler_pipeline.py`` holds; the
issue's target is 20, also reported), migrations charged over InfiniBand with 16 bytes of state
per parameter. The static candidates and the oracle are the module's. Figures: ``speedup_vs_best_static``
(the best single partition, chosen knowing the whole trace), ``speedup_vs_even`` (what a job
balanced at the start gets), ``fraction_of_oracle``, ``bubble`` and ``migrations``; sweeps of the
straggler's speed and rank. The last line of output is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import time

from lightning_dynmo.sim.scenarios import dense, load_profile
from lightning_dynmo.sim.scenarios.projection import DEFAULTS, links
from lightning_dynmo.sim.scenarios.straggler import EVEN, mixed_trace, project, slow_rank_trace
from lightning_dynmo.sim.simulate import DataParallel

#: keys the last JSON line always has (tests/unit/test_benchmarks_smoke.py checks them on ``--smoke``)
RESULT_KEYS = ("benchmark", "simulated", "stages", "layers", "react_steps", "slow_rank", "mixed",
               "slow_speed_sweep", "slow_rank_sweep", "mixed_sweep")


def figures(r) -> dict:
    its = r.iterations
    return {
        "speedup_vs_best_static": round(r.speedup_vs_best_static, 4),
        "speedup_vs_even": round(r.speedup_vs_even, 4),
        "fraction_of_oracle": round(r.fraction_of_oracle, 4),
        "oracle_speedup_vs_even": round(r.speedup(EVEN, "oracle"), 4),
        "best_static": r.best_static,
        "seconds_per_iteration": {k: round(v / its, 4) for k, v in r.seconds.items()},
        "bubble": {k: round(r.bubble[k], 4) for k in ("dynmo", "oracle", EVEN, r.best_static)},
        "migrations": r.migrations,
        "migration_seconds": round(r.migration_seconds, 4),
        "phase_step_s": {k: [round(t, 4) for t in r.phase_step[k]] for k in ("dynmo", "oracle", EVEN, r.best_static)},
        "partitions": {k: r.partitions[k] for k in ("dynmo", r.best_static)},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, default=24)
    ap.add_argument("--layers", type=int, default=48, help="transformer blocks")
    ap.add_argument("--react-steps", type=int, default=10, help="iterations on the old split after a change")
    ap.add_argument("--smoke", action="store_true", help="seconds: 8 stages, 16 blocks, one-point sweeps")
    args = ap.parse_args()
    t0 = time.perf_counter()
    stages, layers = (8, 16) if args.smoke else (args.stages, args.layers)
    if not 2 <= stages <= layers:
        ap.error(f"need 2 <= stages <= blocks, got {stages} stages, {layers} blocks")
    profile = load_profile(DEFAULTS["profile"])
    snap = dense(layers, profile, granularity=DEFAULTS["pipeline_granularity"], head_chunks=DEFAULTS["head_chunks"])[0]
    d = DEFAULTS["data_parallel"]
    kw = dict(link=links(stages, DEFAULTS["network"]), react_steps=args.react_steps,
              dp=DataParallel(d["replicas"], d["bandwidth"], d["bytes_per_param"], d["latency"], overlap=d["overlap"]),
              microbatches=DEFAULTS["microbatches_per_stage"] * stages)
    gpn = DEFAULTS["network"]["gpus_per_node"]
    mid = stages // 2
    slow = project(snap, slow_rank_trace(stages, mid, 0.5, 0.35, 0.65), **kw)
    mixed = project(snap, mixed_trace(stages, 0.6, gpn), **kw)
    late = project(snap, slow_rank_trace(stages, mid, 0.5, 0.35, 0.65), **dict(kw, react_steps=20))
    speeds = (0.5,) if args.smoke else (0.25, 0.5, 0.75, 0.9)
    ranks = (mid,) if args.smoke else (0, mid, stages - 1)
    mixes = (0.6,) if args.smoke else (0.4, 0.6, 0.8)

    def short(r) -> dict:
        return {"speedup_vs_even": round(r.speedup_vs_even, 4),
                "speedup_vs_best_static": round(r.speedup_vs_best_static, 4),
                "fraction_of_oracle": round(r.fraction_of_oracle, 4), "best_static": r.best_static,
                "migrations": r.migrations}

    out = {
        "benchmark": "straggler_projection",
        "simulated": True,
        "smoke": args.smoke,
        "stages": stages,
        "layers": layers,
        "pipeline_layers": snap.costs.num_layers,
        "granularity": DEFAULTS["pipeline_granularity"],
        "microbatches": kw["microbatches"],
        "react_steps": args.react_steps,
        "profile": profile.name,
        "slow_rank": {"rank": mid, "speed": 0.5, "window": [0.35, 0.65], **figures(slow)},
        "slow_rank_react_20": short(late),
        "mixed": {"slow_speed": 0.6, "gpus_per_node": gpn, **figures(mixed)},
        "slow_speed_sweep": {str(v): short(project(snap, slow_rank_trace(stages, mid, v), **kw)) for v in speeds},
        "slow_rank_sweep": {str(r): short(project(snap, slow_rank_trace(stages, r, 0.5), **kw)) for r in ranks},
        "mixed_sweep": {str(v): short(project(snap, mixed_trace(stages, v, gpn), **kw)) for v in mixes},
        "static_candidates": list(slow.static),
        "seconds": None,
    }
    out["seconds"] = round(time.perf_counter() - t0, 1)
    for name in ("slow_rank", "mixed"):
        f = out[name]
        print(f"{name:10s} dynmo {f['speedup_vs_even']:.3f}x even, {f['speedup_vs_best_static']:.3f}x best static "
              f"({f['best_static']}), {f['fraction_of_oracle']:.3f} of the oracle, {f['migrations']} migrations")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
