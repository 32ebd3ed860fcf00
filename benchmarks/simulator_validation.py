"""Validate the pipeline simulator (lightning_dynmo.sim) against real 2-rank pipeline runs.

    python benchmarks/simulator_validation.py [--quick]
    python benchmarks/simulator_validation.py --smoke     # seconds: 18 steps, profiles after steps 9 and 13

What it does, in one invocation:

1. **Real runs** (torchrun, 2 ranks = 2 pipeline stages, gloo, 1 thread each, 1F1B, 4
   micro-batches), static (``balancer="uniform"``) and dynamic (``balancer="partition_time"``) for
   three cases: a lopsided GPT (heterogeneous ``mlp_ratios``), early exit (``EarlyExitGPT`` +
   ``EarlyExit``) and layer freezing (``LayerFreezing``). Both variants run with
   ``rebalance="on_event"``, so both profile at the same events and write ``cost_trace.jsonl``;
   the static balancer keeps Megatron's partition. Variants interleave over rounds. Every step
   records both ranks' chunk timeline (one clock on one host), busy and schedule wall times.
2. **Replay**: every steady-state profile of a run (a cost-trace row: per-layer forward/backward
   seconds, scaled by the layers' load counters of the measured steps as the strategy itself
   does, c_i = r_i t_i, plus the per-chunk overhead its busy time shows) is simulated with the
   partition, schedule and micro-batches of the *non-profiled* steps that follow it up to the
   next profile, and compared with their median: the schedule's wall time and the full step time
   (schedule + per-step overhead + optimizer). A run is the median over its profiles on its final
   partition; a configuration the median over its interleaved rounds.
3. **Calibration from the run's own past only** (the profiled step and up to ``WINDOW`` steady
   steps before it on the same partition; every predicted step comes after them): per-message
   send / receive overheads and latency read off the chunk timeline
   (:func:`lightning_dynmo.sim.calibrate.message_costs`; inside a running gloo pipeline on a
   busy host a message costs milliseconds of its ranks' time, 50x what an idle ping-pong shows,
   and was the largest error before), each rank's speed relative to the profile (median busy
   time over the window / the busy time the profile predicts: host load since the profile, the
   profiled step's hooks), and the per-step overhead outside the schedule (median step - schedule
   wall, less the optimizer). The optimizer: the model's own AdamW step, seconds per *trainable*
   parameter (frozen layers are skipped), measured once in this process.

The last line is one JSON object: ``max_step_time_error`` (|pred - meas| / meas, max over the
configurations; target <= 0.10), ``max_schedule_time_error``, ``step_time_error_per_run``,
``component_bias_ms`` (median over runs of predicted - measured: slowest rank's busy time,
communication + waiting inside the schedule, time outside it), ``ranking_matches`` (in every case
the measured static-vs-dynamic order equals the simulator's: both final partitions simulated on
the same profiles, as a balancer compares them), ``ranking_matches_run_predictions`` (the same
from each run's own prediction; a case whose dynamic run kept the static partition has no order
to predict: ``matches`` null, counted out of ``ranking_cases_compared``), the measured
round-to-round spread (the noise floor of the machine), per-run details (components measured vs
predicted, calibration, and what the comparison leaves out: profiled steps, the first step).

Per-layer costs are not perfectly independent of the partition on a CPU (caches, frequency, the
neighbour rank's activity): a what-if prediction from another partition's profile carries that
error, which a prediction from the run's own profile does not. Host load that changes *after*
the calibration window (other jobs on a shared machine) is not predictable from the past; only
the median over rounds averages it out.
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODEL = dict(vocab_size=256, block_size=64, n_layer=8, n_head=4, n_embd=128, dropout=0.0)
LOPSIDED = (12, 12, 4, 1, 1, 1, 1, 1)  # per-block MLP width ratios: a heavy front
CASES = ("lopsided", "early_exit", "freezing")
WARMUP = 3  # steps before the first that calibrates or is predicted
WINDOW = 4  # steady steps before a profile that calibrate its prediction
#: keys the last JSON line always has (tests/unit/test_benchmarks_smoke.py checks them on ``--smoke``)
RESULT_KEYS = ("benchmark", "stages", "schedule", "max_step_time_error", "mean_step_time_error",
               "max_schedule_time_error", "ranking_matches", "ranking_cases_compared", "speedup_static_to_dynamic",
               "component_bias_ms", "calibration", "configs", "runs", "seconds")


def _plan(quick: bool, smoke: bool = False) -> dict:
    steps, rounds, profiles = ((18, 1, (9, 13)) if smoke else (25, 1, (9, 13, 17)) if quick
                               else (48, 3, (10, 16, 22, 28)))
    runs = [(c, v) for c in CASES for v in ("static", "dynamic")]
    # early exit re-checks its exits (and asks for a rebalance when they moved) every exit_check steps;
    # the smoke run checks less often, so its few steps still hold a steady stretch to replay
    return dict(steps=steps, rounds=rounds, event=4, profiles=profiles, batch=8 if smoke else 16, microbatches=4,
                runs=runs, exit_check=6 if smoke else 2, model=dict(MODEL, n_embd=32) if smoke else MODEL)


# ------------------------------------------------------------------------------ worker side
def _worker(args) -> None:
    import torch

    torch.set_num_threads(1)
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_dynmo import DynMoStrategy
    from lightning_dynmo.callbacks import EarlyExit, LayerFreezing
    from lightning_dynmo.models import GPT, EarlyExitGPT, GPTConfig

    plan = _plan(args.quick, args.smoke)
    n = plan["batch"] * plan["steps"]
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, plan["model"]["vocab_size"], (n, plan["model"]["block_size"] + 1), generator=g)
    ds = TensorDataset(data[:, :-1].contiguous(), data[:, 1:].contiguous())

    class ProfileAt(L.Callback):
        """Ask for a profiled step (and a rebalance decision) after each of ``steps``: the trace
        then holds several profiles of the steady state (a single profiled step is noisy)."""

        def __init__(self, steps):
            self.steps = set(steps)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step in self.steps:
                trainer.strategy.pipeline.request_rebalance("validation: profile")

    class Recorder(L.Callback):
        """Per step: its start, the pipeline ranks' schedule wall and busy seconds, whether it was
        profiled, the partition and load counters; and this rank's own timeline (the start of the
        optimizer step, the end of the step, every chunk of the schedule): perf_counter is the
        system-wide monotonic clock, so the ranks' timelines line up."""

        def __init__(self):
            self.start, self.wall, self.busy, self.profiled, self.partition, self.load = [], [], [], [], [], []
            self.opt_start, self.end, self.chunks, self.schedule_start = [], [], [], []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.start.append(time.perf_counter())
            self.opt_start.append(None)

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.opt_start[-1] = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.end.append(time.perf_counter())
            s = trainer.strategy.pipeline
            self.wall.append(max(s.rank_wall_seconds or [0.0]))
            self.busy.append(list(s.rank_busy_seconds))
            self.profiled.append(bool(s.rebalancer.profiling))
            self.partition.append(list(s.partition.boundaries))
            self.load.append(s.layer_load)
            self.chunks.append([[e["stage"], e["kind"], e["mb"], e["start"], e["end"]] for e in s.last_step_events()])
            self.schedule_start.append(s.profiler.step_start)

    out = []
    for rnd in range(plan["rounds"]):
        for case, variant in plan["runs"]:
            torch.manual_seed(0)
            cfg = GPTConfig(**plan["model"], mlp_ratios=LOPSIDED if case == "lopsided" else None)
            cbs = []
            if case == "early_exit":
                model = EarlyExitGPT(cfg, seed=0, warmup_steps=2, max_steps=plan["steps"])
                cbs.append(EarlyExit(schedule={plan["event"]: 0.93}, check_interval=plan["exit_check"]))
            else:
                model = GPT(cfg, seed=0, warmup_steps=2, max_steps=plan["steps"])
            if case == "freezing":
                cbs.append(LayerFreezing(schedule={plan["event"]: 6}))  # embedding + 5 of 8 blocks
            cbs.append(ProfileAt(([plan["event"]] if case == "lopsided" else []) + list(plan["profiles"])))
            rec = Recorder()
            root = tempfile.mkdtemp(prefix="simval_")
            strategy = DynMoStrategy(pipeline_parallel=2, schedule="1f1b", microbatches=plan["microbatches"],
                                     balancer="uniform" if variant == "static" else "partition_time",
                                     rebalance="on_event", rebalance_cooldown=1, plot=False, timeout=300)
            trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=plan["steps"], logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                limit_val_batches=0, callbacks=[*cbs, rec], default_root_dir=root)
            err = None
            try:
                trainer.fit(model, DataLoader(ds, batch_size=plan["batch"], shuffle=False, drop_last=True))
            except Exception as e:  # a failing run is a result too
                from lightning_dynmo import RankFailedError

                if isinstance(e, RankFailedError):  # the job lost a rank: no later configuration can run
                    raise
                err = f"{type(e).__name__}: {e}"[:500]
            trace = []
            path = os.path.join(root, "cost_trace.jsonl")
            if os.path.exists(path):
                trace = [json.loads(line) for line in open(path)]
            out.append(dict(case=case, variant=variant, round=rnd, error=err, start=rec.start, wall=rec.wall,
                            busy=rec.busy, profiled=rec.profiled, partition=rec.partition, load=rec.load, trace=trace,
                            timeline=dict(start=rec.start, opt_start=rec.opt_start, end=rec.end, chunks=rec.chunks,
                                          schedule_start=rec.schedule_start)))
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        with open(args.out, "w") as fh:
            json.dump(out, fh)
    else:  # only this rank's timeline: the rest is the same on every rank
        with open(f"{args.out}.rank{rank}", "w") as fh:
            json.dump([r["timeline"] for r in out], fh)


# ------------------------------------------------------------------------------ launcher side
def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _torchrun(extra: list[str], out: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           os.path.abspath(__file__), "--out", out, *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True)
    if proc.returncode != 0 or not os.path.exists(out) or not os.path.exists(f"{out}.rank1"):
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        print(json.dumps({"benchmark": "simulator_validation", "error": f"torchrun exit {proc.returncode}"}))
        sys.exit(1)
    with open(out) as fh:
        runs = json.load(fh)
    with open(f"{out}.rank1") as fh:  # each run's timeline per rank: [rank 0's, rank 1's]
        for run, tl in zip(runs, json.load(fh)):
            run["timeline"] = [run["timeline"], tl]
    with open(out, "w") as fh:
        json.dump(runs, fh)


def optimizer_seconds_per_param(quick: bool) -> float:
    """The GPT's own AdamW step (configure_optimizers), 1 thread, per parameter."""
    import torch

    from lightning_dynmo.models import GPT, GPTConfig

    torch.set_num_threads(1)
    model = GPT(GPTConfig(**{**MODEL, "n_layer": 16}), seed=0)
    opt = model.configure_optimizers()
    opt = opt["optimizer"] if isinstance(opt, dict) else (opt[0][0] if isinstance(opt, tuple) else opt)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    times = []
    for _ in range(8 if quick else 20):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:]) / sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------ analysis
def _step_seconds(run: dict, k: int) -> float:
    return run["start"][k + 1] - run["start"][k]


def _steady(run: dict, k: int) -> bool:
    """A step that neither profiles nor acts on a profile (decision, migration), after warm-up."""
    return k >= WARMUP and not run["profiled"][k] and not run["profiled"][k - 1]


def _segments(run: dict) -> list[tuple[dict, list[int]]]:
    """Each steady-state profile (trace row) with the steps it predicts: the non-profiled steps
    after its decision (and migration) up to the next profiled step, on one partition. Pairing
    a profile with the steps right after it keeps slow drifts of the machine (and of the model)
    out of the comparison."""
    n = len(run["wall"])
    prof = run["profiled"]
    out = []
    for row in run["trace"]:
        d = row["step"]  # the decision step; the profiled step is d - 1
        if d - 1 < 8:  # the first steps and the dynamism event are transients
            continue
        steps = []
        for k in range(d + 1, n - 1):
            if prof[k]:
                break
            steps.append(k)
        steps = [k for k in steps if run["partition"][k] == run["partition"][steps[0]]] if steps else []
        if len(steps) >= 2:
            out.append((row, steps))
    return out


def _window(run: dict, row: dict) -> list[int]:
    """The past that calibrates a profile's prediction: up to ``WINDOW`` steady steps before
    the profiled step, on the profile's partition (latest first)."""
    p = row["step"] - 1
    out = []
    for k in range(p - 1, WARMUP - 1, -1):
        if run["partition"][k] != row["partition"]:
            break
        if _steady(run, k):
            out.append(k)
        if len(out) == WINDOW:
            break
    return out


def _events(run: dict, k: int) -> list[dict]:
    """Step ``k``'s chunks of both ranks, as lightning_dynmo.plotting draws them."""
    return [dict(rank=r, stage=c[0], kind=c[1], mb=c[2], start=c[3], end=c[4])
            for r, tl in enumerate(run["timeline"]) for c in tl["chunks"][k]]


def _costs(row: dict, run: dict, steps: list[int]):
    """The row's per-layer costs scaled by the layers' load counters to those of ``steps``
    (c_i = r_i t_i, as the strategy does), and the per-chunk overhead the row shows (busy time
    of the profiled step the layer hooks do not see)."""
    from lightning_dynmo.plan.cost_model import LayerCosts
    from lightning_dynmo.plan.measurements import scale_by_load

    costs = LayerCosts(row["forward"], row["backward"], row["params"], row["memory"], row["activation"])
    loads = [run["load"][k] for k in steps if run["load"][k]]
    if loads and row.get("layer_load"):
        now = [None if any(x[i] is None for x in loads) else statistics.median(x[i] for x in loads)
               for i in range(costs.num_layers)]
        costs = scale_by_load(costs, now, row["layer_load"])
    b, m = row["partition"], row["microbatches"]
    layer_sum = sum(m * (sum(row["forward"][b[s]:b[s + 1]]) + sum(row["backward"][b[s]:b[s + 1]]))
                    for s in range(len(b) - 1))
    alpha = max(0.0, (sum(row["rank_busy"]) - layer_sum) / (2 * m * (len(b) - 1)))
    return costs, alpha


def _optimizer_seconds(row: dict, boundaries, per_param: float) -> float:
    """AdamW on the rank with the most trainable parameters (frozen layers, backward 0, have no
    gradients and are skipped by the optimizer)."""
    trainable = [p if bwd > 0 else 0 for p, bwd in zip(row["params"], row["backward"])]
    b = boundaries
    return per_param * max(sum(trainable[b[s]:b[s + 1]]) for s in range(len(b) - 1))


def _calibrate(row: dict, run: dict, opt_per_param: float) -> dict | None:
    """Everything a prediction takes besides the profile, read off the run's own *past* (the
    profiled step and the steady steps before it, never the steps it predicts): per-message
    costs from the chunk timeline, each rank's speed relative to the profile (its median busy
    time over the window / the busy time the profile predicts for it: load on the host, the
    profiled step's hooks), and the per-step overhead outside the schedule (median step - schedule
    wall, less the optimizer). None when the run has no such past."""
    from lightning_dynmo.plan.partition import Partition
    from lightning_dynmo.sim import Link, simulate
    from lightning_dynmo.sim.calibrate import message_costs

    win = _window(run, row)
    if not win:
        return None
    P = Partition(tuple(row["partition"]))
    m, S = row["microbatches"], P.num_stages
    costs, alpha = _costs(row, run, win)
    gradient = [any(x > 0 for x in row["backward"][: P.boundaries[s + 1]]) for s in range(S - 1)]
    msg = message_costs([_events(run, k) for k in [*win, row["step"] - 1]], S, gradient)
    profile_busy = simulate(costs, P, row["schedule"], m, action_overhead=alpha).busy
    measured_busy = [statistics.median(run["busy"][k][r] for k in win) for r in range(S)]
    slowdown = [b / p if p > 0 else 1.0 for b, p in zip(measured_busy, profile_busy)]
    outside = statistics.median(_step_seconds(run, k) - run["wall"][k] for k in win)
    return dict(window=win, link=Link(msg.latency, None, msg.send_overhead, msg.recv_overhead), alpha=alpha,
                slowdown=slowdown, beta=outside - _optimizer_seconds(row, P.boundaries, opt_per_param),
                opt_per_param=opt_per_param, message_samples=msg.samples)


def _predict(row: dict, run: dict, steps: list[int], part, cal: dict):
    """Simulated schedule and predicted step time of ``steps`` on ``part`` from ``row``."""
    from lightning_dynmo.sim import simulate

    costs, _ = _costs(row, run, steps)
    sim = simulate(costs, part, row["schedule"], row["microbatches"], link=cal["link"], action_overhead=cal["alpha"],
                   rank_slowdown=cal["slowdown"])
    outside = cal["beta"] + _optimizer_seconds(row, part.boundaries, cal["opt_per_param"])
    return sim, sim.step_time + outside, outside


def _most_common(items: list) -> list:
    """The most frequent item; ties go to the earliest."""
    keys = [json.dumps(x) for x in items]
    return json.loads(max(dict.fromkeys(keys), key=keys.count))


def _side_costs(run: dict) -> dict:
    """What the comparison leaves out, measured: profiled steps against steady ones, and the
    first step (warm-up); the simulator predicts steady steps."""
    n = len(run["wall"])
    steady = [_step_seconds(run, k) for k in range(WARMUP, n - 1) if _steady(run, k)]
    prof = [_step_seconds(run, k) for k in range(WARMUP, n - 1) if run["profiled"][k]]
    base = statistics.median(steady)
    return dict(profiled_step_extra=statistics.median(prof) / base - 1 if prof else None,
                first_step_ms=1e3 * _step_seconds(run, 0), steady_step_ms=1e3 * base)


def analyse(runs: list[dict], opt_per_param: float) -> dict:
    from lightning_dynmo.plan.partition import Partition

    runs = [r for r in runs if r["case"] in CASES]
    bad = [f"{r['case']}/{r['variant']}/{r['round']}: {r['error'] or 'no cost trace'}" for r in runs
           if r["error"] or not r["trace"]]
    if bad:
        raise RuntimeError("runs failed: " + "; ".join(bad))
    med = statistics.median

    details = []
    for run in runs:
        segs = []
        for row, steps in _segments(run):
            cal = _calibrate(row, run, opt_per_param)
            if cal is None:
                continue
            part = Partition(tuple(run["partition"][steps[0]]))
            sim, pred, outside = _predict(row, run, steps, part, cal)
            busy = [med(run["busy"][k][r] for k in steps) for r in range(part.num_stages)]
            sched = med(run["wall"][k] for k in steps)
            segs.append(dict(
                part=str(part), steps=len(steps), step=med(_step_seconds(run, k) for k in steps), sched=sched,
                pred=pred, sim=sim.step_time, bubble=sim.bubble_fraction,
                busy=busy, pred_busy=list(sim.busy),
                comm=sched - max(busy), pred_comm=sim.step_time - max(sim.busy),
                outside=med(_step_seconds(run, k) - run["wall"][k] for k in steps), pred_outside=outside,
                send_ms=1e3 * cal["link"].send_overhead, recv_ms=1e3 * cal["link"].recv_overhead,
                latency_ms=1e3 * cal["link"].latency, alpha_ms=1e3 * cal["alpha"], beta_ms=1e3 * cal["beta"],
                slowdown=cal["slowdown"],
            ))
        if not segs:
            raise RuntimeError(f"{run['case']}/{run['variant']}/r{run['round']}: no steady-state profile to replay")
        last = segs[-1]["part"]  # the partition the run settled on
        segs = [g for g in segs if g["part"] == last]
        m = lambda k: med(g[k] for g in segs)  # noqa: E731
        mr = lambda k: [med(g[k][r] for g in segs) for r in range(len(segs[0][k]))]  # noqa: E731
        step, sched, pred_step, pred_sched = m("step"), m("sched"), m("pred"), m("sim")
        ms = lambda x: 1e3 * x  # noqa: E731
        details.append(dict(
            case=run["case"], variant=run["variant"], round=run["round"], partition=last,
            profiles_used=len(segs), measured_steps=sum(g["steps"] for g in segs),
            measured_step_ms=ms(step), predicted_step_ms=ms(pred_step),
            measured_schedule_ms=ms(sched), predicted_schedule_ms=ms(pred_sched),
            step_error=abs(pred_step - step) / step, schedule_error=abs(pred_sched - sched) / sched,
            predicted_bubble=m("bubble"),
            # where the time goes, measured vs predicted (medians over the profiles used)
            components=dict(
                busy_ms=[round(ms(x), 2) for x in mr("busy")],
                predicted_busy_ms=[round(ms(x), 2) for x in mr("pred_busy")],
                comm_wait_ms=round(ms(m("comm")), 2), predicted_comm_wait_ms=round(ms(m("pred_comm")), 2),
                outside_schedule_ms=round(ms(m("outside")), 2),
                predicted_outside_schedule_ms=round(ms(m("pred_outside")), 2),
            ),
            calibration=dict(send_overhead_ms=round(m("send_ms"), 3), recv_overhead_ms=round(m("recv_ms"), 3),
                             latency_ms=round(m("latency_ms"), 3), chunk_overhead_ms=round(m("alpha_ms"), 3),
                             step_overhead_ms=round(m("beta_ms"), 3),
                             rank_slowdown=[round(x, 3) for x in mr("slowdown")]),
            excluded=_side_costs(run),
        ))
    # one configuration = (case, variant); its rounds interleave with the others' on a shared
    # machine, so each is summarised by the median over rounds (per-round errors are kept too)
    configs = []
    for case in CASES:
        for v in ("static", "dynamic"):
            ds = [d for d in details if d["case"] == case and d["variant"] == v]
            mm = {k: med(d[k] for d in ds) for k in
                  ("measured_step_ms", "predicted_step_ms", "measured_schedule_ms", "predicted_schedule_ms")}
            measured = [d["measured_step_ms"] for d in ds]
            spread = (max(measured) - min(measured)) / mm["measured_step_ms"]
            configs.append(dict(case=case, variant=v, partitions=sorted({d["partition"] for d in ds}), **mm,
                                step_error=abs(mm["predicted_step_ms"] - mm["measured_step_ms"])
                                / mm["measured_step_ms"],
                                schedule_error=abs(mm["predicted_schedule_ms"] - mm["measured_schedule_ms"])
                                / mm["measured_schedule_ms"], measured_round_spread=spread))
    # ranking: the measured speedup (medians over interleaved rounds) against the simulator's
    # what-if speedup: the static partition and each dynamic run's final partition simulated
    # on the same profiles (every steady-state profile of the case's runs, each calibrated on
    # its own run's past), as a balancer compares partitions, median over the dynamic runs; the
    # speedup of the per-run predictions above is reported beside it
    ranking = {}
    for case in CASES:
        mc = {c["variant"]: c for c in configs if c["case"] == case}
        static = Partition(tuple(_most_common([r["partition"][-1] for r in runs
                                               if r["case"] == case and r["variant"] == "static"])))
        dyn_runs = [Partition(tuple(r["partition"][-1])) for r in runs
                    if r["case"] == case and r["variant"] == "dynamic"]
        profiles = [(row, run, steps, _calibrate(row, run, opt_per_param))
                    for run in runs if run["case"] == case for row, steps in _segments(run)]
        per_partition = {}
        for part in dict.fromkeys(dyn_runs):  # each final partition a dynamic run settled on
            ratios = []
            for row, run, steps, cal in profiles:
                if cal is not None:
                    t = [_predict(row, run, steps, q, cal)[1] for q in (static, part)]
                    ratios.append(t[0] / t[1])
            per_partition[part] = med(ratios)
        meas = mc["static"]["measured_step_ms"] / mc["dynamic"]["measured_step_ms"]
        pred = med(per_partition[q] for q in dyn_runs)
        runs_pred = mc["static"]["predicted_step_ms"] / mc["dynamic"]["predicted_step_ms"]
        same = all(q == static for q in dyn_runs)
        ranking[case] = dict(static=str(static), dynamic=[str(q) for q in dyn_runs],
                             measured_speedup=round(meas, 4), predicted_speedup=round(pred, 4),
                             predicted_speedup_from_run_predictions=round(runs_pred, 4),
                             # every dynamic run kept the static partition: no order to predict
                             matches=None if same else (meas > 1) == (pred > 1))
    rnd = lambda d: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items()}  # noqa: E731
    comp = [d["components"] for d in details]
    return dict(
        max_step_time_error=round(max(c["step_error"] for c in configs), 4),
        mean_step_time_error=round(statistics.mean(c["step_error"] for c in configs), 4),
        max_schedule_time_error=round(max(c["schedule_error"] for c in configs), 4),
        max_step_time_error_single_round=round(max(d["step_error"] for d in details), 4),
        step_time_error_per_run={f"{d['case']}/{d['variant']}/r{d['round']}": round(d["step_error"], 4)
                                 for d in details},
        max_measured_round_spread=round(max(c["measured_round_spread"] for c in configs), 4),
        ranking_matches=all(r["matches"] for r in ranking.values() if r["matches"] is not None),
        ranking_cases_compared=sum(r["matches"] is not None for r in ranking.values()),
        ranking_matches_run_predictions=all(
            (r["measured_speedup"] > 1) == (r["predicted_speedup_from_run_predictions"] > 1)
            for r in ranking.values() if r["matches"] is not None),
        speedup_static_to_dynamic=ranking,
        # median over runs of (predicted - measured) per component: which part of the step is off
        component_bias_ms=dict(
            busy_slowest_rank=round(med(max(c["predicted_busy_ms"]) - max(c["busy_ms"]) for c in comp), 2),
            comm_wait=round(med(c["predicted_comm_wait_ms"] - c["comm_wait_ms"] for c in comp), 2),
            outside_schedule=round(med(c["predicted_outside_schedule_ms"] - c["outside_schedule_ms"] for c in comp), 2),
        ),
        calibration=dict(
            method=f"per prediction, from its own run's past only: the profiled step and up to {WINDOW} steady steps "
                   "before it on the same partition (chunk timeline: per-message send/receive overhead and latency; "
                   "per-rank busy time: rank slowdown vs the profile; step - schedule wall: per-step overhead); the "
                   "predicted steps all come after the profile. Optimizer: AdamW seconds per trainable parameter, "
                   "measured once in this process",
            optimizer_ns_per_param=round(opt_per_param * 1e9, 3)),
        configs=[rnd(c) for c in configs],
        runs=[rnd(d) for d in details],
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="25 steps, one round of each configuration (no median over rounds)")
    ap.add_argument("--smoke", action="store_true",
                    help="18 steps, two profiles, one round: checks that the script runs (its figures mean nothing)")
    ap.add_argument("--replay", default=None, help="analyse a saved runs file (--save) instead of running")
    ap.add_argument("--save", default=None, help="keep the raw runs (JSON) here")
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if "LOCAL_RANK" in os.environ:
        _worker(args)
        return
    t0 = time.perf_counter()
    if args.replay:
        saved = json.load(open(args.replay))
        runs, opt = saved["runs"], saved["optimizer_seconds_per_param"]
    else:
        with tempfile.TemporaryDirectory() as tmp:
            opt = optimizer_seconds_per_param(args.quick or args.smoke)
            out = os.path.join(tmp, "runs.json")
            _torchrun((["--quick"] if args.quick else []) + (["--smoke"] if args.smoke else []), out)
            runs = json.load(open(out))
        if args.save:
            with open(args.save, "w") as fh:
                json.dump({"runs": runs, "optimizer_seconds_per_param": opt}, fh)
    res = analyse(runs, opt)
    for d in res["configs"]:
        print(f"{d['case']:11s} {d['variant']:7s} {','.join(d['partitions']):20s} "
              f"median step {d['measured_step_ms']:7.1f} ms "
              f"pred {d['predicted_step_ms']:7.1f} ({d['step_error']:.1%}); schedule {d['measured_schedule_ms']:7.1f} "
              f"pred {d['predicted_schedule_ms']:7.1f} ({d['schedule_error']:.1%}); "
              f"rounds spread {d['measured_round_spread']:.0%}")
    for d in res["runs"]:
        c = d["components"]
        print(f"{d['case']:11s} {d['variant']:7s} r{d['round']} {d['partition']:10s} "
              f"step {d['measured_step_ms']:7.1f} ms "
              f"pred {d['predicted_step_ms']:7.1f} ({d['step_error']:.1%}) "
              f"| busy {c['busy_ms']} pred {c['predicted_busy_ms']} "
              f"| comm+wait {c['comm_wait_ms']} pred {c['predicted_comm_wait_ms']} "
              f"| outside {c['outside_schedule_ms']} pred {c['predicted_outside_schedule_ms']}")
    summary = {"benchmark": "simulator_validation", "quick": args.quick, "smoke": args.smoke, "stages": 2,
               "schedule": "1f1b",
               "threads_per_rank": 1, "target_max_step_time_error": 0.10, **res,
               "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
