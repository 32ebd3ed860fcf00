"""Static vs dynamic balancers on a GPT whose layers cost different amounts, 2 stages, 1 thread
per rank, all variants in one invocation (interleaved over repeats).

The model is a GPT with an 8k-token vocabulary and two 8x-wide MLP blocks right before the head:
the embedding holds as many parameters as the LM head but costs almost nothing to run, while the
head's matmul costs about seven narrow blocks. Megatron-style equal layer counts put the wide
blocks and the head on the last stage; DeepSpeed-style parameter balancing counts the cheap
embedding as heavy and does the same. Time-based balancers profile a step
and migrate; parameter-based dynamic balancers are included for comparison.

Last line: JSON with tokens/s per balancer, ``efficiency`` (ideal balanced step time from the
measured per-layer costs / measured step time, best dynamic balancer), ``speedup_vs_static``
(the median over repeats of best dynamic / better static tokens/s in the same repeat: paired,
since load on a shared machine drifts between repeats) with ``speedup_vs_static_ci95`` (a 95 %
bootstrap interval over repeats) and ``resolution`` (the better static balancer runs twice per
repeat, ``control``: |1 - a/b| of the two, paired the same way, is the noise floor;
``resolution_ci95`` its bootstrap interval), and ``rebalance_cost_iterations`` (profiling overhead +
decision + migration of one rebalance, in training iterations).

``unattributed_busy_fraction``: the share of a rank's busy (chunk) seconds in profiled steps that
no layer's profiled cost covers, max over ranks, the worst profiled variant (target <= 0.03: what
the time-based balancers cannot see, e.g. the loss before it was given to the head).

``--pipeline-granularity sublayer`` cuts every block into its attention and MLP halves
(``GPTConfig(pipeline_granularity="sublayer")``), ``fine`` into five pieces, for every variant,
static ones included.

    python benchmarks/rebalance.py [--quick] [--pipeline-granularity {block,sublayer,fine}] [--head-chunks K]
    python benchmarks/rebalance.py --smoke     # seconds: width 32, 10 steps, one repeat
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from statistics import median

from _harness import bootstrap_ratio, launch, resolution, speedup, write_result

STATIC = ["uniform", "param"]
DYNAMIC = ["partition_time", "partition_param", "diffusion_time", "diffusion_param"]
RATIOS = [1, 1, 1, 1, 1, 1, 8, 8]  # two wide blocks right before the head
VOCAB = 8192
#: keys the last JSON line always has (tests/unit/test_benchmarks_smoke.py checks them on ``--smoke``)
RESULT_KEYS = ("benchmark", "tokens_per_sec", "partitions", "best_dynamic", "best_static", "efficiency",
               "speedup_vs_static", "control", "resolution", "unattributed_busy_fraction", "rebalance_cost_iterations",
               "profiling_overhead", "repeats")
#: what ``--smoke`` sets where the command line leaves it open
SMOKE = dict(embd=32, block=16, batch=4, microbatches=2, steps=10, interval=5)


def worker(args) -> None:
    import torch
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from _harness import Attribution, StepTimer
    from lightning_dynmo import DynMoStrategy
    from lightning_dynmo.models import GPT, GPTConfig

    torch.set_num_threads(1)
    results = {}
    logs = tempfile.TemporaryDirectory(prefix="dynmo_bench_")  # cost_trace / rebalance_history: not the cwd
    for name in STATIC + DYNAMIC + ["control"]:  # control: the better static run a second time (noise floor)
        balancer = _agreed_faster(results) if name == "control" else name
        cfg = GPTConfig(vocab_size=VOCAB, block_size=args.block, n_layer=len(RATIOS), n_head=4, n_embd=args.embd,
                        dropout=0.0, mlp_ratios=tuple(RATIOS), head_chunks=args.head_chunks,
                        pipeline_granularity=args.pipeline_granularity)
        model = GPT(cfg, seed=0, warmup_steps=1)
        g = torch.Generator().manual_seed(0)
        data = torch.randint(0, VOCAB, (args.batch * (args.steps + 2), args.block + 1), generator=g)
        loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=args.batch, drop_last=True)
        dynamic = name in DYNAMIC
        strategy = DynMoStrategy(
            pipeline_parallel=2, schedule="1f1b", microbatches=args.microbatches,
            balancer=balancer, partition=None if not dynamic else _uniform(len(model.pipeline_layers())),
            rebalance="every_n" if dynamic else "never", rebalance_interval=args.interval, plot=False,
        )
        timer, attribution = StepTimer(), Attribution()
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=args.steps, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[timer, attribution], limit_val_batches=0, default_root_dir=logs.name)
        trainer.fit(model, train_dataloaders=loader)
        history = trainer.strategy.pipeline.rebalance_history
        steps = [b - a for a, b in zip(timer.starts, timer.starts[1:])]
        # steady state: after the last applied rebalance, excluding profiled steps
        profiled = {h["step"] - 1 for h in history}
        last = max([h["step"] for h in history if h.get("applied")], default=0)
        decided = {h["step"] for h in history}  # steps whose start ran a decision (and maybe a migration)
        steady = [t for i, t in enumerate(steps) if i >= max(last, 2) and i not in profiled | decided]
        step_s = median(steady)
        cost_ms = None
        applied = [h for h in history if h.get("applied")]
        if applied:
            h = applied[0]
            prof_step = h["step"] - 1
            overhead = max(0.0, steps[prof_step] - step_s) if prof_step < len(steps) else 0.0
            cost_ms = overhead * 1e3 + h["decision_ms"] + h["migration_ms"]
        # Ideal balanced step from the same steps' measured work: every rank busy for the
        # average compute, stretched only by the unavoidable fill/drain (m+S-1)/m.
        m, S = args.microbatches, 2
        eff = [sum(timer.busy[i]) / S * (m + S - 1) / m / t for i, t in enumerate(steps)
               if i >= max(last, 2) and i not in profiled | decided]
        prof = [steps[i] for i in profiled if 2 <= i < len(steps)]
        unattributed = [f for f in attribution.gathered() if f is not None]
        results[name] = {
            "profiling_overhead": (median(prof) / step_s - 1) if prof else None,
            "tokens_per_sec": args.batch * args.block / step_s, "step_seconds": step_s,
            "partition": str(trainer.strategy.pipeline.partition), "rebalance_cost_ms": cost_ms,
            "efficiency": median(eff), "rebalances": len(applied), "balancer": balancer,
            "unattributed_busy_fraction": max(unattributed) if unattributed else None,  # max over ranks
        }
    logs.cleanup()
    write_result(args.out, results)


def _agreed_faster(results: dict) -> str:
    """The faster static balancer as rank 0 measured it (every rank must run the same control)."""
    import torch.distributed as dist

    choice = [max(STATIC, key=lambda n: results[n]["tokens_per_sec"])]
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(choice, src=0)
    return choice[0]


def _worst_unattributed(runs: list[dict], names=DYNAMIC) -> float | None:
    key = "unattributed_busy_fraction"
    per = [median(v) for n in names if (v := [r[n][key] for r in runs if r[n][key] is not None])]
    return round(max(per), 4) if per else None


def _uniform(L: int) -> list[int]:
    half = (L + 1) // 2
    return [0, half, L]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer steps and repeats")
    p.add_argument("--smoke", action="store_true",
                   help="a narrow model, 10 steps, one repeat: checks that the script runs")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--embd", type=int, default=None, help="default 192")
    p.add_argument("--block", type=int, default=None, help="default 128")
    p.add_argument("--batch", type=int, default=None, help="default 16")
    p.add_argument("--microbatches", type=int, default=None, help="default 8")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--interval", type=int, default=None, help="dynamic variants profile/rebalance every N steps (4)")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--head-chunks", type=int, default=1,
                   help="GPTConfig(head_chunks=K): the LM head + loss as K layers")
    p.add_argument("--pipeline-granularity", choices=["block", "sublayer", "fine"], default="block",
                   help="pipeline layers: whole blocks, attention and MLP halves, or five pieces per block "
                        "(static baselines alike)")
    args = p.parse_args()
    for key, full in (("embd", 192), ("block", 128), ("batch", 16), ("microbatches", 8), ("interval", 4)):
        if getattr(args, key) is None:
            setattr(args, key, SMOKE[key] if args.smoke else full)
    args.steps = args.steps or (SMOKE["steps"] if args.smoke else 12 if args.quick else 20)
    if args.worker:
        worker(args)
        return
    repeats = args.repeats or (1 if args.quick or args.smoke else 5)
    fwd = [f"--{k}={getattr(args, k)}" for k in ("embd", "block", "batch", "microbatches", "steps", "interval")]
    fwd += [f"--pipeline-granularity={args.pipeline_granularity}", f"--head-chunks={args.head_chunks}"]
    runs = []
    for r in range(repeats):
        runs.append(launch(Path(__file__), 2, fwd))
        print(f"repeat {r}: " + ", ".join(f"{k} {v['tokens_per_sec']:.0f} tok/s ({v['partition']})"
                                          for k, v in runs[-1].items()), flush=True)
    agg = {name: {"tokens_per_sec": round(median(r[name]["tokens_per_sec"] for r in runs), 1),
                  "partition": runs[-1][name]["partition"]} for name in STATIC + DYNAMIC}
    best_dyn = max(DYNAMIC, key=lambda n: agg[n]["tokens_per_sec"])
    best_static = max(STATIC, key=lambda n: agg[n]["tokens_per_sec"])
    eff = median(r[best_dyn]["efficiency"] for r in runs)
    tps = lambda name: [r[name]["tokens_per_sec"] for r in runs]  # noqa: E731 (per repeat, in order)
    twin = [r[r["control"]["balancer"]]["tokens_per_sec"] for r in runs]
    noise = resolution(twin, tps("control"))
    costs = [r[n]["rebalance_cost_ms"] / 1e3 / r[n]["step_seconds"] for r in runs for n in DYNAMIC
             if r[n]["rebalance_cost_ms"] is not None]
    print(json.dumps({
        "benchmark": "rebalance", "smoke": args.smoke,
        "command": "python benchmarks/rebalance.py" + (" --quick" if args.quick else "")
        + (" --smoke" if args.smoke else "")
        + (f" --pipeline-granularity {args.pipeline_granularity}" if args.pipeline_granularity != "block" else "")
        + (f" --head-chunks {args.head_chunks}" if args.head_chunks != 1 else ""), "stages": 2,
        "microbatches": args.microbatches, "n_layer": len(RATIOS), "vocab": VOCAB,
        "granularity": args.pipeline_granularity,
        "head_chunks": args.head_chunks,
        "tokens_per_sec": {n: agg[n]["tokens_per_sec"] for n in agg},
        "partitions": {n: agg[n]["partition"] for n in agg},
        "best_dynamic": best_dyn, "best_static": best_static,
        "efficiency": round(eff, 3),
        "efficiency_by_balancer": {n: round(median(r[n]["efficiency"] for r in runs), 3) for n in agg},
        # paired: the median over repeats of the best dynamic over the better static in the same repeat
        "speedup_vs_static": round(speedup(tps(best_dyn), [tps(n) for n in STATIC]), 3),
        # the better static run twice per repeat: |1 - a/b| (paired, as the speedup) is the noise
        # floor of every speedup here; its bootstrap interval says how far one figure can be trusted
        "control": runs[0]["control"]["balancer"], "resolution": None if noise is None else round(noise, 4),
        "resolution_ci95": bootstrap_ratio(tps("control"), [twin]),
        "speedup_vs_static_ci95": bootstrap_ratio(tps(best_dyn), [tps(n) for n in STATIC]),
        # busy seconds no layer's profiled cost covers (what the balancers cannot see), max over
        # ranks, the profiled variants' worst median over repeats
        "unattributed_busy_fraction": _worst_unattributed(runs),
        "unattributed_busy_fraction_by_balancer": {n: _worst_unattributed(runs, [n]) for n in DYNAMIC},
        "rebalance_cost_iterations": round(median(costs), 3) if costs else None,
        # a profiled step (per-layer hooks) vs a steady step of the same variant
        "profiling_overhead": round(median(r[n]["profiling_overhead"] for r in runs for n in DYNAMIC
                                           if r[n]["profiling_overhead"] is not None), 3),
        "repeats": repeats, "threads_per_rank": 1,
    }))


if __name__ == "__main__":
    main()
