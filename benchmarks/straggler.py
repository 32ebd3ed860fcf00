"""A pipeline that outruns its stragglers: a real co-tenant slows one rank for the middle of the run.

    python benchmarks/straggler.py [--quick] [--heavy] [--rounds R] [--cores 0,1]
    python benchmarks/straggler.py --smoke     # seconds: a tiny model, one round (its figures mean nothing)

Launches itself with torchrun on 2 ranks (gloo, 1 thread each); each rank pins itself to its own
core (``--cores``, default the first two this process may run on). For steps ``start <= step <
stop`` rank 1 starts a co-tenant, a busy Python loop pinned to its core (``--heavy``: two of them),
and stops it after; nothing is slept or emulated, the rank genuinely gets a share of its core. Every
round trains the same GPT, data and schedule four times in one job:

* ``param``    static: equal parameter counts (DeepSpeed), ``rebalance="never"``;
* ``dynmo``    ``rebalance="auto"`` with its defaults, ``balancer="partition_time"``, ``rank_speeds=True``;
* ``oracle``   static on the split a speed-aware ``partition_time`` (:mod:`lightning_dynmo.plan`)
  computes for the co-tenant phase from *measured* speeds: the per-layer work dynmo profiled before
  the co-tenant came, at each rank's speed in the first round's ``param`` run (its median busy
  seconds before the co-tenant over those while it ran: the same layers, so the ratio is the speed);
* ``control``  ``param`` again: two identical runs of one round, whose paired ratio is the noise floor.

Round 1 runs them in that order (the oracle needs the first two); later rounds rotate the order,
with round 1's oracle split. Figures are paired: the median over rounds of a ratio of two runs of
one round. Windows (steps): ``pre`` = [start / 2, start), ``slow`` = [start + settle, stop) and
``post`` = [stop + settle, steps), ``settle`` = min(20, (stop - start) / 2) steps to react.

* ``speedup_under_straggler``: ``param``'s step time over dynmo's in ``slow``;
* ``fraction_of_oracle``: the oracle's step time over dynmo's in ``slow`` (1.0: as good as the oracle);
* ``oracle_speedup``: the oracle over ``param`` (what a perfect reaction could gain: the yardstick);
* ``steps_to_react``: the first step after ``start`` where dynmo's partition changed (worst round);
* ``speed_after_recovery``: dynmo's step time in ``pre`` over its own in ``post`` (1.0: fully back);
* ``migrations_per_episode``: dynmo's applied moves from ``start`` to the end (worst round);
* ``noise_floor``: |1 - control / param| in ``slow``, with ``noise_floor_ci95`` (bootstrap over rounds);
* ``sim_oracle_speedup``: the same ratio as ``oracle_speedup`` from the simulator
  (:func:`lightning_dynmo.sim.simulate.simulate`, 1F1B, free links, no per-chunk overhead: nothing
  calibrated) on the data the oracle came from: dynmo's profiled work, the ``param`` and oracle
  splits, each rank's compute slowed by its measured busy ratio (during over before); ``sim_error``
  is its relative difference to the measured one, ``sim_step_ms`` the simulated step times beside
  the measured ones (their gap is what profiling per layer does not see: the schedule loop, sends
  and receives, the loss).

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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from _harness import bootstrap_ratio, paired_ratio, resolution, rotated  # noqa: E402

#: keys the last JSON line always has (tests/unit/test_benchmarks_smoke.py checks them on ``--smoke``)
RESULT_KEYS = ("benchmark", "heavy", "speedup_under_straggler", "fraction_of_oracle", "oracle_speedup",
               "steps_to_react", "speed_after_recovery", "migrations_per_episode", "noise_floor", "noise_floor_ci95",
               "measured_speeds", "oracle_partition", "step_ms", "targets", "errors", "sim_oracle_speedup", "sim_error",
               "sim_step_ms")

#: the issue's targets on 2 stages (reported beside the figures; judge them against ``noise_floor``)
TARGETS = {"fraction_of_oracle": 0.9, "steps_to_react": 20, "speed_after_recovery": 0.97, "migrations_per_episode": 3}
SLOW_RANK = 1
CONFIGS = ("param", "dynmo", "oracle", "control")
MODEL = dict(vocab_size=256, block_size=128, n_layer=12, n_head=6, n_embd=192, dropout=0.0)  # small-cpu, 12 blocks
PLANS = {  # steps, co-tenant [start, stop), rounds, batch, micro-batches, model
    "full": dict(steps=150, start=30, stop=100, rounds=3, batch=16, microbatches=8, model=MODEL),
    "quick": dict(steps=72, start=16, stop=44, rounds=2, batch=16, microbatches=8,
                  model=dict(MODEL, block_size=64, n_head=4, n_embd=128)),
    "smoke": dict(steps=12, start=4, stop=8, rounds=1, batch=4, microbatches=2,
                  model=dict(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32, dropout=0.0)),
}


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smaller model, fewer steps, 2 rounds")
    ap.add_argument("--smoke", action="store_true", help="seconds: checks that the script runs (figures mean nothing)")
    ap.add_argument("--heavy", action="store_true", help="two busy processes on the slow rank's core, not one")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default: the plan's)")
    ap.add_argument("--cores", default=None, metavar="A,B",
                    help="the cores of rank 0 and rank 1 (default: the first two this process may run on)")
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def plan_of(args) -> dict:
    plan = dict(PLANS["smoke" if args.smoke else "quick" if args.quick else "full"])
    if args.rounds:
        plan["rounds"] = args.rounds
    settle = min(20, (plan["stop"] - plan["start"]) // 2)
    plan["windows"] = {"pre": (plan["start"] // 2, plan["start"]), "slow": (plan["start"] + settle, plan["stop"]),
                       "post": (plan["stop"] + settle, plan["steps"])}
    return plan


def default_cores() -> list[int]:
    mine = sorted(os.sched_getaffinity(0))
    return (mine * 2)[:2]  # (one core only: both ranks share it, and the figures say nothing)


# ------------------------------------------------------------------------------ worker side
def co_tenant(core: int) -> subprocess.Popen:
    """A busy loop pinned to ``core`` that ends by itself when its parent goes (a crashed job
    leaves nothing spinning)."""
    code = ("import os\nos.sched_setaffinity(0, {%d})\nparent = os.getppid()\n"
            "while os.getppid() == parent:\n    for _ in range(200000):\n        pass\n") % core
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL)


def _worker(args) -> None:
    rank = int(os.environ["RANK"])
    cores = [int(c) for c in args.cores.split(",")]
    os.sched_setaffinity(0, {cores[rank]})
    import torch

    torch.set_num_threads(1)
    import lightning as L
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_dynmo import DynMoStrategy
    from lightning_dynmo.models import GPT, GPTConfig

    plan = plan_of(args)
    cfg = GPTConfig(**plan["model"])
    data = torch.randint(0, cfg.vocab_size, (plan["batch"] * plan["steps"], cfg.block_size + 1),
                         generator=torch.Generator().manual_seed(0))
    ds = TensorDataset(data[:, :-1].contiguous(), data[:, 1:].contiguous())
    procs = 2 if args.heavy else 1

    class Meter(L.Callback):
        """Per step: start time, partition, busy seconds; the co-tenant's start and stop; the work
        profiled last before the co-tenant (dynmo's: what the oracle balances)."""

        def __init__(self):
            self.t, self.partition, self.busy, self.tenants, self.work = [], [], [], [], None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            step = trainer.global_step
            if rank == SLOW_RANK and step == plan["start"]:
                self.tenants = [co_tenant(cores[SLOW_RANK]) for _ in range(procs)]
            if step == plan["stop"]:
                self.stop_tenants()
            self.t.append(time.perf_counter())
            self.partition.append(str(trainer.strategy.pipeline.partition))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.busy.append(list(trainer.strategy.pipeline.rank_busy_seconds))
            costs = trainer.strategy.pipeline.rebalancer.profiled_costs
            if trainer.global_step <= plan["start"] and costs is not None:
                self.work = costs

        def on_train_end(self, trainer, pl_module):
            self.t.append(time.perf_counter())  # (the last step's end)
            self.stop_tenants()

        def on_exception(self, trainer, pl_module, exception):
            self.stop_tenants()

        def stop_tenants(self):
            for p in self.tenants:
                p.kill()
                p.wait()
            self.tenants = []

    def window_ms(meter, name):
        a, b = plan["windows"][name]
        steps = [meter.t[i + 1] - meter.t[i] for i in range(a, min(b, len(meter.t) - 1))]
        return 1e3 * statistics.median(steps) if steps else None

    def run(name: str, options: dict) -> tuple[dict, Meter]:
        torch.manual_seed(0)
        model = GPT(cfg, seed=0, warmup_steps=2, max_steps=plan["steps"])
        meter = Meter()
        logs = tempfile.TemporaryDirectory(prefix="dynmo_bench_")  # cost_trace / rebalance_history: not the cwd
        strategy = DynMoStrategy(pipeline_parallel=2, microbatches=plan["microbatches"], plot=False, timeout=300,
                                 **options)
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=plan["steps"], logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            limit_val_batches=0, callbacks=[meter], default_root_dir=logs.name)
        rec = {"error": None}
        try:
            trainer.fit(model, DataLoader(ds, batch_size=plan["batch"], shuffle=False, drop_last=True))
        except Exception as e:  # a failing configuration is a result too
            from lightning_dynmo import RankFailedError

            if isinstance(e, RankFailedError):  # the job lost a rank: nothing later can run
                raise
            rec["error"] = f"{type(e).__name__}: {e}"[:500]
        finally:
            meter.stop_tenants()
            logs.cleanup()
        if rec["error"] is None:
            rec.update({f"{w}_ms": window_ms(meter, w) for w in plan["windows"]})
            rec["partition"] = [meter.partition[0], meter.partition[-1]]
            if name == "dynmo":
                rec.update(_reaction(meter.partition, strategy.pipeline.rebalance_history, plan))
        return rec, meter

    out: dict[str, list] = {name: [] for name in CONFIGS}
    # (meters: round 1's, what the oracle is computed from)
    oracle, speeds, no_oracle, sim, meters = None, None, None, None, {}
    for r in range(plan["rounds"]):
        order = list(CONFIGS) if r == 0 else rotated(list(CONFIGS), r)
        for name in order:
            if name == "oracle" and oracle is None:
                oracle, speeds, no_oracle, sim = _agreed_oracle(out, meters, plan, dist)
            options = {"param": dict(balancer="param", rebalance="never"),
                       "control": dict(balancer="param", rebalance="never"),
                       "dynmo": dict(balancer="partition_time", rebalance="auto", rank_speeds=True)}.get(name)
            if name == "oracle":
                if oracle is None:
                    out[name].append({"error": f"no oracle: {no_oracle}"})
                    continue
                options = dict(balancer="uniform", rebalance="never", partition=tuple(oracle))
            rec, meter = run(name, options)
            if r == 0:
                meters[name] = meter
            out[name].append(rec)
    out["oracle_partition"], out["measured_speeds"] = oracle, speeds
    out["sim"] = sim
    if rank == 0:
        with open(args.out, "w") as fh:
            json.dump(out, fh, default=str)


def _reaction(partitions: list[str], history: list[dict], plan: dict) -> dict:
    """dynmo's reaction to the co-tenant: the steps until its partition first changed after the
    co-tenant came, its applied moves from then on, and the slow rank its decisions named."""
    start = plan["start"]
    react = next((i - start for i in range(start + 1, len(partitions)) if partitions[i] != partitions[start]), None)
    moves = [h for h in history if h.get("kind") == "rebalance" and h.get("applied")]
    return {"steps_to_react": react if react is None or react + start < plan["stop"] else None,
            "migrations_before": sum(1 for h in moves if h["step"] < start),
            "migrations_episode": sum(1 for h in moves if h["step"] >= start),
            "stragglers": [f"{h['step']}: {h['straggler']}" for h in history if h.get("straggler")],
            "moves": [f"{h['step']}: {h['before']}->{h['after']}" for h in moves]}


def _agreed_oracle(out: dict, meters: dict, plan: dict,
                   dist) -> tuple[list[int] | None, list[float] | None, str | None, dict | None]:
    """The oracle split (rank 0 computes it, every rank gets it): speed-aware ``partition_time``
    on dynmo's work profiled before the co-tenant, at the speeds the ``param`` run's busy times
    show while the co-tenant ran (its median busy seconds per rank before, over those during);
    and, when there is none, why; and the simulated step times of both splits (:func:`_simulated`)."""
    why = next((f"the {n} run of round 1 failed" for n in ("param", "dynmo") if out[n][0]["error"]), None) or (
        None if meters["dynmo"].work is not None else
        f"the dynmo run profiled no layer work before the co-tenant came (step {plan['start']})")
    choice: list = [None, None, why, None]
    if int(os.environ["RANK"]) == 0 and why is None:
        from lightning_dynmo.plan.balancers import BalanceProblem, get_balancer
        from lightning_dynmo.plan.cost_model import CostModel
        from lightning_dynmo.plan.speed import normalise_speeds

        busy = meters["param"].busy
        (a, b), (c, d) = plan["windows"]["pre"], plan["windows"]["slow"]
        before = [statistics.median([s[k] for s in busy[a:b] if len(s) == 2]) for k in range(2)]
        during = [statistics.median([s[k] for s in busy[c:d] if len(s) == 2]) for k in range(2)]
        speeds = normalise_speeds([x / y for x, y in zip(before, during)])
        problem = BalanceProblem(meters["dynmo"].work, 2, CostModel(microbatches=plan["microbatches"], speed=speeds))
        split = get_balancer("partition_time")(problem).partition
        param = meters["param"].partition[plan["start"]]
        choice = [list(split.boundaries), [round(v, 4) for v in speeds], None,
                  _simulated(meters["dynmo"].work, param, split, [y / x for x, y in zip(before, during)], plan)]
    dist.broadcast_object_list(choice, src=0)
    return choice[0], choice[1], choice[2], choice[3]


def _simulated(work, param: str, oracle, slowdown: list[float], plan: dict) -> dict:
    """Simulated step milliseconds of the ``param`` split (``"0-5|6-15"``, as measured before and
    while the co-tenant ran) and of the oracle split (while it ran), at each rank's measured
    slowdown; the raw simulator, nothing calibrated."""
    from lightning_dynmo.plan.partition import Partition
    from lightning_dynmo.sim.simulate import simulate

    part = Partition.from_sizes([int(r.split("-")[1]) - int(r.split("-")[0]) + 1 for r in param.split("|")])

    def ms(p, slow=None):
        return round(1e3 * simulate(work, p, "1f1b", plan["microbatches"], rank_slowdown=slow).step_time, 2)

    return {"param_pre": ms(part), "param_slow": ms(part, slowdown), "oracle_slow": ms(oracle, slowdown),
            "slowdown": [round(v, 4) for v in slowdown]}


# ------------------------------------------------------------------------------ launcher side
def _per_round(runs: dict, name: str, key: str) -> list[float | None]:
    return [r.get(key) for r in runs.get(name, [])]


def _ratio(runs: dict, num: str, den: str, key: str) -> float | None:
    """Median over rounds of ``num``'s ``key`` over ``den``'s (step times: > 1, ``den`` is faster)."""
    r = paired_ratio(_per_round(runs, num, key), _per_round(runs, den, key))
    return None if r is None else round(r, 4)


def _median(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 2) if known else None


def _worst(values: list, higher_is_worse: bool = True):
    """The worst round's figure (None, e.g. no reaction, is the worst)."""
    if not values or any(v is None for v in values):
        return None
    return max(values) if higher_is_worse else min(values)


def summarise(runs: dict, plan: dict, heavy: bool) -> dict:
    dyn = [r for r in runs["dynmo"] if not r.get("error")]
    speed_after = [round(r["pre_ms"] / r["post_ms"], 4) for r in dyn if r.get("pre_ms") and r.get("post_ms")]
    noise = resolution(_per_round(runs, "control", "slow_ms"), _per_round(runs, "param", "slow_ms"))
    ci = bootstrap_ratio(_per_round(runs, "control", "slow_ms"), [_per_round(runs, "param", "slow_ms")])
    sim = runs.get("sim")
    oracle_speedup = _ratio(runs, "param", "oracle", "slow_ms")
    sim_speedup = None if not sim else round(sim["param_slow"] / sim["oracle_slow"], 4)
    measured = {"param_pre": _median(_per_round(runs, "param", "pre_ms")),
                "param_slow": _median(_per_round(runs, "param", "slow_ms")),
                "oracle_slow": _median(_per_round(runs, "oracle", "slow_ms"))}
    res = {
        "benchmark": "straggler",
        "heavy": heavy,
        "rounds": plan["rounds"],
        "plan": {k: plan[k] for k in ("steps", "start", "stop", "windows", "batch", "microbatches", "model")},
        "speedup_under_straggler": _ratio(runs, "param", "dynmo", "slow_ms"),
        "fraction_of_oracle": _ratio(runs, "oracle", "dynmo", "slow_ms"),
        "oracle_speedup": oracle_speedup,
        "sim_oracle_speedup": sim_speedup,
        "sim_error": None if sim_speedup is None or not oracle_speedup else round(sim_speedup / oracle_speedup - 1, 4),
        "sim_step_ms": None if not sim else {k: {"sim": sim[k], "measured": measured[k]} for k in measured},
        "sim_slowdown": None if not sim else sim["slowdown"],
        "steps_to_react": _worst([r.get("steps_to_react") for r in dyn]) if dyn else None,
        "speed_after_recovery": statistics.median(speed_after) if speed_after else None,
        "migrations_per_episode": _worst([r.get("migrations_episode") for r in dyn]) if dyn else None,
        "noise_floor": None if noise is None else round(noise, 4),
        "noise_floor_ci95": ci,
        "measured_speeds": runs.get("measured_speeds"),
        "oracle_partition": runs.get("oracle_partition"),
        "step_ms": {name: {w: [None if r.get(f"{w}_ms") is None else round(r[f"{w}_ms"], 1) for r in runs[name]]
                           for w in plan["windows"]} for name in CONFIGS},
        "dynmo_rounds": [{k: r.get(k) for k in ("steps_to_react", "migrations_before", "migrations_episode", "moves",
                                                "stragglers")} for r in dyn],
        "targets": TARGETS,
        "errors": {name: [r["error"] for r in runs[name] if r.get("error")] for name in CONFIGS
                   if any(r.get("error") for r in runs[name])},
    }
    return res


def main(argv=None) -> None:
    args = _args(argv)
    if "LOCAL_RANK" in os.environ:
        _worker(args)
        return
    if args.rounds is not None and args.rounds < 1:
        sys.exit(f"--rounds {args.rounds}: must be >= 1")
    cores = default_cores() if args.cores is None else [c.strip() for c in args.cores.split(",")]
    if len(cores) != 2 or not all(str(c).isdigit() for c in cores):
        sys.exit(f"--cores {args.cores}: give two core numbers, e.g. --cores 0,1")
    cores = [int(c) for c in cores]
    if not set(cores) <= os.sched_getaffinity(0):
        sys.exit(f"--cores {args.cores}: this process may run on cores {sorted(os.sched_getaffinity(0))} only")
    plan = plan_of(args)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "runs.json")
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
               os.path.abspath(__file__), "--out", out, "--cores", ",".join(map(str, cores))]
        cmd += [flag for flag, on in (("--quick", args.quick), ("--smoke", args.smoke), ("--heavy", args.heavy)) if on]
        if args.rounds:
            cmd += ["--rounds", str(args.rounds)]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(out):
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
            print(json.dumps({"benchmark": "straggler", "error": f"torchrun exit {proc.returncode}"}))
            sys.exit(1)
        runs = json.load(open(out))
    for name in CONFIGS:
        for r in runs[name]:
            print(f"{name:8s} " + (f"ERROR {r['error']}" if r.get("error") else
                                   "  ".join(f"{w} {r[f'{w}_ms']:7.1f} ms" if r.get(f"{w}_ms") else f"{w} -"
                                             for w in plan["windows"]) + f"  partition {r['partition']}"))
    summary = summarise(runs, plan, args.heavy)
    summary["smoke"] = args.smoke
    summary["cores"] = cores
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
