"""Runs configs meant for different workers in one torchrun job (or one plain process): each
config's ``worker`` key names the worker whose ``run_one`` trains it, so that one launch pays the
start-up once for models that need their own worker (the test GPT, MoD, MoE).

Usage: torchrun --nproc-per-node N tests/support/workers/cases_worker.py SPEC.json
       python tests/support/workers/cases_worker.py SPEC.json     (single process: mod and moe only)
"""
from __future__ import annotations

from tests.support.workers import mod_worker, moe_worker, pipeline_worker
from tests.support.workers.common import run_spec

WORKERS = {"pipeline": pipeline_worker.run_one, "mod": mod_worker.run_one, "moe": moe_worker.run_one}


def run_one(cfg: dict, out_dir: str, idx: int) -> dict:
    return WORKERS[cfg["worker"]](cfg, out_dir, idx)


if __name__ == "__main__":
    run_spec(run_one)
