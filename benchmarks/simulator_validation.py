"""Validate the pipeline simulator (lightning_dynmo.sim) against real 2-rank pipeline runs.

    python benchmarks/simulator_validation.py [--quick]

What it does, in one invocation:

1. **Calibration, once, shared by every prediction** (reported in the JSON):
   * the gloo link between the two local ranks: a ping-pong of 1 KB - 1 MB tensors (activation
     sizes) fitted to ``latency + bytes / bandwidth``;
   * the optimizer: the model's own ``configure_optimizers`` AdamW step, seconds per parameter
     (1 thread), for the per-step work outside the pipeline schedule;
   * a *calibration run* (a balanced GPT, not one of the validated runs) gives the fixed
     per-step overhead outside the schedule (median step wall minus schedule wall, less its
     optimizer time).
2. **Real runs** (torchrun, 2 ranks = 2 pipeline stages, gloo, 1 thread each, 1F1B, 4
   micro-batches), static (``balancer="uniform"``) and dynamic (``balancer="partition_time"``) for
   three cases: a lopsided GPT (heterogeneous ``mlp_ratios``), early exit (``EarlyExitGPT`` +
   ``EarlyExit``) and layer freezing (``LayerFreezing``). Both variants run with
   ``rebalance="on_event"``, so both profile at the same events and write ``cost_trace.jsonl``;
   the static balancer keeps Megatron's partition. Variants interleave over rounds.
3. **Replay**: every steady-state profile of a run (a cost-trace row: per-layer forward/backward
   seconds, scaled by the layers' load counters of the measured steps as the strategy itself
   does, c_i = r_i t_i, plus the per-chunk overhead its busy time shows) is simulated with the
   partition, schedule and micro-batches of the *non-profiled* steps that follow it up to the
   next profile, and compared with their median: the schedule's wall time and the full step time
   (schedule + calibrated per-step overhead). A run is the median over its profiles on its final
   partition; a configuration the median over its interleaved rounds.

The last line is one JSON object: ``max_step_time_error`` (|pred - meas| / meas, max over the
configurations; target <= 0.10), ``max_schedule_time_error``, ``ranking_matches`` (in every case
the measured static-vs-dynamic order equals the simulator's: both final partitions simulated on
the same profiles, as a balancer compares them), ``ranking_matches_run_predictions`` (the same
from each run's own prediction; a case whose dynamic run kept the static partition has no order
to predict: ``matches`` null, counted out of ``ranking_cases_compared``), per-round errors, the
measured round-to-round spread (the noise
floor of the machine), per-run details and the calibration.

Per-layer costs are not perfectly independent of the partition on a CPU (caches, frequency, the
neighbour rank's activity): a what-if prediction from another partition's profile carries that
error, which a prediction from the run's own profile does not.
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
sys.path.insert(0, ROOT)

MODEL = dict(vocab_size=256, block_size=64, n_layer=8, n_head=4, n_embd=128, dropout=0.0)
LOPSIDED = (12, 12, 4, 1, 1, 1, 1, 1)  # per-block MLP width ratios: a heavy front
CASES = ("lopsided", "early_exit", "freezing")


def _plan(quick: bool) -> dict:
    steps, rounds, profiles = (25, 1, (9, 13, 17)) if quick else (48, 3, (10, 16, 22, 28))
    runs = [("calibration", "static")] + [(c, v) for c in CASES for v in ("static", "dynamic")]
    return dict(steps=steps, rounds=rounds, event=4, profiles=profiles, batch=16, microbatches=4, runs=runs)


# ------------------------------------------------------------------------------ worker side
def _pingpong(out: str, quick: bool) -> None:
    """2 ranks: one-way gloo transfer time of float32 tensors of several sizes."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    sizes = [256, 4096, 32768, 131072, 262144]  # floats: 1 KB .. 1 MB
    reps = 15 if quick else 40
    res = {}
    for n in sizes:
        buf = torch.zeros(n)
        times = []
        for i in range(reps + 3):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            if i >= 3:
                times.append((time.perf_counter() - t0) / 2)
        res[4 * n] = statistics.median(times)
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(res, fh)
    dist.destroy_process_group()


def _worker(args) -> None:
    import torch

    torch.set_num_threads(1)
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_dynmo import DynMoStrategy
    from lightning_dynmo.callbacks import EarlyExit, LayerFreezing
    from lightning_dynmo.models import GPT, EarlyExitGPT, GPTConfig

    plan = _plan(args.quick)
    n = plan["batch"] * plan["steps"]
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, MODEL["vocab_size"], (n, MODEL["block_size"] + 1), generator=g)
    ds = TensorDataset(data[:, :-1].contiguous(), data[:, 1:].contiguous())

    class ProfileAt(L.Callback):
        """Ask for a profiled step (and a rebalance decision) after each of ``steps``: the trace
        then holds several profiles of the steady state (a single profiled step is noisy)."""

        def __init__(self, steps):
            self.steps = set(steps)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step in self.steps:
                trainer.strategy.request_rebalance("validation: profile")

    class Recorder(L.Callback):
        def __init__(self):
            self.start, self.wall, self.profiled, self.partition, self.load = [], [], [], [], []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.start.append(time.perf_counter())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            s = trainer.strategy
            self.wall.append(max(s.rank_wall_seconds or [0.0]))
            self.profiled.append(bool(s.rebalancer.profiling))
            self.partition.append(list(s.partition.boundaries))
            self.load.append(s.layer_load)

    out = []
    for rnd in range(plan["rounds"]):
        for case, variant in plan["runs"]:
            if case == "calibration" and rnd > 0:  # one calibration run is enough
                continue
            torch.manual_seed(0)
            cfg = GPTConfig(**MODEL, mlp_ratios=LOPSIDED if case == "lopsided" else None)
            cbs = []
            if case == "early_exit":
                model = EarlyExitGPT(cfg, seed=0, warmup_steps=2, max_steps=plan["steps"])
                cbs.append(EarlyExit(schedule={plan["event"]: 0.93}, check_interval=2))
            else:
                model = GPT(cfg, seed=0, warmup_steps=2, max_steps=plan["steps"])
            if case == "freezing":
                cbs.append(LayerFreezing(schedule={plan["event"]: 6}))  # embedding + 5 of 8 blocks
            cbs.append(ProfileAt(([plan["event"]] if case in ("lopsided", "calibration") else []) + list(plan["profiles"])))
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
                err = f"{type(e).__name__}: {e}"[:500]
            trace = []
            path = os.path.join(root, "cost_trace.jsonl")
            if os.path.exists(path):
                trace = [json.loads(line) for line in open(path)]
            out.append(dict(case=case, variant=variant, round=rnd, error=err, start=rec.start, wall=rec.wall,
                            profiled=rec.profiled, partition=rec.partition, load=rec.load, trace=trace))
    if int(os.environ.get("RANK", "0")) == 0:
        with open(args.out, "w") as fh:
            json.dump(out, fh)


# ------------------------------------------------------------------------------ launcher side
def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _torchrun(extra: list[str], out: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           os.path.abspath(__file__), "--out", out, *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True)
    if proc.returncode != 0 or not os.path.exists(out):
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        print(json.dumps({"benchmark": "simulator_validation", "error": f"torchrun exit {proc.returncode}"}))
        sys.exit(1)


def fit_link(pingpong: dict) -> tuple[float, float]:
    """Least-squares ``t = latency + bytes / bandwidth`` over the ping-pong sizes."""
    xs = [float(k) for k in pingpong]
    ys = [float(v) for v in pingpong.values()]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    slope = max(slope, 1e-15)
    return max(0.0, my - slope * mx), 1.0 / slope


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


def _costs(row: dict, run: dict, steps: list[int]):
    """The row's per-layer costs scaled by the layers' load counters to the measured steps'
    (c_i = r_i t_i, as the strategy does), and the per-chunk overhead the row shows (busy time
    the layer hooks do not see)."""
    import statistics as st

    from lightning_dynmo.plan.cost_model import LayerCosts
    from lightning_dynmo.plan.measurements import scale_by_load

    costs = LayerCosts(row["forward"], row["backward"], row["params"], row["memory"], row["activation"])
    loads = [run["load"][k] for k in steps if run["load"][k]]
    if loads and row.get("layer_load"):
        now = [None if any(x[i] is None for x in loads) else st.median(x[i] for x in loads)
               for i in range(costs.num_layers)]
        costs = scale_by_load(costs, now, row["layer_load"])
    b, m = row["partition"], row["microbatches"]
    layer_sum = sum(m * (sum(row["forward"][b[s]:b[s + 1]]) + sum(row["backward"][b[s]:b[s + 1]]))
                    for s in range(len(b) - 1))
    alpha = max(0.0, (sum(row["rank_busy"]) - layer_sum) / (2 * m * (len(b) - 1)))
    return costs, alpha


def _most_common(items: list) -> list:
    """The most frequent item; ties go to the earliest."""
    keys = [json.dumps(x) for x in items]
    return json.loads(max(dict.fromkeys(keys), key=keys.count))


def analyse(runs: list[dict], link: tuple[float, float], opt_per_param: float) -> dict:
    from lightning_dynmo.plan.partition import Partition
    from lightning_dynmo.sim import Link, simulate

    latency, bandwidth = link
    bad = [f"{r['case']}/{r['variant']}/{r['round']}: {r['error'] or 'no cost trace'}" for r in runs
           if r["error"] or not r["trace"]]
    if bad:
        raise RuntimeError("runs failed: " + "; ".join(bad))

    def measured(steps, run):
        step = [run["start"][k + 1] - run["start"][k] for k in steps]
        return statistics.median(step), statistics.median(run["wall"][k] for k in steps)

    def rank_params(row, part):
        b = part.boundaries
        return max(sum(row["params"][b[s]:b[s + 1]]) for s in range(part.num_stages))

    # calibration run(s): the fixed per-step overhead outside the schedule
    betas = []
    for run in (r for r in runs if r["case"] == "calibration"):
        for row, steps in _segments(run):
            step, sched = measured(steps, run)
            betas.append(step - sched - opt_per_param * rank_params(row, Partition(tuple(run["partition"][steps[0]]))))
    beta = statistics.median(betas)

    details = []
    for run in (r for r in runs if r["case"] != "calibration"):
        segs = []
        for row, steps in _segments(run):
            step, sched = measured(steps, run)
            costs, alpha = _costs(row, run, steps)
            part = Partition(tuple(run["partition"][steps[0]]))
            sim = simulate(costs, part, row["schedule"], row["microbatches"], link=Link(latency, bandwidth),
                           action_overhead=alpha)
            segs.append(dict(part=str(part), steps=len(steps), alpha=alpha, step=step, sched=sched, sim=sim.step_time,
                             pred=sim.step_time + beta + opt_per_param * rank_params(row, part),
                             bubble=sim.bubble_fraction))
        if not segs:
            raise RuntimeError(f"{run['case']}/{run['variant']}/r{run['round']}: no steady-state profile to replay")
        last = segs[-1]["part"]  # the partition the run settled on
        segs = [g for g in segs if g["part"] == last]
        med = lambda k: statistics.median(g[k] for g in segs)  # noqa: E731
        step, sched, pred_step, pred_sched = med("step"), med("sched"), med("pred"), med("sim")
        details.append(dict(
            case=run["case"], variant=run["variant"], round=run["round"], partition=last,
            profiles_used=len(segs), measured_steps=sum(g["steps"] for g in segs), chunk_overhead_ms=1e3 * med("alpha"),
            measured_step_ms=1e3 * step, predicted_step_ms=1e3 * pred_step,
            measured_schedule_ms=1e3 * sched, predicted_schedule_ms=1e3 * pred_sched,
            step_error=abs(pred_step - step) / step, schedule_error=abs(pred_sched - sched) / sched,
            predicted_bubble=med("bubble"),
        ))
    # one configuration = (case, variant); its rounds interleave with the others' on a shared
    # machine, so each is summarised by the median over rounds (per-round errors are kept too)
    configs = []
    for case in CASES:
        for v in ("static", "dynamic"):
            ds = [d for d in details if d["case"] == case and d["variant"] == v]
            med = {k: statistics.median(d[k] for d in ds) for k in
                   ("measured_step_ms", "predicted_step_ms", "measured_schedule_ms", "predicted_schedule_ms")}
            spread = (max(d["measured_step_ms"] for d in ds) - min(d["measured_step_ms"] for d in ds)) / med["measured_step_ms"]
            configs.append(dict(case=case, variant=v, partitions=sorted({d["partition"] for d in ds}), **med,
                                step_error=abs(med["predicted_step_ms"] - med["measured_step_ms"]) / med["measured_step_ms"],
                                schedule_error=abs(med["predicted_schedule_ms"] - med["measured_schedule_ms"])
                                / med["measured_schedule_ms"], measured_round_spread=spread))
    # ranking: the measured speedup (medians over interleaved rounds) against the simulator's
    # what-if speedup: the static partition and each dynamic run's final partition simulated
    # on the same profiles (every steady-state profile of the case's runs), as a balancer
    # compares partitions, median over the dynamic runs; the speedup of the per-run
    # predictions above is reported beside it
    ranking = {}
    for case in CASES:
        med = {c["variant"]: c for c in configs if c["case"] == case}
        static = Partition(tuple(_most_common([r["partition"][-1] for r in runs
                                               if r["case"] == case and r["variant"] == "static"])))
        dyn_runs = [Partition(tuple(r["partition"][-1])) for r in runs if r["case"] == case and r["variant"] == "dynamic"]
        profiles = [(row, run, steps) for run in runs if run["case"] == case for row, steps in _segments(run)]
        per_partition = {}
        for part in dict.fromkeys(dyn_runs):  # each final partition a dynamic run settled on
            ratios = []
            for row, run, steps in profiles:
                costs, alpha = _costs(row, run, steps)
                t = [simulate(costs, q, row["schedule"], row["microbatches"], link=Link(latency, bandwidth),
                              action_overhead=alpha).step_time + beta + opt_per_param * rank_params(row, q)
                     for q in (static, part)]
                ratios.append(t[0] / t[1])
            per_partition[part] = statistics.median(ratios)
        meas = med["static"]["measured_step_ms"] / med["dynamic"]["measured_step_ms"]
        pred = statistics.median(per_partition[q] for q in dyn_runs)
        runs_pred = med["static"]["predicted_step_ms"] / med["dynamic"]["predicted_step_ms"]
        same = all(q == static for q in dyn_runs)
        ranking[case] = dict(static=str(static), dynamic=[str(q) for q in dyn_runs],
                             measured_speedup=round(meas, 4), predicted_speedup=round(pred, 4),
                             predicted_speedup_from_run_predictions=round(runs_pred, 4),
                             # every dynamic run kept the static partition: no order to predict
                             matches=None if same else (meas > 1) == (pred > 1))
    rnd = lambda d: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items()}  # noqa: E731
    return dict(
        max_step_time_error=round(max(c["step_error"] for c in configs), 4),
        mean_step_time_error=round(statistics.mean(c["step_error"] for c in configs), 4),
        max_schedule_time_error=round(max(c["schedule_error"] for c in configs), 4),
        max_step_time_error_single_round=round(max(d["step_error"] for d in details), 4),
        max_measured_round_spread=round(max(c["measured_round_spread"] for c in configs), 4),
        ranking_matches=all(r["matches"] for r in ranking.values() if r["matches"] is not None),
        ranking_cases_compared=sum(r["matches"] is not None for r in ranking.values()),
        ranking_matches_run_predictions=all((r["measured_speedup"] > 1) == (r["predicted_speedup_from_run_predictions"] > 1)
                                            for r in ranking.values() if r["matches"] is not None),
        speedup_static_to_dynamic=ranking,
        calibration=dict(link_latency_us=round(latency * 1e6, 1), link_bandwidth_mb_s=round(bandwidth / 1e6, 1),
                         optimizer_ns_per_param=round(opt_per_param * 1e9, 3), step_overhead_ms=round(beta * 1e3, 3),
                         chunk_overhead_ms={f"{d['case']}/{d['variant']}/r{d['round']}": round(d["chunk_overhead_ms"], 3)
                                            for d in details}),
        configs=[rnd(c) for c in configs],
        runs=[rnd(d) for d in details],
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="25 steps, one round of each configuration (a smoke run: no median over rounds)")
    ap.add_argument("--replay", default=None, help="analyse a saved runs.json instead of running (with --link)")
    ap.add_argument("--save", default=None, help="keep the raw runs (JSON) here")
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--pingpong", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if "LOCAL_RANK" in os.environ:
        if args.pingpong:
            _pingpong(args.out, args.quick)
        else:
            _worker(args)
        return
    t0 = time.perf_counter()
    if args.replay:
        saved = json.load(open(args.replay))
        pp, runs, opt = saved["pingpong"], saved["runs"], saved["optimizer_seconds_per_param"]
    else:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "pingpong.json")
            _torchrun(["--pingpong"] + (["--quick"] if args.quick else []), out)
            pp = json.load(open(out))
            opt = optimizer_seconds_per_param(args.quick)
            out = os.path.join(tmp, "runs.json")
            _torchrun(["--quick"] if args.quick else [], out)
            runs = json.load(open(out))
        if args.save:
            with open(args.save, "w") as fh:
                json.dump({"pingpong": pp, "runs": runs, "optimizer_seconds_per_param": opt}, fh)
    link = fit_link(pp)
    res = analyse(runs, link, opt)
    for d in res["configs"]:
        print(f"{d['case']:11s} {d['variant']:7s} {','.join(d['partitions']):20s} median step {d['measured_step_ms']:7.1f} ms "
              f"pred {d['predicted_step_ms']:7.1f} ({d['step_error']:.1%}); schedule {d['measured_schedule_ms']:7.1f} "
              f"pred {d['predicted_schedule_ms']:7.1f} ({d['schedule_error']:.1%}); rounds spread {d['measured_round_spread']:.0%}")
    for d in res["runs"]:
        print(f"{d['case']:11s} {d['variant']:7s} r{d['round']} {d['partition']:10s} step {d['measured_step_ms']:7.1f} ms "
              f"pred {d['predicted_step_ms']:7.1f} ({d['step_error']:.1%})  schedule {d['measured_schedule_ms']:7.1f} "
              f"pred {d['predicted_schedule_ms']:7.1f} ({d['schedule_error']:.1%})")
    summary = {"benchmark": "simulator_validation", "quick": args.quick, "stages": 2, "schedule": "1f1b",
               "threads_per_rank": 1, "target_max_step_time_error": 0.10, **res,
               "pingpong_one_way_us": {k: round(v * 1e6, 1) for k, v in pp.items()},
               "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
