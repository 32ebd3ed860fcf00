"""An emulated cluster: the real strategy at 8-24 pipeline ranks on a couple of cores.

    python benchmarks/emulated_scale.py --quick              # 8 and 16 stages (~6 min on 2 loaded cores)
    python benchmarks/emulated_scale.py                      # 8, 16 and 24 stages, 3 steps per row
    python benchmarks/emulated_scale.py --cases moe,mod      # the per-iteration cases (not yet run)
    python benchmarks/emulated_scale.py --quick --stages 8 --cases straggler   # one emulated rank at 0.5x
    python benchmarks/emulated_scale.py --smoke              # seconds: 2 stages, freezing, 2 rows of 2 steps

The model is the paper's GPT at 48 blocks (``[embedding] + 48 blocks + [final norm, head]``)
made of layers that *wait* for their cost (``benchmarks/_emulated_model.py``): each does a tiny
real computation on real parameters (their counts are the real layer's / 4096), then sleeps for
its forward cost; its backward sleeps for its backward cost in a custom autograd function
(within a chunk the waits queue up like kernels on a device stream and the rank sleeps once, at
the chunk's end; see ``_Clock.wait``). A sleeping rank does not use a core, so S ranks run on 2
cores with the timing of S devices, provided they wake on time: a balanced pipeline waits on
~2(m+p-1) messages in a row, and on oversubscribed cores each late wake-up adds milliseconds, so
the ranks lower their niceness (``--nice``, default -20; together they use a fraction of a core). All
the rest is real: one process per rank (torchrun, gloo p2p, 1 torch thread each),
``DynMoStrategy`` with its schedule, per-layer profiler, policy, balancer and migrations (the
layers' parameters, gradients and AdamW state move), and Lightning's loop.

**Costs.** Per-layer (forward, backward) seconds come from the shipped H100 profile
(``lightning_dynmo/sim/scenarios/profiles``) changed over training by the scenario models of
``lightning_dynmo.sim.scenarios`` (freezing, early exit, pruning; MoE and MoD per iteration), all
scaled by one factor so that the dense model's step on the ``uniform`` split of 8 stages lasts
``--step-seconds``. Each snapshot of a scenario is one *row* of costs; the run spends
``--per-row`` steps on each row (``ScenarioClock`` selects it from the step index on every rank).

**How DynMo learns about a change** -- as in real runs, never from the cost table:
freezing freezes layers for real with ``LayerFreezing`` (a schedule giving the scenario's frozen
prefix per row: ``requires_grad=False``, no optimizer state, no backward; the callback calls
``invalidate_pipeline`` and ``request_rebalance``); early exit and pruning call
``request_rebalance`` when the row changes, as their callbacks do at an event; in every case
the strategy then profiles the next step with its normal layer profiler (it times the waits) and
balances on what it measured (``rebalance="on_event"``, ``partition_time``). The per-iteration
cases (MoE, MoD) change every step: their layers report load factors (``ReportsLoad``) and
``rebalance="auto"`` decides from those counters. The ``straggler`` case keeps the dense costs and
makes the middle pipeline rank's waits last twice as long in the middle third of its rows (the rank
is slow, not its layers); dynmo runs ``rebalance="auto"`` with ``rank_speeds="always"`` (its
ranks sleep, so sharing cores does not make one read another's load) and learns of it from busy
times and profiles only, and the simulator's side slows that rank's compute
(``rank_slowdown``; its projection is :mod:`lightning_dynmo.sim.scenarios.straggler`'s).

**Measured vs simulated.** A step's time is rank 0's wall time from the start of the pipeline
schedule to the end of the optimizer step (the profiled first step of each row, the engine
rebuilds and migrations before a schedule starts are not counted; the simulator charges neither
over the thousands of iterations a row stands for). For each run the same rows, partitions and
micro-batches go through ``lightning_dynmo.sim.simulate`` with the emulation's own costs
calibrated once per depth on the dense steps of the first case's ``uniform`` run, as
``benchmarks/simulator_validation.py`` calibrates it (per chunk, per message, per step:
``calibration_ms``); the iteration-weighted step time of the run (each row weighted by the
iterations its snapshot lasts) measured vs simulated gives ``sim_error`` (``sim_free_error``:
against the simulator with free links and no overheads). ``speedup_vs_static_<S>``: dynmo's weighted time over
the better of ``uniform`` / ``param`` (static, ``rebalance="never"``); ``sim_speedup_vs_static_<S>``
the same from the simulated times of the same runs; ``projection_speedup_<S>``: the simulator's
own static-vs-dynamic comparison (``lightning_dynmo.sim.scenarios.compare``) of the same trajectory.
``overhead_fraction``: on the profiled steps, what the layers measured beyond the waits they
were asked for (hooks, the tiny computation, sleep overshoot: what a zero-cost layer would
measure), summed over the busiest stage's layer calls, over the step time.
The last line of output is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

LAYERS = 48
EVENT_CASES = ("freezing", "early_exit", "pruning")
PER_ITERATION_CASES = ("moe", "mod")
#: the dense model with pipeline rank ``stages // 2``'s waits lasting ``STRAGGLER_SLOWDOWN`` times as long
#: in the middle third of the rows (``STRAGGLER_PER_ROW`` steps each at least: the reaction happens inside a row)
STRAGGLER_CASES = ("straggler",)
STRAGGLER_SLOWDOWN = 2.0
STRAGGLER_PER_ROW = 8
WARMUP = 2  # steps before row 0 is measured (the dynamic run profiles the second one)
#: keys the last JSON line always has (tests/unit/test_benchmarks_smoke.py checks them on ``--smoke``)
RESULT_KEYS = ("benchmark", "layers", "per_row", "microbatches", "runs", "errors", "max_sim_error",
               "overhead_fraction")
#: what ``--smoke`` sets where the command line leaves it open
SMOKE = dict(stages="2", cases="freezing", per_row=2, snapshots=2, step_seconds=0.05, microbatches=2)


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 and 16 stages, event cases, short rows")
    ap.add_argument("--smoke", action="store_true",
                    help="2 stages, freezing, 2 rows of 2 steps, 0.05 s steps: checks that the script runs")
    ap.add_argument("--stages", default=None, help="comma-separated pipeline depths (default 8,16[,24])")
    ap.add_argument("--cases", default=None, help="comma-separated cases (default: the event cases)")
    ap.add_argument("--step-seconds", type=float, default=None, help="dense step on 8 uniform stages (default 1)")
    ap.add_argument("--per-row", type=int, default=None, help="steps per scenario row (default 2, full 3)")
    ap.add_argument("--snapshots", type=int, default=None, help="rows of freezing / early exit (default 6)")
    ap.add_argument("--microbatches", type=int, default=None,
                    help="micro-batches per step: max(this, stages) (their CPU work is what 2 cores must carry; "
                         "default 16)")
    ap.add_argument("--nice", type=int, default=-20,
                    help="niceness change of the ranks (default -20: they sleep almost always, and a late wake-up "
                         "delays the whole pipeline on a busy host; 0 leaves them alone)")
    ap.add_argument("--keep", default=None, metavar="DIR", help="also write the plan and raw per-step records here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--plan", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for key, full in (("step_seconds", 1.0), ("snapshots", 6), ("microbatches", 16)):
        if getattr(args, key) is None:
            setattr(args, key, SMOKE[key] if args.smoke else full)
    if args.smoke:
        for key in ("stages", "cases", "per_row"):
            if getattr(args, key) is None:
                setattr(args, key, SMOKE[key])
    return args


# ------------------------------------------------------------------------------ the plan (launcher)
def _trajectory(case: str, snapshots: int, iterations: int):
    from lightning_dynmo.sim.scenarios import CASES, dense, load_profile

    p = load_profile()
    if case in STRAGGLER_CASES:
        return dense(LAYERS, p) * snapshots
    if case == "pruning":
        return CASES[case](LAYERS, p)
    if case in PER_ITERATION_CASES:
        return CASES[case](LAYERS, p, snapshots=iterations)
    return CASES[case](LAYERS, p, snapshots=snapshots)


def microbatches(args, stages: int) -> int:
    return max(stages, args.microbatches)


def _scale(step_seconds: float, microbatches: int) -> float:
    """Factor on the profile's seconds that makes the dense 8-stage uniform step last ``step_seconds``."""
    from lightning_dynmo.plan.balancers import megatron_layout
    from lightning_dynmo.sim import simulate
    from lightning_dynmo.sim.scenarios import dense

    costs = dense(LAYERS)[0].costs
    return step_seconds / simulate(costs, megatron_layout(costs.num_layers, 8), "1f1b", microbatches).step_time


def build_plan(args, cases: list[str], per_row: int) -> dict:
    k = _scale(args.step_seconds, microbatches(args, 8))
    plan = {"scale": k, "per_row": per_row, "cases": {}}
    for case in cases:
        traj = _trajectory(case, args.snapshots, 8 if args.quick else 16)
        fwd = [[k * x for x in s.costs.forward] for s in traj]
        bwd = [[k * x for x in s.costs.backward] for s in traj]
        per_it = case in PER_ITERATION_CASES
        varies = [len({round(r[i], 12) for r in fwd}) > 1 for i in range(len(fwd[0]))]
        frozen = [next((i for i, b in enumerate(r) if b > 0), len(r)) for r in bwd] if case == "freezing" else None
        n = len(traj)
        slow = [STRAGGLER_SLOWDOWN if n // 3 <= r < n - n // 3 else 1.0 for r in range(n)]
        plan["cases"][case] = dict(
            forward=fwd, backward=bwd, reference=fwd[0], params=[int(p) for p in traj[0].costs.params],
            weights=[1.0] * n if case in STRAGGLER_CASES else [s.iterations for s in traj],
            labels=[s.label for s in traj], frozen=frozen,
            per_iteration=per_it, reports_load=varies if per_it else [False] * len(varies),
            slow_rows=slow if case in STRAGGLER_CASES else None,
            per_row=max(per_row, STRAGGLER_PER_ROW) if case in STRAGGLER_CASES else per_row,
        )
    return plan


# ------------------------------------------------------------------------------ worker
def _slowdown(case_plan: dict, row: int, stages: int) -> list[float] | None:
    """Per pipeline rank, how many times its waits last in ``row`` (None: all as asked)."""
    if not case_plan.get("slow_rows"):
        return None
    return [case_plan["slow_rows"][row] if r == stages // 2 else 1.0 for r in range(stages)]


def _configs(case_plan: dict) -> list[tuple[str, dict]]:
    if case_plan.get("slow_rows"):
        return [("uniform", dict(balancer="uniform", rebalance="never")),
                ("param", dict(balancer="param", rebalance="never")),
                ("dynmo", dict(balancer="partition_time", rebalance="auto", rank_speeds="always"))]
    dyn = (dict(balancer="partition_time", rebalance="auto", imbalance_threshold=0.05, rebalance_cooldown=1,
                rebalance_horizon=50) if case_plan["per_iteration"]
           else dict(balancer="partition_time", rebalance="on_event", profile_steps=1))
    return [("uniform", dict(balancer="uniform", rebalance="never")),
            ("param", dict(balancer="param", rebalance="never")), ("dynmo", dyn)]


def _worker(args) -> None:
    if args.nice:
        try:  # an emulated device must wake on time: let this mostly sleeping rank preempt busy jobs
            os.nice(args.nice)
        except OSError as e:
            print(f"emulated_scale: cannot renice by {args.nice} ({e}); wake-ups may lag on a busy host")
    import torch

    torch.set_num_threads(1)
    import lightning as L
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from _emulated_model import CLOCK, MICRO_BATCH, SEQ, EmulatedGPT, ScenarioClock, rows_of_steps
    from lightning_dynmo import DynMoStrategy
    from lightning_dynmo.callbacks import LayerFreezing

    plan = json.load(open(args.plan))
    S, per_row = int(args.stages), plan["per_row"]
    m = microbatches(args, S)

    class Record(L.Callback):
        def __init__(self, timelines: bool):
            self.steps, self.profiles, self.timelines = [], [], timelines

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            s, step = trainer.strategy.pipeline, trainer.global_step - 1  # global_step counts the finished step
            self.steps.append(dict(step=step, row=CLOCK.row, start=s.profiler.step_start, end=time.perf_counter(),
                                   partition=list(s.partition.boundaries), busy=list(s.rank_busy_seconds),
                                   wall=max(s.rank_wall_seconds)))
            if self.timelines:  # every rank's chunks (one clock on one host), for the calibration
                parts = [None] * dist.get_world_size()
                dist.all_gather_object(parts, s.last_step_events())
                self.steps[-1]["events"] = [e for p in parts for e in p]
            r = s.rebalancer
            if r.profile_step == step and r.profiled_costs is not None:  # decided before this step on the last one
                self.profiles.append(dict(step=step - 1, forward=list(r.profiled_costs.forward),
                                          backward=list(r.profiled_costs.backward)))

    out: dict = {}
    for case in args.cases.split(","):
        c = plan["cases"][case]
        CLOCK.set(c["forward"], c["backward"], c["reference"])
        slow = _slowdown(c, 0, S)
        CLOCK.slowdown = [_slowdown(c, r, S)[int(os.environ["RANK"])] for r in range(len(c["forward"]))] \
            if slow else None
        per = 1 if c["per_iteration"] else c.get("per_row", per_row)
        rows = rows_of_steps(WARMUP, len(c["forward"]), per)
        g = torch.Generator().manual_seed(0)
        data = torch.randint(0, 1 << 15, (len(rows) * m * MICRO_BATCH, SEQ + 1), generator=g)
        ds = TensorDataset(data[:, :-1].contiguous(), data[:, 1:].contiguous())
        for name, options in _configs(c):
            torch.manual_seed(0)
            CLOCK.row = 0
            dynamic = name == "dynmo"
            rec = Record(timelines=name == "uniform" and case == args.cases.split(",")[0])
            requests = dynamic and case != "freezing" and not c["per_iteration"] and not c.get("slow_rows")
            callbacks = [ScenarioClock(rows, requests=requests,
                                       first_request=WARMUP - 1 if dynamic else None), rec]
            if c["frozen"]:
                sched = {WARMUP + r * per: n for r, n in enumerate(c["frozen"]) if n > 0}
                callbacks.insert(1, LayerFreezing(schedule=sched, threshold=None, max_frozen=len(c["params"]) - 2))
            strategy = DynMoStrategy(pipeline_parallel=S, microbatches=m, plot=False, timeout=180, **options)
            trainer = L.Trainer(accelerator="cpu", devices=S, strategy=strategy, max_steps=len(rows), logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                limit_val_batches=0, callbacks=callbacks, default_root_dir=tempfile.mkdtemp())
            err = None
            t0 = time.perf_counter()
            try:
                trainer.fit(EmulatedGPT(c["params"], c["reports_load"]),
                            DataLoader(ds, batch_size=m * MICRO_BATCH, shuffle=False, drop_last=True))
            except Exception as e:  # a failing configuration is a result too: report it
                from lightning_dynmo import RankFailedError

                if isinstance(e, RankFailedError):  # the job lost a rank: no later configuration can run
                    raise
                err = f"{type(e).__name__}: {e}"[:800]
            out[f"{case}/{name}"] = dict(
                error=err, steps=rec.steps, profiles=rec.profiles, wall=time.perf_counter() - t0,
                decisions=[{k: h.get(k) for k in ("step", "reason", "before", "after", "applied", "migration_ms",
                                                  "moved_layers")} for h in strategy.pipeline.rebalance_history])
    if int(os.environ.get("RANK", "0")) == 0:
        json.dump(out, open(args.out, "w"))


# ------------------------------------------------------------------------------ summary (launcher)
def _costs(case_plan: dict, row: int):
    from lightning_dynmo.plan.cost_model import LayerCosts

    f, b, p = case_plan["forward"][row], case_plan["backward"][row], case_plan["params"]
    return LayerCosts(f, b, p, [16.0 * x for x in p], [0.0] * len(p))


def calibrate(case_plan: dict, run: dict, m: int) -> dict:
    """The emulation's own per-chunk, per-message and per-step costs, read off the dense steady
    steps (row 0, after the first step) of one static run, as ``benchmarks/simulator_validation.py``
    calibrates the simulator: ``alpha`` (seconds per chunk beyond its layers' waits: the
    schedule's work, posting messages, the last wait's overshoot), the messages' send / receive
    overheads and latency (:func:`lightning_dynmo.sim.calibrate.message_costs`) and ``beta``
    (seconds per step outside the schedule: the step's all-reduce, the optimizer, Lightning's hooks)."""
    from lightning_dynmo.sim.calibrate import message_costs

    steps = [s for s in run["steps"] if s["row"] == 0 and s["step"] >= 1 and s.get("events")]
    if not steps:
        return dict(alpha=0.0, send=0.0, recv=0.0, latency=0.0, beta=0.0)
    b = steps[0]["partition"]
    costs = _costs(case_plan, 0)
    layers = sum(m * (sum(costs.forward[b[s]:b[s + 1]]) + sum(costs.backward[b[s]:b[s + 1]]))
                 for s in range(len(b) - 1))
    alpha = statistics.median(max(0.0, (sum(s["busy"]) - layers) / (2 * m * (len(b) - 1))) for s in steps)
    msg = message_costs([s["events"] for s in steps], len(b) - 1)
    beta = statistics.median(s["end"] - s["start"] - s["wall"] for s in steps)
    return dict(alpha=alpha, send=msg.send_overhead, recv=msg.recv_overhead, latency=msg.latency, beta=max(0.0, beta))


def _sim_step(case_plan: dict, row: int, boundaries: list[int], m: int, cal: dict | None = None) -> float:
    """Simulated step seconds: free links and no overheads, or (``cal``) the calibrated ones."""
    from lightning_dynmo.plan.partition import Partition
    from lightning_dynmo.sim import Link, simulate

    costs, part = _costs(case_plan, row), Partition(tuple(boundaries))
    slow = _slowdown(case_plan, row, part.num_stages)
    if cal is None:
        return simulate(costs, part, "1f1b", m, rank_slowdown=slow).step_time
    link = Link(cal["latency"], None, cal["send"], cal["recv"])
    return simulate(costs, part, "1f1b", m, link=link, action_overhead=cal["alpha"],
                    rank_slowdown=slow).step_time + cal["beta"]


def _run_summary(case_plan: dict, run: dict, m: int, per_row: int, cal: dict) -> dict:
    """Iteration-weighted measured and simulated step time of one run."""
    from _emulated_model import measured_steps

    per = 1 if case_plan["per_iteration"] else case_plan.get("per_row", per_row)
    n_rows = len(case_plan["forward"])
    by_step = {s["step"]: s for s in run["steps"]}
    if per == 1:
        keep = {r: [WARMUP + r] for r in range(n_rows)}
    else:
        keep = measured_steps(WARMUP, n_rows, per)
    meas, sim, raw, parts = [], [], [], []
    for r in range(n_rows):
        steps = [by_step[i] for i in keep[r] if i in by_step]
        if not steps:
            return {"error": f"row {r} has no measured step"}
        meas.append(statistics.mean(s["end"] - s["start"] for s in steps))
        sim.append(statistics.mean(_sim_step(case_plan, r, s["partition"], m, cal) for s in steps))
        raw.append(statistics.mean(_sim_step(case_plan, r, s["partition"], m) for s in steps))
        parts.append(steps[-1]["partition"])
    w = case_plan["weights"]
    total_m = sum(a * b for a, b in zip(w, meas)) / sum(w)
    total_s = sum(a * b for a, b in zip(w, sim)) / sum(w)
    total_r = sum(a * b for a, b in zip(w, raw)) / sum(w)
    return dict(step_s=round(total_m, 4), sim_step_s=round(total_s, 4), sim_error=round(abs(total_m / total_s - 1), 4),
                sim_free_step_s=round(total_r, 4), sim_free_error=round(abs(total_m / total_r - 1), 4),
                row_step_s=[round(x, 4) for x in meas], row_sim_s=[round(x, 4) for x in sim],
                row_sim_error_max=round(max(abs(a / b - 1) for a, b in zip(meas, sim)), 4),
                partitions=[str(tuple(p)) for p in parts])


def _overhead(case_plan: dict, run: dict, m: int, step_s: float) -> float | None:
    """Per profiled step: the busiest stage's measured-minus-asked layer time over the step."""
    rows = {s["step"]: (s["row"], s["partition"]) for s in run["steps"]}
    fracs = []
    for prof in run["profiles"]:
        if prof["step"] not in rows:
            continue
        row, bounds = rows[prof["step"]]
        f, b = case_plan["forward"][row], case_plan["backward"][row]
        extra = [(mf - af) + (mb - ab) if mb > 0 else (mf - af)
                 for mf, mb, af, ab in zip(prof["forward"], prof["backward"], f, b)]
        per_stage = [sum(extra[a:z]) * m for a, z in zip(bounds, bounds[1:])]
        fracs.append(max(per_stage) / step_s)
    return round(statistics.median(fracs), 4) if fracs else None


def _projection(case_plan: dict, S: int, m: int) -> float:
    from lightning_dynmo.plan.cost_model import LayerCosts
    from lightning_dynmo.sim.scenarios import Snapshot, compare

    p = case_plan["params"]
    if case_plan.get("slow_rows"):
        from lightning_dynmo.sim.scenarios.straggler import Phase, project

        n = len(case_plan["forward"])
        phases = [Phase(case_plan["per_row"], tuple(1.0 / x for x in _slowdown(case_plan, r, S))) for r in range(n)]
        snap = Snapshot(_costs(case_plan, 0), 1.0, tuple([0.0] * len(p)))
        r = project(snap, phases, "1f1b", m, static=("uniform", "param", "static_time"), react_steps=1)
        return round(min(r.seconds["uniform"], r.seconds["param"]) / r.seconds["dynmo"], 4)
    traj = [Snapshot(LayerCosts(f, b, p, [16.0 * x for x in p], [0.0] * len(p)), w, tuple([0.0] * len(p)))
            for f, b, w in zip(case_plan["forward"], case_plan["backward"], case_plan["weights"])]
    c = compare(traj, S, "1f1b", m, static=("uniform", "param"), dynamic=("partition_time",))
    return round(c.speedup["partition_time"], 4)


def summarise(plan: dict, results: dict, args) -> dict:
    res: dict = {"benchmark": "emulated_scale", "quick": args.quick, "smoke": args.smoke, "layers": LAYERS,
                 "schedule": "1f1b",
                 "step_seconds_target_8": args.step_seconds, "per_row": plan["per_row"],
                 "microbatches": {str(S): microbatches(args, S) for S in results}, "runs": {}, "errors": {}}
    errors, overheads = [], []
    for S, runs in results.items():
        m = microbatches(args, int(S))
        first = next(iter(plan["cases"]))
        cal = calibrate(plan["cases"][first], runs[f"{first}/uniform"], m) if f"{first}/uniform" in runs else None
        if cal:
            res.setdefault("calibration_ms", {})[str(S)] = {k: round(v * 1e3, 3) for k, v in cal.items()}
        for case, cp in plan["cases"].items():
            cell = {}
            for name in ("uniform", "param", "dynmo"):
                run = runs.get(f"{case}/{name}")
                if run is None:
                    continue
                if run["error"]:
                    res["errors"][f"{case}/{name}@{S}"] = run["error"]
                    continue
                cell[name] = _run_summary(cp, run, m, plan["per_row"], cal)
                if "error" in cell[name]:
                    res["errors"][f"{case}/{name}@{S}"] = cell[name]["error"]
                    del cell[name]
                    continue
                errors.append(cell[name]["sim_error"])
                if name == "dynmo":
                    cell[name]["migrations"] = sum(1 for d in run["decisions"] if d["applied"])
                    cell[name]["decisions"] = len(run["decisions"])
                    oh = _overhead(cp, run, m, cell[name]["step_s"])
                    cell[name]["overhead_fraction"] = oh
                    if oh is not None:
                        overheads.append(oh)
            if not cell:
                continue
            res["runs"][f"{case}@{S}"] = cell
            static = [n for n in ("uniform", "param") if n in cell]
            if "dynmo" in cell and static:
                best = min(static, key=lambda n: cell[n]["step_s"])
                sim_best = min(cell[n]["sim_step_s"] for n in static)
                dyn = cell["dynmo"]
                res.setdefault(f"speedup_vs_static_{S}", {})[case] = round(cell[best]["step_s"] / dyn["step_s"], 4)
                res.setdefault(f"sim_speedup_vs_static_{S}", {})[case] = round(sim_best / dyn["sim_step_s"], 4)
                res.setdefault(f"projection_speedup_{S}", {})[case] = _projection(cp, int(S), m)
    res["max_sim_error"] = max(errors) if errors else None
    res["overhead_fraction"] = max(overheads) if overheads else None
    return res


# ------------------------------------------------------------------------------ launcher
def main(argv=None) -> None:
    args = _args(argv)
    if args.worker:
        _worker(args)
        return
    stages = [int(s) for s in (args.stages or ("8,16" if args.quick else "8,16,24")).split(",")]
    cases = (args.cases or ",".join(EVENT_CASES)).split(",")
    known = EVENT_CASES + PER_ITERATION_CASES + STRAGGLER_CASES
    bad = [c for c in cases if c not in known]
    if bad or any(s < 2 for s in stages):
        sys.exit(f"cases must be among {known}, stages >= 2; got {cases}, {stages}")
    per_row = args.per_row or (2 if args.quick else 3)
    if per_row < 2:
        sys.exit("--per-row must be >= 2 (a row's first step is profiled and not measured)")
    plan = build_plan(args, cases, per_row)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        plan_path = os.path.join(tmp, "plan.json")
        json.dump(plan, open(plan_path, "w"))
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        for S in stages:
            # the quick run covers the event cases at 8 stages and freezing at the deeper ones
            run_cases = cases if (S == stages[0] or not args.quick) else cases[:1]
            out = os.path.join(tmp, f"runs_{S}.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(S), "--standalone",
                   os.path.abspath(__file__), "--worker", "--plan", plan_path, "--out", out, "--stages", str(S),
                   "--cases", ",".join(run_cases), "--microbatches", str(args.microbatches), "--nice", str(args.nice)]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
            if proc.returncode != 0 or not os.path.exists(out):
                sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
                results[S] = {}
                print(f"{S} stages: torchrun exit {proc.returncode}")
                continue
            results[S] = json.load(open(out))
            print(f"{S} stages: {time.perf_counter() - t0:.0f} s")
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
        json.dump({"plan": plan, "results": results}, open(os.path.join(args.keep, "emulated_scale_raw.json"), "w"))
    summary = summarise(plan, results, args)
    for key, cell in summary["runs"].items():
        for name, r in cell.items():
            print(f"{key:16s} {name:8s} step {r['step_s']:.3f} s  sim {r['sim_step_s']:.3f} s  "
                  f"err {r['sim_error']:.3f}  final {r['partitions'][-1]}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
