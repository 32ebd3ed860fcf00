"""What the collective ledger costs (issue 31): one ``CollectiveLedger.agree`` (a 3-element float64
all-reduce over the world plus its check) per call, at 2 and 8 gloo ranks, one thread each.

A training step makes one agreement of its own (before the step; the one before each batch
replaces Lightning's SIGTERM broadcast). Run it alone: it launches torchrun jobs.

    python benchmarks/ledger_cost.py [--ranks 2 8] [--calls 1000]
    python benchmarks/ledger_cost.py --smoke      # seconds: 2 ranks, 20 calls

The last line is one JSON object: microseconds per agreement by world size, and a control (the
same all-reduce without the ledger) measured in the same job.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

#: keys the last JSON line always has (tests/unit/test_benchmarks_smoke.py checks them on ``--smoke``)
RESULT_KEYS = ("benchmark", "calls", "us_per_call")


def worker(calls: int, out: str, warmup: int = 50) -> None:
    import time

    import torch
    import torch.distributed as dist

    from lightning_dynmo.runtime.ledger import CollectiveLedger

    dist.init_process_group("gloo")
    ledger = CollectiveLedger(dist.get_rank(), torch.device("cpu"))
    v = torch.zeros(3, dtype=torch.float64)
    timings = {}
    for _ in range(warmup):
        ledger.agree("warm-up")
    for name, fn in (("control_all_reduce", lambda: dist.all_reduce(v, op=dist.ReduceOp.MIN)),
                     ("agree", lambda: ledger.agree("next training batch"))):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        timings[name] = (time.perf_counter() - t0) / calls * 1e6
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({k: round(t, 1) for k, t in timings.items()}, f)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=None, help="world sizes (default 2 8; --smoke: 2)")
    p.add_argument("--calls", type=int, default=None, help="agreements timed per world size (default 1000)")
    p.add_argument("--smoke", action="store_true", help="2 ranks, 20 calls: checks that the script runs")
    p.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(int(args.worker[0]), args.worker[1], int(args.worker[2]))
        return
    ranks = args.ranks or ([2] if args.smoke else [2, 8])
    calls = args.calls or (20 if args.smoke else 1000)
    warmup = 5 if args.smoke else 50
    result = {"benchmark": "ledger_cost", "smoke": args.smoke, "calls": calls, "us_per_call": {}}
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for n in ranks:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
                                   "--standalone", __file__, "--worker", str(calls), out.name, str(warmup)],
                                  env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
                print(json.dumps({"benchmark": "ledger_cost",
                                  "error": f"torchrun exit {proc.returncode} at {n} ranks"}))
                sys.exit(1)
            result["us_per_call"][str(n)] = json.load(open(out.name))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
