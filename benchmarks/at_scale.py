"""Real CPU compute at 8 pipeline stages: static vs dynmo vs the simulator, four dynamism cases.

    python benchmarks/at_scale.py --stages 8            # 8 stages x dp=2 = 16 ranks (a 16-core machine, ~6 min)
    python benchmarks/at_scale.py --stages 2 --quick    # the small form that keeps it working (4 ranks)
    python benchmarks/at_scale.py --smoke               # seconds: 2 stages x dp 1, early exit, 8 steps

One torchrun job (``--stages`` x ``--dp`` ranks, gloo, 1 torch thread each, so it needs that many
free cores; ``CUDA_VISIBLE_DEVICES=""`` is set for the workers, so a GPU machine runs it on its
CPUs) trains the cases of ``benchmarks/dynamism_cases`` -- ``freezing`` (Egeria-style
``LayerFreezing``), ``early_exit``, ``pruning`` (gradual global magnitude pruning from a trained
start point) and ``moe_dropless`` (experts split over the ``dp`` replicas: expert parallelism) --
each three times: ``uniform`` and ``param`` (static, ``rebalance="never"``) and ``dynmo`` (the
case's own dynamic options), with the case's model, data, callbacks and measurement window (see
``benchmarks/dynamism.py``, which runs one case at a time). A 1F1B pipeline needs at least as
many micro-batches as stages: a case's micro-batch count is raised to ``2 x stages`` where it is
lower, and its batch with it (same micro-batch size). Every configuration runs one round.

**Simulator.** The dynmo run's last per-layer profile (what its strategy measured, the same on
every rank) is simulated (``lightning_dynmo.sim.simulate``: 1F1B, its micro-batches, free links)
on each configuration's final partition: ``sim_speedup_vs_static`` is the better static's
simulated step over dynmo's, on the same costs (the state at the end of training, where the
measured window covers the whole dynamic phase), and ``sim_step_error_dynmo`` compares dynmo's
measured last steps with that prediction (free links: what the simulator leaves out is the
runtime's own overhead).

It imports no Hydra; the last line of output is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from _harness import launch
from dynamism_cases import load, smoke

CASES = ("freezing", "early_exit", "pruning", "moe_dropless")
#: keys the last JSON line always has (tests/unit/test_benchmarks_smoke.py checks them on ``--smoke``)
RESULT_KEYS = ("benchmark", "stages", "data_parallel", "ranks", "tokens_per_sec", "speedup_vs_static",
               "sim_speedup_vs_static", "sim_step_error_dynmo", "partition_final", "migrations", "errors")


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, default=None, help="pipeline stages (default 8; --smoke: 2)")
    ap.add_argument("--dp", type=int, default=None,
                    help="data-parallel replicas (MoE: expert-parallel ways), default 2 (--smoke: 1)")
    ap.add_argument("--quick", action="store_true", help="the cases' short plans")
    ap.add_argument("--smoke", action="store_true",
                    help="8 steps of early exit on 2 ranks: checks that the script runs (its figures mean nothing)")
    ap.add_argument("--cases", default=None, help=f"comma-separated, from {','.join(CASES)} (--smoke: early_exit)")
    ap.add_argument("--timeout", type=int, default=1500, help="seconds for the whole torchrun job")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for key, full, small in (("stages", 8, 2), ("dp", 2, 1), ("cases", ",".join(CASES), "early_exit")):
        if getattr(args, key) is None:
            setattr(args, key, small if args.smoke else full)
    return args


def case_plan(case, quick: bool, stages: int, smoke_run: bool = False) -> dict:
    """The case's plan, with at least ``2 x stages`` micro-batches of the case's micro-batch size."""
    plan = dict(smoke(case.plan(True)) if smoke_run else case.plan(quick), stages=stages, rounds=1)
    m = max(plan["microbatches"], 2 * stages)
    plan["batch"] = plan["batch"] // plan["microbatches"] * m
    plan["microbatches"] = m
    return plan


# ------------------------------------------------------------------------------ worker
def _worker(args) -> None:
    import torch

    torch.set_num_threads(1)
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from _harness import StepTimer, write_result
    from lightning_dynmo import DynMoStrategy
    from lightning_dynmo.models import GPTConfig

    out: dict = {}
    for name in args.cases.split(","):
        case = load(name)
        plan = case_plan(case, args.quick, args.stages, args.smoke)
        ep = args.dp if getattr(case, "EXPERT_PARALLEL", False) else 1
        cfg = GPTConfig(**plan["model"])
        n = plan["batch"] * plan["steps"] * args.dp
        g = torch.Generator().manual_seed(0)
        data = case.data(cfg, n) if hasattr(case, "data") else torch.randint(0, cfg.vocab_size, (n, cfg.block_size + 1),
                                                                             generator=g)
        ds = TensorDataset(data[:, :-1].contiguous(), data[:, 1:].contiguous())
        configs = [("uniform", dict(balancer="uniform", rebalance="never")),
                   ("param", dict(balancer="param", rebalance="never")),
                   ("dynmo", dict(dict(rebalance_cooldown=1), **case.dynmo_strategy(plan)))]
        for config, options in configs:
            torch.manual_seed(0)
            model, callbacks = case.build(cfg, plan)
            timer = StepTimer()
            strategy = DynMoStrategy(pipeline_parallel=args.stages, microbatches=plan["microbatches"], plot=False,
                                     timeout=300, expert_parallel=ep, **options)
            trainer = L.Trainer(accelerator="cpu", devices=args.stages * args.dp, strategy=strategy,
                                max_steps=plan["steps"], logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                                callbacks=[*callbacks, timer], default_root_dir=tempfile.mkdtemp())
            rec: dict = {"error": None}
            t0 = time.perf_counter()
            try:
                trainer.fit(model, DataLoader(ds, batch_size=plan["batch"], shuffle=False, drop_last=True))
            except Exception as e:  # a failing configuration is a result too: report it
                from lightning_dynmo import RankFailedError

                if isinstance(e, RankFailedError):  # the job lost a rank: no later configuration can run
                    raise
                rec["error"] = f"{type(e).__name__}: {e}"[:800]
            rec["wall_s"] = round(time.perf_counter() - t0, 1)
            a, b = plan["window"]
            if rec["error"] is None and len(timer.ends) >= b:
                secs = timer.ends[b - 1] - timer.ends[a - 1]
                tail = [y - x for x, y in zip(timer.ends[-4:], timer.ends[-3:])]
                costs = strategy.pipeline.rebalancer.profiled_costs
                rec.update(
                    tokens_per_sec=plan["batch"] * args.dp * cfg.block_size * (b - a) / secs,
                    step_ms=1e3 * secs / (b - a), last_steps_ms=1e3 * sorted(tail)[len(tail) // 2],
                    partition_final=list(strategy.pipeline.partition.boundaries),
                    microbatches=plan["microbatches"], batch=plan["batch"],
                    migrations=sum(1 for h in strategy.pipeline.rebalance_history if h["applied"]),
                    decisions=len(strategy.pipeline.rebalance_history),
                    profile=None if costs is None else dict(forward=list(costs.forward), backward=list(costs.backward),
                                                            params=list(costs.params)),
                )
            out[f"{name}/{config}"] = rec
    write_result(args.out, out)


# ------------------------------------------------------------------------------ launcher
def _sim_ms(profile: dict, boundaries: list[int], m: int) -> float:
    from lightning_dynmo.plan.cost_model import LayerCosts
    from lightning_dynmo.plan.partition import Partition
    from lightning_dynmo.sim import simulate

    n = len(profile["forward"])
    costs = LayerCosts(profile["forward"], profile["backward"], profile["params"], [0.0] * n, [0.0] * n)
    return 1e3 * simulate(costs, Partition(tuple(boundaries)), "1f1b", m).step_time


def summarise(runs: dict, args) -> dict:
    res: dict = {"benchmark": "at_scale", "stages": args.stages, "data_parallel": args.dp, "quick": args.quick,
                 "smoke": args.smoke,
                 "ranks": args.stages * args.dp, "threads_per_rank": 1, "cpu_count": os.cpu_count(),
                 "tokens_per_sec": {}, "speedup_vs_static": {}, "sim_speedup_vs_static": {},
                 "sim_step_error_dynmo": {}, "partition_final": {}, "migrations": {}, "errors": {}}
    for name in args.cases.split(","):
        recs = {c: runs.get(f"{name}/{c}", {}) for c in ("uniform", "param", "dynmo")}
        for c, r in recs.items():
            if r.get("error"):
                res["errors"][f"{name}/{c}"] = r["error"]
        ok = {c: r for c, r in recs.items() if r.get("tokens_per_sec")}
        res["tokens_per_sec"][name] = {c: round(r["tokens_per_sec"], 1) for c, r in ok.items()}
        res["partition_final"][name] = {c: str(tuple(r["partition_final"])) for c, r in ok.items()}
        static = [c for c in ("uniform", "param") if c in ok]
        dyn = ok.get("dynmo")
        if not (dyn and static):
            continue
        best = max(static, key=lambda c: ok[c]["tokens_per_sec"])
        res["speedup_vs_static"][name] = round(dyn["tokens_per_sec"] / ok[best]["tokens_per_sec"], 4)
        res["migrations"][name] = dyn["migrations"]
        prof = dyn.get("profile")
        if prof:
            m = dyn["microbatches"]
            sims = {c: _sim_ms(prof, ok[c]["partition_final"], m) for c in ok}
            res["sim_speedup_vs_static"][name] = round(min(sims[c] for c in static) / sims["dynmo"], 4)
            res["sim_step_error_dynmo"][name] = round(abs(dyn["last_steps_ms"] / sims["dynmo"] - 1), 4)
    return res


def main(argv=None) -> None:
    args = _args(argv)
    if args.worker:
        _worker(args)
        return
    bad = [c for c in args.cases.split(",") if c not in CASES]
    if bad or args.stages < 2 or args.dp < 1:
        sys.exit(f"--cases from {CASES}, --stages >= 2, --dp >= 1; got {args.cases!r}, {args.stages}, {args.dp}")
    for name in args.cases.split(","):
        layers = case_plan(load(name), args.quick, args.stages, args.smoke)["model"]["n_layer"] + 3
        if layers < args.stages:
            sys.exit(f"case {name} has {layers} pipeline layers: at most {layers} stages")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU and gloo, also on a GPU machine
    t0 = time.perf_counter()
    forwarded = ["--stages", str(args.stages), "--dp", str(args.dp), "--cases", args.cases]
    try:
        runs = launch(os.path.abspath(__file__), args.stages * args.dp,
                      forwarded + (["--quick"] if args.quick else []) + (["--smoke"] if args.smoke else []),
                      timeout=args.timeout)
    except Exception as e:  # noqa: BLE001 - the JSON line says what failed
        print(str(e)[:8000], file=sys.stderr)  # the report leads with the workers' first error lines
        cause = next((ln for ln in str(e).splitlines()[2:] if ln.strip()), "")
        print(json.dumps({"benchmark": "at_scale", "stages": args.stages,
                          "error": f"{type(e).__name__}: {cause}"[:400]}))
        sys.exit(1)
    for key, r in runs.items():
        if r.get("error"):
            print(f"{key:24s} ERROR {r['error']}")
        else:
            print(f"{key:24s} {r['tokens_per_sec']:9.1f} tok/s  step {r['step_ms']:7.1f} ms  "
                  f"final {tuple(r['partition_final'])}  ({r['wall_s']} s)")
    summary = summarise(runs, args)
    summary["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
