"""Failures that must name themselves within seconds, one case per torchrun launch.

Usage: torchrun --nproc-per-node 2 tests/support/workers/fault_worker.py CASE OUT_DIR
Each rank writes OUT_DIR/rank{r}.json itself (no collective: after a failure there is none to
trust): per fit, the exception it raised and when. Cases:

* ``extra_collective``: rank 1 makes one ``strategy.broadcast`` the other rank does not make.
* ``raise_then_exit``: a layer on rank 1 raises inside the pipeline schedule; rank 1 then exits.
* ``raise_then_continue``: the same, but rank 1 goes on to a second fit in the same process and
  then stays alive for a while (what a benchmark harness that catches failures does).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

torch.set_num_threads(1)

import lightning as L

import lightning_dynmo  # noqa: F401
from lightning_dynmo import DynMoStrategy

from tests.support.workers.common import make_loader, make_model

CASE, OUT = sys.argv[1], Path(sys.argv[2])
CFG = {"n_layer": 4, "batch": 8}


class Plant(L.Callback):
    """At step 2, on rank 1 only: an extra collective, or a layer that raises in its forward."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank != 1 or trainer.global_step != 2:
            return
        if CASE == "extra_collective":
            trainer.strategy.broadcast("only rank 1 calls this")
            return
        strategy = trainer.strategy

        def boom(*_):
            raise RuntimeError("boom: a layer failed on rank 1 only")

        strategy.pipeline.layers[strategy.pipeline.local_layer_indices()[0]].register_forward_hook(boom)


def fit() -> dict:
    t0 = time.monotonic()
    trainer = L.Trainer(strategy=DynMoStrategy(pipeline_parallel=2, rebalance="never", timeout=120.0, plot=False),
                        accelerator="cpu", devices=2, max_steps=5, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Plant()],
                        default_root_dir=str(OUT / "root"))
    try:
        trainer.fit(make_model(CFG), train_dataloaders=make_loader(CFG, CFG["batch"]))
        outcome = {"error": None}
    except Exception as err:  # noqa: BLE001 - recorded for the test
        outcome = {"error": type(err).__name__, "message": str(err)}
    outcome["seconds"] = time.monotonic() - t0
    return outcome


def main() -> None:
    import os

    rank = int(os.environ["RANK"])
    OUT.mkdir(parents=True, exist_ok=True)
    outcomes = []

    def record():
        (OUT / f"rank{rank}.json").write_text(json.dumps(outcomes))

    outcomes.append(fit())
    record()
    if CASE == "raise_then_continue" and rank == 1:
        outcomes.append(fit())  # the harness's next configuration
        record()
        time.sleep(20)  # alive, so its peers cannot learn of the failure from a closed connection


if __name__ == "__main__":
    main()
