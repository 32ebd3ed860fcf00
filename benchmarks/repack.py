"""Elastic re-packing: a 4-rank pipeline whose later layers become cheap (early exit) packs itself
onto fewer ranks and releases the rest.

Phases in one run (torchrun, 4 ranks x 1 thread; on this 2-core machine the 4 ranks are
oversubscribed, which flatters the packed pipeline: fewer processes then compete for the cores):

1. plain training on 4 ranks;
2. from step ``--exit-step`` tokens exit after block 1 (so blocks 2..7 become nearly free and the
   LM head, which no partition can split, bounds the step time) (saturation threshold), the strategy is asked
   to rebalance; throughput of the balanced 4-rank pipeline is measured ("before");
3. the strategy is asked to re-pack (``repack="auto"``: fewest ranks whose predicted step time stays
   within 10 %, the benchmark's throughput bound); throughput on the packed pipeline is measured ("after").

Last line: JSON with ``stages_before``, ``stages_after``, ``throughput_ratio`` (after/before
tokens/s) and ``throughput_per_worker_ratio``. Target: per-worker >= 1.5x, total within 10 %.

    python benchmarks/repack.py [--quick]
    python benchmarks/repack.py --smoke     # seconds: 2 ranks (packs onto 1), width 32, 2 steps per phase
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from statistics import median

from _harness import launch, write_result

VOCAB = 8192  # the LM head (~7 narrow blocks of work) is the one layer no partition can split
#: keys the last JSON line always has (tests/unit/test_benchmarks_smoke.py checks them on ``--smoke``)
RESULT_KEYS = ("benchmark", "ranks", "stages_before", "stages_after", "released_ranks", "tokens_per_sec_before",
               "tokens_per_sec_after", "throughput_ratio", "throughput_per_worker_ratio", "partition_after")
#: what ``--smoke`` sets where the command line leaves it open
SMOKE = dict(ranks=2, embd=32, block=16, batch=4, measure=2, tolerance=0.9)  # so that it packs


def worker(args) -> None:
    import torch
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from _harness import StepTimer
    from lightning_dynmo import DynMoStrategy
    from lightning_dynmo.dynamic import EarlyExitGPT
    from lightning_dynmo.models import GPTConfig

    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=VOCAB, block_size=args.block, n_layer=8, n_head=4, n_embd=args.embd, dropout=0.0)
    model = EarlyExitGPT(cfg, exit_layers=[1], exit_threshold=None, seed=0, warmup_steps=1)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, VOCAB, (args.batch * (args.steps + 2), args.block + 1), generator=g)
    loader = DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=args.batch, drop_last=True)
    repack_step = args.exit_step + args.measure + 3

    class Scenario(L.Callback):
        def __init__(self):
            self.active = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            step = trainer.global_step
            if step == args.exit_step:
                pl_module.set_exit_threshold(args.threshold)  # tokens now leave after block 1
                trainer.strategy.pipeline.request_rebalance("early exit switched on")
            if step == repack_step:
                trainer.strategy.pipeline.request_repack("auto")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            fr = [b.active_fraction for b in pl_module.pipeline_layers() if hasattr(b, "active_fraction")]
            self.active.append(fr)

    timer, scen = StepTimer(), Scenario()
    strategy = DynMoStrategy(pipeline_parallel=args.ranks, schedule="1f1b", microbatches=None,
                             balancer="partition_time",
                             rebalance="on_event", repack="off", repack_tolerance=args.tolerance, plot=False)
    logs = tempfile.TemporaryDirectory(prefix="dynmo_bench_")  # rebalance_history / cost_trace: not the cwd
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=args.ranks, max_steps=args.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[timer, scen], limit_val_batches=0, default_root_dir=logs.name)
    trainer.fit(model, train_dataloaders=loader)
    logs.cleanup()
    steps = [b - a for a, b in zip(timer.starts, timer.starts[1:])]
    hist = trainer.strategy.pipeline.rebalance_history
    packs = [h for h in hist if h.get("kind") == "repack" and h.get("applied")]
    pack_step = packs[0]["step"] if packs else None
    before = steps[args.exit_step + 3: repack_step]  # after the rebalance, before the repack request
    after = steps[pack_step + 1:] if pack_step is not None else []
    write_result(args.out, {
        "before_s": median(before), "after_s": median(after) if after else None,
        "stages_before": args.ranks, "stages_after": packs[0]["ranks_after"] if packs else args.ranks,
        "released": packs[0]["released"] if packs else [], "history": hist,
        "partition": str(trainer.strategy.pipeline.partition),
    })


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--smoke", action="store_true",
                   help="2 ranks, a narrow model, 2 steps per phase: checks that the script runs")
    p.add_argument("--ranks", type=int, default=None, help="pipeline ranks before the re-pack (default 4)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--embd", type=int, default=None, help="default 192")
    p.add_argument("--block", type=int, default=None, help="default 128")
    p.add_argument("--batch", type=int, default=None, help="default 16")
    p.add_argument("--threshold", type=float, default=-1.0, help="saturation threshold once exits start (-1: all exit)")
    p.add_argument("--exit-step", type=int, default=2)
    p.add_argument("--tolerance", type=float, default=None,
                   help="repack_tolerance: how much slower the packed step may be predicted (default 0.10)")
    p.add_argument("--measure", type=int, default=None, help="steps measured per phase")
    args = p.parse_args()
    for key, full in (("ranks", 4), ("embd", 192), ("block", 128), ("batch", 16), ("tolerance", 0.10)):
        if getattr(args, key) is None:
            setattr(args, key, SMOKE[key] if args.smoke else full)
    args.measure = args.measure or (SMOKE["measure"] if args.smoke else 5 if args.quick else 10)
    args.steps = args.exit_step + 2 * args.measure + 8
    if args.worker:
        worker(args)
        return
    fwd = [f"--{k.replace('_', '-')}={getattr(args, k)}"
           for k in ("ranks", "embd", "block", "batch", "threshold", "exit_step", "measure", "tolerance")]
    r = launch(Path(__file__), args.ranks, fwd)
    tokens = args.batch * args.block
    before = tokens / r["before_s"]
    after = tokens / r["after_s"] if r["after_s"] else float("nan")
    sb, sa = r["stages_before"], r["stages_after"]
    for h in r["history"]:
        print(f"step {h['step']}: {h['reason']}: {h['before']} -> {h.get('after', h['before'])} "
              f"applied={h['applied']} ({h.get('why', '')})")
    print(json.dumps({
        "benchmark": "repack", "smoke": args.smoke,
        "command": "python benchmarks/repack.py" + (" --quick" if args.quick else "")
        + (" --smoke" if args.smoke else ""),
        "ranks": args.ranks, "oversubscribed_cpu": args.ranks > (os.cpu_count() or 1), "threads_per_rank": 1,
        "stages_before": sb, "stages_after": sa, "released_ranks": r["released"],
        "tokens_per_sec_before": round(before, 1), "tokens_per_sec_after": round(after, 1),
        "throughput_ratio": round(after / before, 3),
        "throughput_per_worker_ratio": round((after / sa) / (before / sb), 3),
        "partition_after": r["partition"],
    }))


if __name__ == "__main__":
    main()
