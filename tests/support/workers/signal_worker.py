"""A SLURM job's signals in the middle of a pipeline step, one case per 2-rank torchrun launch.

Usage: torchrun --nproc-per-node 2 tests/support/workers/signal_worker.py CASE OUT_DIR
Lightning takes the job for a SLURM job (srun's variables, set from torchrun's; ``SLURMEnvironment``
with ``auto_requeue=True``, its default under SLURM), so it installs its SLURM signal handlers;
``scontrol`` is whatever the test puts first on PATH. A signal is sent by the rank to itself from a
forward pre-hook of its first local layer, so its handler runs inside the schedule, while the peer
is blocked in a send or receive of that step. Each rank writes OUT_DIR/rank{r}.json: how its fit
ended, its per-step losses and the global step it reached. Cases (``STEPS`` optimizer steps):

* ``uninterrupted``: no signal.
* ``preempted``: SLURM's requeue signal (SIGUSR1) on both ranks in step 3, then SIGTERM on both in
  step 6 (SLURM's kill at the time limit).
* ``requeued``: the job SLURM requeued: the same directory, no signal.
* ``sigterm_on_rank_1``: SIGTERM on rank 1 only, in step 3.
* ``in_final_validation``: validation every 3 steps (4 batches) and ``STEPS_WITH_VALIDATION``
  steps; the requeue signal on both ranks in the final validation's batch 1, then SIGTERM on rank 1
  only in its batch 2 (no training batch follows either).

Every step trains on the same batch (one batch per epoch), so a run resumed from a checkpoint
continues the uninterrupted run's losses exactly.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

torch.set_num_threads(1)

import lightning as L
from lightning.pytorch.plugins.environments import SLURMEnvironment

import lightning_dynmo  # noqa: F401
from lightning_dynmo import DynMoStrategy

from tests.support.workers.common import make_loader, make_model

CASE, OUT = sys.argv[1], Path(sys.argv[2])
CFG = {"n_layer": 4, "batch": 8, "n_samples": 8}
STEPS = 12
JOB_ID = "4242"
STEPS_WITH_VALIDATION = 6
SIGNALS = {  # (global step, rank) in training, ("val", global step, batch, rank) in validation -> signal
    "preempted": {(3, 0): signal.SIGUSR1, (3, 1): signal.SIGUSR1, (6, 0): signal.SIGTERM, (6, 1): signal.SIGTERM},
    "sigterm_on_rank_1": {(3, 1): signal.SIGTERM},
    "in_final_validation": {("val", 6, 1, 0): signal.SIGUSR1, ("val", 6, 1, 1): signal.SIGUSR1,
                            ("val", 6, 2, 1): signal.SIGTERM},
}.get(CASE, {})


def as_slurm_task() -> None:
    """What srun sets for a task (torchrun chose the rank and the port)."""
    os.environ.update(SLURM_NTASKS=os.environ["WORLD_SIZE"], SLURM_NTASKS_PER_NODE=os.environ["LOCAL_WORLD_SIZE"],
                      SLURM_PROCID=os.environ["RANK"], SLURM_LOCALID=os.environ["LOCAL_RANK"], SLURM_NODEID="0",
                      SLURM_JOB_ID=JOB_ID, SLURM_JOB_NAME="train_gpt", SLURM_NODELIST="127.0.0.1")


def signal_in_forward(trainer, sig) -> None:
    """Send ``sig`` to this rank from a local layer's next forward (inside the schedule): the first
    stage's layer 0 or the last stage's last layer, which no rebalance moves (a hooked layer that
    migrated before its forward would be pickled with this closure and fail the step)."""
    strategy = trainer.strategy
    local = strategy.pipeline.local_layer_indices()
    layer = strategy.pipeline.layers[local[0] if local[0] == 0 else local[-1]]

    def send(module, args):
        handle.remove()
        os.kill(os.getpid(), sig)  # the handler runs here, inside the schedule

    handle = layer.register_forward_pre_hook(send)


class SignalMidStep(L.Callback):
    def __init__(self) -> None:
        self.losses: list[list[float]] = []
        self.val_batches: list[list[int]] = []  # [global step, batch] of each validation batch that finished

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        sig = SIGNALS.get((trainer.global_step, trainer.global_rank))
        if sig is not None:
            signal_in_forward(trainer, sig)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append([trainer.global_step, float(outputs["loss"] if isinstance(outputs, dict) else outputs)])

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        sig = SIGNALS.get(("val", trainer.global_step, batch_idx, trainer.global_rank))
        if sig is not None:
            signal_in_forward(trainer, sig)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.val_batches.append([trainer.global_step, batch_idx])

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        checkpoint["saved_in"] = "validation" if trainer.validating else "training"


def main() -> None:
    as_slurm_task()
    rank = int(os.environ["RANK"])
    root = OUT / "job"
    root.mkdir(parents=True, exist_ok=True)
    rec = SignalMidStep()
    validating = CASE == "in_final_validation"
    trainer = L.Trainer(strategy=DynMoStrategy(pipeline_parallel=2, microbatches=4, rebalance="every_n",
                                               rebalance_interval=2, balancer="partition_time", timeout=60.0,
                                               plot=False),
                        accelerator="cpu", devices=2, max_steps=STEPS_WITH_VALIDATION if validating else STEPS,
                        check_val_every_n_epoch=3, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[rec],
                        plugins=[SLURMEnvironment(auto_requeue=True)], default_root_dir=str(root))
    t0 = time.monotonic()
    outcome = {"error": None}
    try:
        val = make_loader({**CFG, "n_samples": 4 * CFG["batch"]}, CFG["batch"]) if validating else None
        trainer.fit(make_model(CFG), train_dataloaders=make_loader(CFG, CFG["batch"]), val_dataloaders=val)
    except BaseException as err:  # noqa: BLE001 - recorded for the test (SIGTERMException is a SystemExit)
        outcome = {"error": type(err).__name__, "message": str(err)}
    outcome.update(seconds=time.monotonic() - t0, losses=rec.losses, global_step=trainer.global_step,
                   val_batches=rec.val_batches)
    (OUT / f"rank{rank}.json").write_text(json.dumps(outcome))


if __name__ == "__main__":
    main()
