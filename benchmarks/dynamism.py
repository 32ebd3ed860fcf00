"""Static vs dynamic pipeline balancing for one dynamic-model case, side by side.

    python benchmarks/dynamism.py --case none|freezing|early_exit|pruning|mod|moe|sparse_attention [--quick]
    python benchmarks/dynamism.py --case moe --expert-parallel 2 [--quick]
    python benchmarks/dynamism.py --case pruning --data-parallel 2 --dp-sharding fsdp [--quick]
    python benchmarks/dynamism.py --case sparse_attention --sweep [--quick]
    python benchmarks/dynamism.py --smoke [--case C]    # seconds: 6 steps, 1 round (default case none)

Launches itself with torchrun (2 ranks = 2 pipeline stages by default, ``--stages S`` for more,
gloo, 1 thread each, so it needs S free cores; with
``--expert-parallel N``, S x N ranks: N data-parallel replicas of the pipeline whose stages split
their experts N ways, for cases whose module sets ``EXPERT_PARALLEL = True``; with
``--data-parallel D``, S x D ranks: D replicas, each stage sharded over them with
``--dp-sharding fsdp``, or replicated) and trains the
same model, data and dynamism callback three times in one job:

* ``uniform``  static: equal layer counts (Megatron), ``rebalance="never"``;
* ``param``    static: equal parameter counts (DeepSpeed), ``rebalance="never"``;
* ``dynmo``    the case's dynamic options (``benchmarks/dynamism_cases/<case>.py``), e.g.
  ``balancer="partition_time", rebalance="on_event"``: the callback's ``request_rebalance``
  makes the strategy profile the next step per layer and re-partition.

Every round also runs the better static configuration of the first round a second time
(``control``). Speedups are *paired*: the median over rounds of the ratio of two runs of the same
round (load on a shared host drifts between rounds, less within one), and each round runs the
configurations in a rotated order. ``resolution`` = |1 - control_a / control_b|, paired the same
way, is how far apart identical runs land on this machine, so a speedup within ``resolution`` of 1
is noise; ``resolution_ci95`` and ``speedup_vs_static_ci95`` are 95 % bootstrap intervals over
rounds (``speedup_vs_static_of_medians``: the older unpaired ratio of medians, for comparison).
Full runs without ``--rounds`` add rounds (``FULL_ROUNDS`` to ``MAX_ROUNDS``; quick runs up to
``QUICK_MAX_ROUNDS``) until ``resolution`` <= 0.02, and ``no_harm`` judges ``speedup_vs_static``
against 0.98 with that noise floor (``met``, ``missed`` beyond the noise, or ``unresolved``). ``--case none`` is a dense
GPT with no dynamism and DynMo's default options: what turning DynMo on costs a model it cannot help
(``dynmo_overhead_fraction`` is the strategy's own measurement of its overhead). Logs (``cost_trace.jsonl``,
``rebalance_history.jsonl``) go to a temporary directory per run, never the working directory.

The dynamism event happens early (freezing / threshold drop / pruning schedule); throughput
(tokens/s of all replicas from step wall-clock on rank 0) and the pipeline idle fraction (the strategy's
``pipeline/idle_fraction`` metric, read from ``trainer.callback_metrics`` every step, plus per-rank
``1 - busy/wall``) are averaged over a measurement window after the event and after the dynmo run
has rebalanced. ``speedup_vs_static`` = dynmo tokens/s over the better static baseline; a case's
variants (another model, e.g. dense attention) run in the same rounds and give ``speedup_vs_<name>``.
``--sweep`` adds one static run per stage boundary (``fixed_<k>``: stage 0 = layers ``0..k-1``,
``rebalance="never"``), so the summary can say what the best partition *chosen in hindsight*
would have given over the same window: ``ceiling_speedup_vs_static`` (best fixed over the better
static baseline). Where the per-layer load settles after the event, no balancer that moves whole
layers can beat that ceiling by more than the noise; it tells a missed target of the balancer
apart from one the scenario cannot reach on 2 stages.
The last line of output is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from statistics import median  # paired ratios: the true median (an even count averages the middle two)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from _harness import NO_HARM_TARGET, bootstrap_ratio, no_harm_verdict, resolution, rotated, speedup  # noqa: E402
from dynamism_cases import CASES, load, smoke  # noqa: E402

#: keys the last JSON line always has (tests/unit/test_benchmarks_smoke.py checks them on ``--smoke``)
RESULT_KEYS = ("benchmark", "case", "tokens_per_sec", "best_static", "speedup_vs_static", "resolution", "no_harm",
               "idle_fraction_static", "idle_fraction_dynmo", "dynmo_overhead_fraction", "errors")

#: A full (non-quick) run without ``--rounds`` runs at least ``FULL_ROUNDS`` rounds and adds rounds
#: (up to ``MAX_ROUNDS``; ``--quick``: from its plan's rounds up to ``QUICK_MAX_ROUNDS``) until two runs
#: of one static configuration (the control) land within ``TARGET_RESOLUTION`` of each other (paired:
#: the median over rounds of their ratio). ``no_harm`` then says whether the run shows DynMo keeping
#: ``NO_HARM_TARGET`` of the better static split: met, missed (beyond the noise) or unresolved.
FULL_ROUNDS = 5  # enough rounds for a bootstrap interval that means something
MAX_ROUNDS = 12
TARGET_RESOLUTION = 0.02  # = 1 - NO_HARM_TARGET: a run that resolves it can say whether DynMo does no harm
QUICK_MAX_ROUNDS = 4  # --quick adds rounds up to this many, towards the same resolution


def _args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", choices=CASES, default=None, help="required unless --smoke (then: none)")
    ap.add_argument("--quick", action="store_true", help="fewer steps")
    ap.add_argument("--smoke", action="store_true",
                    help="a few steps, one round: checks that the script runs (its figures mean nothing)")
    ap.add_argument("--expert-parallel", type=int, default=1, metavar="N",
                    help="N data-parallel replicas, each stage's experts split over them (MoE cases)")
    ap.add_argument("--data-parallel", type=int, default=None, metavar="D",
                    help="D data-parallel replicas of the pipeline (default: --expert-parallel's N)")
    ap.add_argument("--dp-sharding", choices=("replicate", "fsdp"), default="replicate",
                    help="how each stage is held over the replicas (DynMoStrategy's dp_sharding)")
    ap.add_argument("--sweep", nargs="?", const="all", default=None, metavar="K,K,...",
                    help="also run fixed 2-stage boundaries (all, or the listed first layers of stage 1; "
                         "rebalance never) and report the best one chosen in hindsight")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per configuration (default: the case's plan)")
    ap.add_argument("--plot", default=None, metavar="PNG",
                    help="with --sweep: draw tokens/s per fixed boundary against the static and dynmo runs")
    ap.add_argument("--stages", type=int, default=2,
                    help="pipeline stages (one process each, 1 thread; needs as many free cores as processes)")
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.case is None:
        if not args.smoke:
            ap.error("--case is required (unless --smoke)")
        args.case = "none"
    return args


# ------------------------------------------------------------------------------ worker side
def _decision_stats(history: list[dict], step_ms: float) -> dict:
    """Decisions taken, how many came from load counters (no profiling), triggers the overhead
    budget or the back-off skipped, and the overhead of a decision that moved nothing as a share
    of the step (the signal itself rides on the step's one all-reduce)."""
    skips = [h for h in history if h.get("kind") == "skip"]
    history = [h for h in history if h.get("kind") != "skip"]
    idle = [h["decision_ms"] for h in history if not h["applied"] and h.get("decision_ms") is not None]
    return {
        "decisions": len(history),
        "skip_records": len(skips),
        "decisions_from_counters": sum(1 for h in history if "(load counters)" in h.get("reason", "")),
        "migrations": sum(1 for h in history if h["applied"]),
        "rebalance_overhead": round(sum(idle) / len(idle) / step_ms, 5) if idle and step_ms else None,
    }


def _worker(args) -> None:
    import torch

    torch.set_num_threads(1)
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_dynmo import DynMoStrategy
    from lightning_dynmo.models import GPTConfig

    case = load(args.case)
    plan = case.plan(args.quick or args.smoke)
    target, max_rounds = None, None  # fixed rounds (smoke, or --rounds)
    if args.smoke:
        plan = smoke(plan)
    elif args.rounds:
        plan["rounds"] = args.rounds
    elif args.quick:  # a few more rounds where the first ones cannot resolve the do-no-harm gap
        plan["rounds"], target, max_rounds = max(plan["rounds"], 3), TARGET_RESOLUTION, QUICK_MAX_ROUNDS
    else:
        plan["rounds"], target, max_rounds = max(plan["rounds"], FULL_ROUNDS), TARGET_RESOLUTION, MAX_ROUNDS
    plan["stages"] = args.stages
    ep = args.expert_parallel
    dp = args.data_parallel or ep  # the data-parallel replicas
    cfg = GPTConfig(**plan["model"])
    g = torch.Generator().manual_seed(0)
    n = plan["batch"] * plan["steps"] * dp
    # a case may bring its own sequences (e.g. the text its warm-up phase trained on); else random tokens
    data = case.data(cfg, n) if hasattr(case, "data") else torch.randint(0, cfg.vocab_size, (n, cfg.block_size + 1),
                                                                         generator=g)
    ds = TensorDataset(data[:, :-1].contiguous(), data[:, 1:].contiguous())

    class Meter(L.Callback):
        def __init__(self):
            self.t, self.idle, self.rank_idle, self.partition = [], [], [], []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.t.append(time.perf_counter())
            m = trainer.callback_metrics.get("pipeline/idle_fraction")
            self.idle.append(float(m) if m is not None else float("nan"))
            s = trainer.strategy.pipeline
            busy, wall = getattr(s, "rank_busy_seconds", None), getattr(s, "rank_wall_seconds", None)
            w = max(wall) if wall else 0.0
            self.rank_idle.append([1.0 - b / w for b in busy] if w > 0 else [])
            self.partition.append(str(s.partition))

    configs = [("uniform", dict(balancer="uniform", rebalance="never")),
               ("param", dict(balancer="param", rebalance="never")),
               ("dynmo", case.dynmo_strategy(plan))]
    variants = case.variants(plan) if hasattr(case, "variants") else {}  # name -> (model overrides, options)
    configs += [(name, options) for name, (_, options) in variants.items()]
    if args.sweep:  # every 2-stage boundary, fixed: the best one chosen in hindsight bounds whole-layer balancing
        torch.manual_seed(0)
        num_layers = len(case.build(cfg, plan)[0].pipeline_layers())
        ks = range(1, num_layers) if args.sweep == "all" else [int(k) for k in args.sweep.split(",")]
        if any(not 0 < k < num_layers for k in ks):
            raise SystemExit(f"--sweep {args.sweep}: boundaries must lie in 1..{num_layers - 1}")
        configs += [(f"fixed_{k}", dict(balancer="uniform", rebalance="never", partition=(0, k, num_layers)))
                    for k in ks]
    out: dict[str, list] = {name: [] for name, _ in configs}
    out["control"] = []
    control = None  # the better static configuration of the first round, run a second time every round

    def runs():
        nonlocal control
        done = 0
        while done < plan["rounds"] or (target is not None and done < max_rounds
                                         and not _agreed_resolved(out, control, target)):
            if control is None:  # the first round picks the control from its static runs
                yield from configs
                control = _agreed_better_static(out)
                yield "control", dict(configs)[control]
            else:
                yield from rotated([*configs, ("control", dict(configs)[control])], done)
            done += 1

    # rounds interleave the configurations (u p d c, then p d c u, ...: each takes every place in
    # turn) so that load drift on a shared machine hits all of them alike; the summary compares
    # runs within a round and takes the median over rounds
    for name, options in runs():
        torch.manual_seed(0)
        model, callbacks = case.build(GPTConfig(**{**plan["model"], **variants[name][0]}) if name in variants else cfg,
                                      plan)
        meter = Meter()
        logs = tempfile.TemporaryDirectory(prefix="dynmo_bench_")  # cost_trace / rebalance_history: not the cwd
        options = dict(dict(rebalance_cooldown=1), **options)
        strategy = DynMoStrategy(pipeline_parallel=args.stages, microbatches=plan["microbatches"], plot=False,
                                 timeout=300, expert_parallel=ep, dp_sharding=args.dp_sharding, **options)
        trainer = L.Trainer(accelerator="cpu", devices=args.stages * dp, strategy=strategy, max_steps=plan["steps"],
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, limit_val_batches=0, callbacks=[*callbacks, meter],
                            default_root_dir=logs.name)
        err = None
        try:
            trainer.fit(model, DataLoader(ds, batch_size=plan["batch"], shuffle=False, drop_last=True))
        except Exception as e:  # report, do not hide: a failing configuration is a result too
            from lightning_dynmo import RankFailedError

            if isinstance(e, RankFailedError):  # the job lost a rank: no later configuration can run
                raise
            err = f"{type(e).__name__}: {e}"[:500]
        a, b = plan["window"]
        rec = {"balancer": options["balancer"], "rebalance": options["rebalance"], "error": err}
        if name == "control":
            rec["control_of"] = control
        if "partition" in options:
            rec["fixed_partition"] = list(options["partition"])
        if err is None and len(meter.t) >= b:
            secs = meter.t[b - 1] - meter.t[a - 1]
            tokens = plan["batch"] * dp * cfg.block_size * (b - a)
            idle = [x for x in meter.idle[a:b] if x == x]
            per_rank = [r for r in meter.rank_idle[a:b] if r]
            rec.update(
                tokens_per_sec=tokens / secs,
                step_ms=1e3 * secs / (b - a),
                idle_fraction=sum(idle) / len(idle) if idle else None,
                idle_fraction_per_rank=[sum(col) / len(col) for col in zip(*per_rank)] if per_rank else None,
                partition_initial=meter.partition[0],
                partition_final=meter.partition[-1],
                rebalances=[{k: h.get(k) for k in ("step", "kind", "reason", "before", "after", "applied", "why")}
                            for h in strategy.pipeline.rebalance_history],
                **_decision_stats(strategy.pipeline.rebalance_history, 1e3 * secs / (b - a)),
            )
            if hasattr(case, "extra"):
                rec["extra"] = case.extra(model, callbacks, strategy)  # rank 0's view
        out[name].append(rec)
        if hasattr(getattr(strategy, "pipeline", None), "dynmo_summary") and options["rebalance"] != "never":
            rec["dynmo_summary"] = strategy.pipeline.dynmo_summary
        logs.cleanup()
    if int(os.environ.get("RANK", "0")) == 0:
        with open(args.out, "w") as fh:
            json.dump(out, fh, default=str)


def _agreed_resolved(out: dict, control: str, target: float) -> bool:
    """Whether the control's two runs agree within ``target`` so far (rank 0's view, broadcast)."""
    import torch.distributed as dist

    res = resolution([r.get("tokens_per_sec") for r in out["control"]], [r.get("tokens_per_sec") for r in out[control]],
                     median)
    flag = [res is not None and res <= target]
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(flag, src=0)
    return flag[0]


def _agreed_better_static(out: dict) -> str:
    """The faster static configuration of the first round, as rank 0 measured it (every rank
    must run the same control)."""
    import torch.distributed as dist

    tps = {k: (out[k][0].get("tokens_per_sec") or 0.0) if out[k] else 0.0 for k in ("uniform", "param")}
    choice = [max(tps, key=tps.get)]
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(choice, src=0)
    return choice[0]


# ------------------------------------------------------------------------------ launcher side
def _median_round(recs: list[dict]) -> dict:
    good = sorted((r for r in recs if r.get("tokens_per_sec")), key=lambda r: r["tokens_per_sec"])
    if not good:
        return recs[0]
    med = dict(good[(len(good) - 1) // 2])
    med["tokens_per_sec_rounds"] = [round(r["tokens_per_sec"], 1) for r in recs if r.get("tokens_per_sec")]
    idle = [r["idle_fraction"] for r in good if r.get("idle_fraction") is not None]
    med["idle_fraction"] = sum(idle) / len(idle) if idle else None
    per = [r["idle_fraction_per_rank"] for r in good if r.get("idle_fraction_per_rank")]
    med["idle_fraction_per_rank"] = [sum(c) / len(c) for c in zip(*per)] if per else None
    return med


def _summarise(case: str, quick: bool, rounds: dict, expert_parallel: int = 1, stages: int = 2,
               data_parallel: int | None = None, dp_sharding: str = "replicate") -> dict:
    runs = {k: _median_round(v) for k, v in rounds.items() if v}
    ok = {k: v for k, v in runs.items() if v.get("tokens_per_sec")}
    control = ok.pop("control", None)
    static = [k for k in ("uniform", "param") if k in ok]
    best = max(static, key=lambda k: ok[k]["tokens_per_sec"]) if static else None
    dyn = ok.get("dynmo")
    res = {
        "benchmark": "dynamism",
        "case": case,
        "quick": quick,
        "stages": stages,
        "data_parallel": data_parallel or expert_parallel,
        "expert_parallel": expert_parallel,
        "dp_sharding": dp_sharding,
        "threads_per_rank": 1,
        "rounds": len(next(iter(rounds.values()))),
        "tokens_per_sec": {k: round(v["tokens_per_sec"], 1) for k, v in ok.items()},
        "tokens_per_sec_rounds": {k: v["tokens_per_sec_rounds"] for k, v in ok.items()},
        "best_static": best,
        # paired: the median over rounds of dynmo / the better static in the same round
        "speedup_vs_static": _paired_speedup(rounds, "dynmo", static) if dyn and best else None,
        "speedup_vs_static_of_medians": round(dyn["tokens_per_sec"] / ok[best]["tokens_per_sec"], 4)
        if dyn and best else None,
        "idle_fraction_static": round(ok[best]["idle_fraction"], 4)
        if best and ok[best]["idle_fraction"] is not None else None,
        "idle_fraction_dynmo": round(dyn["idle_fraction"], 4) if dyn and dyn["idle_fraction"] is not None else None,
        "idle_fraction_per_rank_static": [round(x, 4) for x in ok[best]["idle_fraction_per_rank"] or []]
        if best else None,
        "idle_fraction_per_rank_dynmo": [round(x, 4) for x in dyn["idle_fraction_per_rank"] or []] if dyn else None,
        "partition": {k: (v.get("partition_initial"), v.get("partition_final")) for k, v in ok.items()},
        "errors": {k: v["error"] for k, v in runs.items() if v.get("error")},
    }
    res.update(_noise_floor(rounds, control, ok))
    # do no harm, judged against this run's own noise floor (where DynMo cannot help: none, moe, mod)
    res["no_harm_target"] = NO_HARM_TARGET
    res["no_harm"] = no_harm_verdict(res["speedup_vs_static"], res["resolution"], resolution_ci=res["resolution_ci95"])
    # what the verdict cannot be noise about: dynmo ran a static split's own partition throughout
    # (no migration), so its gap to that split is its measured overhead alone
    res["dynmo_ran_partition_of"] = next(
        (k for k in static if dyn and ok[k].get("partition_initial") == dyn.get("partition_initial")
         and ok[k].get("partition_final") == dyn.get("partition_final") and not dyn.get("migrations")), None)
    fixed = {k: v for k, v in ok.items() if k.startswith("fixed_")}
    if dyn:
        for key in ("decisions", "decisions_from_counters", "migrations", "rebalance_overhead", "skip_records"):
            res[key] = dyn.get(key)
        summary = dyn.get("dynmo_summary") or {}
        res["dynmo_overhead_fraction"] = summary.get("overhead_fraction")  # measured by the strategy itself
        res["dynmo_overhead_s_by_source"] = summary.get("overhead_s_by_source")
        res["dynmo_applied_gains"] = [p.get("gain") for p in summary.get("applied_decisions", [])]
        res["dynmo_rebalances"] = [f"{h['step']}: {h['why'][:90]}" if h.get("kind") == "skip" else
                                   f"{h['step']}: {h['before']}->{h.get('after')} applied={h['applied']}"
                                   for h in dyn.get("rebalances", [])]
        # a case's variants (e.g. dense attention)
        for name in ok.keys() - {"uniform", "param", "dynmo"} - fixed.keys():
            res[f"speedup_vs_{name}"] = _paired_speedup(rounds, "dynmo", [name])
            res[f"speedup_vs_{name}_ci95"] = bootstrap_ratio(_per_round(rounds, "dynmo"), [_per_round(rounds, name)],
                                                             median=median)
    if fixed and best:
        top = max(fixed, key=lambda k: fixed[k]["tokens_per_sec"])
        res["best_fixed"] = top
        res["ceiling_speedup_vs_static"] = round(fixed[top]["tokens_per_sec"] / ok[best]["tokens_per_sec"], 4)
        res["dynmo_vs_best_fixed"] = round(dyn["tokens_per_sec"] / fixed[top]["tokens_per_sec"], 4) if dyn else None
        res["tokens_per_sec_fixed"] = {k: round(v["tokens_per_sec"], 1) for k, v in sorted(
            fixed.items(), key=lambda kv: int(kv[0].split("_")[1]))}
    for key, val in (dyn or {}).get("extra", {}).items():
        res[key] = [None if x is None or x != x else round(x, 3) for x in val] if isinstance(val, list) else val
    return res


def _per_round(rounds: dict, name: str) -> list[float | None]:
    return [r.get("tokens_per_sec") for r in rounds.get(name, [])]


def _paired_speedup(rounds: dict, name: str, baselines: list[str]) -> float | None:
    s = speedup(_per_round(rounds, name), [_per_round(rounds, k) for k in baselines], median)
    return None if s is None else round(s, 4)


def _noise_floor(rounds: dict, control: dict | None, ok: dict) -> dict:
    """The control (the better static configuration of the first round, run twice per round):
    ``resolution`` = |1 - control_a / control_b|, paired as the speedups are (the median over
    rounds of the two runs' ratio in each round), with ``resolution_ci95``, its 95 % bootstrap
    interval over rounds (how far from 1 two identical configurations can land in this run: the
    honest width of every speedup in the line); and a 95 % bootstrap interval over rounds of
    ``speedup_vs_static``."""
    of = (control or {}).get("control_of")
    res = None if of is None else resolution(_per_round(rounds, "control"), _per_round(rounds, of), median)
    out = {"control": of, "resolution": None if res is None else round(res, 4), "speedup_vs_static_ci95": None,
           "resolution_ci95": None if of is None else bootstrap_ratio(
               _per_round(rounds, "control"), [_per_round(rounds, of)], median=median)}
    if "dynmo" in ok:
        out["speedup_vs_static_ci95"] = bootstrap_ratio(
            _per_round(rounds, "dynmo"), [_per_round(rounds, k) for k in ("uniform", "param") if k in ok],
            median=median)
    return out


def plot_sweep(summary: dict, path: str) -> None:
    """Bars: tokens/s of each fixed boundary (the best one chosen in hindsight is the ceiling of
    whole-layer balancing); lines: the static baselines and dynmo, from the same rounds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fixed = summary.get("tokens_per_sec_fixed") or {}
    if not fixed:
        raise SystemExit("--plot needs --sweep (the fixed boundaries are what it draws)")
    ks = [int(k.split("_")[1]) for k in fixed]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.bar(ks, list(fixed.values()), color="0.75", label="fixed boundary (rebalance never)")
    styles = {"uniform": ("tab:blue", "--"), "param": ("tab:orange", "--"), "dynmo": ("tab:green", "-")}
    for name, (color, ls) in styles.items():
        if name in summary["tokens_per_sec"]:
            ax.axhline(summary["tokens_per_sec"][name], color=color, ls=ls, lw=2, label=name)
    ax.set_xlabel("first layer of stage 1")
    ax.set_ylabel("tokens/s")
    ax.set_xticks(ks)
    lo = min([*fixed.values(), *(summary["tokens_per_sec"][n] for n in styles if n in summary["tokens_per_sec"])])
    ax.set_ylim(0.9 * lo, None)
    ax.set_title(f"{summary['case']}: ceiling {summary.get('ceiling_speedup_vs_static')}x, "
                 f"dynmo {summary.get('speedup_vs_static')}x over the better static", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    args = _args(argv)
    if "LOCAL_RANK" in os.environ:
        _worker(args)
        return
    has_experts = getattr(load(args.case), "EXPERT_PARALLEL", False)
    if args.rounds is not None and args.rounds < 1:
        sys.exit(f"--rounds {args.rounds}: must be >= 1")
    if args.stages < 2:
        sys.exit(f"--stages {args.stages}: a pipeline needs >= 2 stages")
    if args.sweep not in (None, "all") and not all(k.strip().isdigit() for k in args.sweep.split(",")):
        sys.exit(f"--sweep {args.sweep}: give the first layers of stage 1 as integers, e.g. --sweep 3,4,5")
    if args.plot and not args.sweep:
        sys.exit("--plot draws the fixed boundaries of --sweep; pass --sweep too")
    if args.sweep and args.stages != 2:
        sys.exit("--sweep enumerates the boundary of a 2-stage pipeline; use it with --stages 2")
    if args.expert_parallel < 1 or (args.expert_parallel > 1 and not has_experts):
        sys.exit(f"--expert-parallel {args.expert_parallel}: must be >= 1, and > 1 only for a case with experts (moe)")
    dp = args.data_parallel or args.expert_parallel
    if dp < 1 or dp % args.expert_parallel:
        sys.exit(f"--data-parallel {dp}: must be >= 1 and a multiple of --expert-parallel {args.expert_parallel}")
    if args.dp_sharding == "fsdp" and dp < 2:
        sys.exit("--dp-sharding fsdp shards each stage over its replicas: pass --data-parallel 2 (or more)")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "runs.json")
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
               str(args.stages * dp),
               "--standalone", os.path.abspath(__file__), "--case", args.case, "--out", out,
               "--expert-parallel", str(args.expert_parallel), "--stages", str(args.stages),
               "--data-parallel", str(dp), "--dp-sharding", args.dp_sharding]
        if args.quick:
            cmd.append("--quick")
        if args.smoke:
            cmd.append("--smoke")
        if args.sweep:
            cmd += ["--sweep", args.sweep]
        if args.rounds:
            cmd += ["--rounds", str(args.rounds)]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(out):
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
            print(json.dumps({"benchmark": "dynamism", "case": args.case, "error": f"torchrun exit {proc.returncode}"}))
            sys.exit(1)
        runs = json.load(open(out))
    for name, recs in runs.items():
        for r in recs:
            if r.get("error"):
                print(f"{name}: ERROR {r['error']}")
            else:
                print(f"{name:8s} {r['tokens_per_sec']:9.1f} tok/s  step {r['step_ms']:7.1f} ms  "
                      f"idle {r['idle_fraction']:.3f}  partition {r['partition_initial']} -> {r['partition_final']}")
    summary = _summarise(args.case, args.quick, runs, args.expert_parallel, args.stages, dp, args.dp_sharding)
    summary["smoke"] = args.smoke
    if args.plot:
        plot_sweep(summary, args.plot)
    case = load(args.case)
    if hasattr(case, "launcher_extra") and not args.smoke:  # figures from a job of its own (another process layout)
        summary.update(case.launcher_extra(args.quick))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
