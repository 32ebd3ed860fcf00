"""Single process vs a 2-stage dynmo pipeline on a balanced GPT, 1 thread per rank.

Prints one JSON object as its last line with ``speedup`` (pipeline tokens/s over single-process
tokens/s), ``ideal_speedup`` = m*p/(m+p-1) and ``fraction_of_ideal``. Target: >= 0.85.

``--pipeline-granularity sublayer``: the pipeline's layers are the blocks' attention and MLP halves
(``GPTConfig(pipeline_granularity="sublayer")``; ``fine``: five pieces per block), split by the
same static parameter balancer;
the same invocation also measures block granularity, interleaved, and reports its figures under
``"block"`` and ``fraction_of_ideal_minus_block`` (target: > -0.03, finer cuts must not cost).

``--head-chunks K``: the LM head + loss as K vocabulary chunks (``GPTConfig(head_chunks=K)``); with
a finer granularity or K > 1 the baseline beside it is whole blocks with one head.

    python benchmarks/pipeline_throughput.py [--quick] [--pipeline-granularity {block,sublayer,fine}]
        [--head-chunks K] [--compile]
    python benchmarks/pipeline_throughput.py --smoke     # seconds: 2 tiny layers, 5 steps, one repeat

``--compile`` also runs the pipeline with ``DynMoStrategy(compile=True)`` (each pipeline layer
compiled in place, inductor on CPU) and reports ``compile_speedup`` (compiled pipeline tokens/s
over the eager pipeline's, compilation excluded by the warm-up steps) and
``compile_max_loss_diff`` (largest |compiled - eager| training loss over the steps; target <= 1e-4).
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from _harness import launch, median, write_result

#: keys the last JSON line always has (tests/unit/test_benchmarks_smoke.py checks them on ``--smoke``)
RESULT_KEYS = ("benchmark", "schedule", "microbatches", "stages", "granularity", "model", "partition",
               "single_tokens_per_sec", "pipeline_tokens_per_sec", "speedup", "ideal_speedup", "fraction_of_ideal",
               "repeats")
#: what ``--smoke`` sets where the command line leaves it open
SMOKE = dict(layers=2, embd=32, block=16, batch=4, microbatches=2, steps=5)


def model_and_data(args):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_dynmo.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=256, block_size=args.block, n_layer=args.layers, n_head=4, n_embd=args.embd, dropout=0.0,
                    head_chunks=args.head_chunks, pipeline_granularity=args.pipeline_granularity)
    model = GPT(cfg, seed=0, warmup_steps=1)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (args.batch * (args.steps + 2), args.block + 1), generator=g)
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=args.batch, drop_last=True)
    return model, loader


def worker(args) -> None:
    import torch
    import lightning as L

    from _harness import StepTimer

    torch.set_num_threads(1)
    model, loader = model_and_data(args)
    timer = StepTimer()
    logs = tempfile.TemporaryDirectory(prefix="dynmo_bench_")  # rebalance_history / cost_trace: not the cwd
    common = dict(accelerator="cpu", max_steps=args.steps, logger=False, enable_checkpointing=False,
                  enable_progress_bar=False, enable_model_summary=False, callbacks=[timer], limit_val_batches=0,
                  default_root_dir=logs.name)
    if args.mode == "single":
        trainer = L.Trainer(devices=1, **common)
    else:
        from lightning_dynmo import DynMoStrategy

        trainer = L.Trainer(strategy=DynMoStrategy(pipeline_parallel=2, schedule=args.schedule,
                                                   microbatches=args.microbatches,
                                                   balancer="param", compile=args.compile), devices=2, **common)
    trainer.fit(model, train_dataloaders=loader)
    sec = timer.seconds_per_step(skip=args.warmup)
    result = {"tokens_per_sec": args.batch * args.block / sec, "seconds_per_step": sec,
              "losses": [m.get("train_loss") for m in timer.metrics]}
    if args.mode == "pipeline":
        result["partition"] = str(trainer.strategy.pipeline.partition)
    logs.cleanup()
    write_result(args.out, result)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer steps and repeats")
    p.add_argument("--smoke", action="store_true",
                   help="a tiny model, 5 steps, one repeat: checks that the script runs")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=["single", "pipeline"], default="single", help=argparse.SUPPRESS)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--microbatches", type=int, default=None, help="default 8")
    p.add_argument("--layers", type=int, default=None, help="default 8")
    p.add_argument("--embd", type=int, default=None, help="default 256")
    p.add_argument("--block", type=int, default=None, help="default 128")
    p.add_argument("--batch", type=int, default=None, help="default 32")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--head-chunks", type=int, default=1,
                   help="GPTConfig(head_chunks=K): the LM head + loss as K layers")
    p.add_argument("--pipeline-granularity", choices=["block", "sublayer", "fine"], default="block",
                   help="pipeline layers: whole blocks, attention and MLP halves, or five pieces per block "
                        "(finer than block: whole blocks with one head are measured too)")
    p.add_argument("--compile", action="store_true", help="also run the pipeline with compile=True")
    args = p.parse_args()
    for key, full in (("microbatches", 8), ("layers", 8), ("embd", 256), ("block", 128), ("batch", 32)):
        if getattr(args, key) is None:
            setattr(args, key, SMOKE[key] if args.smoke else full)
    args.steps = args.steps or (SMOKE["steps"] if args.smoke else 8 if args.quick else 16)
    args.warmup = 2 if args.smoke else 3
    if args.worker:
        worker(args)
        return
    repeats = args.repeats or (1 if args.quick or args.smoke else 3)
    fwd = [f"--{k}={getattr(args, k)}" for k in ("schedule", "microbatches", "layers", "embd", "block", "batch",
                                                 "steps")]
    fwd += ["--smoke"] if args.smoke else []
    # the configuration asked for, and (when it is finer) whole blocks with one head beside it
    asked = (args.pipeline_granularity, args.head_chunks)
    grains = [asked] + ([("block", 1)] if asked != ("block", 1) else [])
    single = {g: [] for g in grains}
    pipe = {g: [] for g in grains}
    compiled: list[dict] = []
    for r in range(repeats):  # interleaved so that load changes hit every variant alike
        for g in grains:
            variant = [f"--pipeline-granularity={g[0]}", f"--head-chunks={g[1]}"]
            single[g].append(launch(Path(__file__), 1, fwd + ["--mode=single"] + variant))
            pipe[g].append(launch(Path(__file__), 2, fwd + ["--mode=pipeline"] + variant))
            print(f"repeat {r} ({g[0]}, head_chunks={g[1]}): single {single[g][-1]['tokens_per_sec']:.0f} tok/s, "
                  f"pipeline {pipe[g][-1]['tokens_per_sec']:.0f} tok/s", flush=True)
        if args.compile:  # the configuration asked for, compiled
            compiled.append(launch(Path(__file__), 2,
                                   fwd + ["--mode=pipeline", "--compile", f"--pipeline-granularity={grains[0][0]}",
                                                            f"--head-chunks={grains[0][1]}"], timeout=1800))
            print(f"repeat {r}: compiled pipeline {compiled[-1]['tokens_per_sec']:.0f} tok/s", flush=True)
    m, pp = args.microbatches, 2
    ideal = m * pp / (m + pp - 1)

    def figures(g: tuple) -> dict:
        s = median([x["tokens_per_sec"] for x in single[g]])
        q = median([x["tokens_per_sec"] for x in pipe[g]])
        return {"partition": pipe[g][-1]["partition"], "single_tokens_per_sec": round(s, 1),
                "pipeline_tokens_per_sec": round(q, 1), "speedup": round(q / s, 3),
                "fraction_of_ideal": round(q / s / ideal, 3)}

    out = figures(grains[0])
    extra = {}
    if len(grains) > 1:  # the finer cut against whole blocks with one head, measured side by side
        block = figures(("block", 1))
        extra = {"block": block,
                 "fraction_of_ideal_minus_block": round(out["fraction_of_ideal"] - block["fraction_of_ideal"], 3)}
    print(json.dumps({
        "benchmark": "pipeline_throughput", "smoke": args.smoke, "schedule": args.schedule, "microbatches": m,
        "stages": pp,
        "granularity": args.pipeline_granularity,
        "model": {"n_layer": args.layers, "n_embd": args.embd, "block": args.block, "batch": args.batch,
                  "head_chunks": args.head_chunks},
        "partition": out["partition"], "single_tokens_per_sec": out["single_tokens_per_sec"],
        "pipeline_tokens_per_sec": out["pipeline_tokens_per_sec"], "speedup": out["speedup"],
        "ideal_speedup": round(ideal, 3), "fraction_of_ideal": out["fraction_of_ideal"], **extra,
        "repeats": repeats, "threads_per_rank": 1,
        **(_compiled(pipe[grains[0]], compiled, out["pipeline_tokens_per_sec"]) if compiled else {}),
    }))


def _compiled(eager: list[dict], compiled: list[dict], eager_tps: float) -> dict:
    """compile=True against the eager pipeline: throughput and per-step training losses."""
    c = median([x["tokens_per_sec"] for x in compiled])
    diffs = [abs(a - b) for e, k in zip(eager, compiled) for a, b in zip(e["losses"], k["losses"])
             if a is not None and b is not None]
    return {"compiled_pipeline_tokens_per_sec": round(c, 1), "compile_speedup": round(c / eager_tps, 3),
            "compile_max_loss_diff": max(diffs) if diffs else None,
            "compile_losses_equal": bool(diffs) and max(diffs) <= 1e-4}


if __name__ == "__main__":
    main()
