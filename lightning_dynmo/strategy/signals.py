"""Cluster signals (SIGTERM on preemption, SLURM's requeue signal) acted on at the next batch
boundary, by every rank together.

Lightning acts inside its signal handlers. On SIGTERM it broadcasts a flag over the world; under
SLURM with ``auto_requeue`` (its default there), the requeue signal (``--signal=USR1@90``) makes it
save a checkpoint and call ``scontrol requeue``. A handler runs between two bytecodes of the main
thread, so on a pipeline rank it runs in the middle of a step while a peer is blocked in a send or
receive of that step. The SIGTERM broadcast then waits for the peer while the peer waits for it:
both hang until the collective timeout (600 s by default), and gloo's message names neither rank
nor the signal. The requeue checkpoint's collectives meet the peer's step: every rank fails with
``CollectiveMismatchError``, nothing is saved and the job is not requeued.

Here the handlers only record the signal (and forward SIGTERM to the processes Lightning started,
as Lightning does). The per-batch agreement (:func:`act_at_batch_boundary`, called where the
strategy already agrees on the next batch) carries every rank's records, and so does the loss
exchange of every validation and test batch (:func:`signal_flags`, :func:`act_on_signals`); then
every rank runs Lightning's own requeue handler at the same point (the checkpoint is saved by all
ranks, the job requeued by rank 0) and, after a SIGTERM on any rank, every rank stops with
Lightning's ``SIGTERMException``. So a signal that arrives during a long validation inside ``fit``
(the final one included), or during ``trainer.validate``/``test``, is acted on after the current
batch. A signal during ``trainer.predict`` (whose replicas run their own batch counts, so no
collective spans the world there) or after the last batch is recorded and not acted on: the run
ends on its own, or at the cluster's SIGKILL.
"""
from __future__ import annotations

import logging
import signal
from contextlib import suppress
from dataclasses import dataclass

import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_prefixed_message

log = logging.getLogger(__name__)

__all__ = ["DeferredSignals", "act_at_batch_boundary", "act_on_signals", "defer_signal_handlers", "signal_flags"]


@dataclass
class DeferredSignals:
    """The signals this rank received since the last batch boundary."""

    terminate: bool = False
    requeue: int | None = None  # the requeue signal's number
    requeued: bool = False  # acted on: the same signal reaching a slower rank later is not a second one


def defer_signal_handlers(trainer) -> DeferredSignals | None:
    """Make the handlers Lightning is about to register (after the strategy's setup) record the
    signal instead of acting on it. None where this Lightning's signal connector differs."""
    connector = getattr(trainer, "_signal_connector", None)
    if connector is None or not hasattr(connector, "_sigterm_notifier_fn") \
            or not hasattr(connector, "_slurm_sigusr_handler_fn"):
        return None
    state = DeferredSignals()

    def on_sigterm(signum, frame) -> None:
        log.info(rank_prefixed_message(f"Received SIGTERM: {signum}; every rank stops at the next batch boundary",
                                       trainer.local_rank))
        if not state.terminate:
            launcher = trainer.strategy.launcher
            if launcher is not None:
                launcher.kill(signum)  # Lightning's: the processes it started get the signal too
        state.terminate = True

    def on_requeue(signum, frame) -> None:
        if state.requeued:
            return  # every rank already saved and rank 0 requeued the job for this signal
        log.info(rank_prefixed_message(f"Received the requeue signal {signum}; every rank saves a checkpoint at the "
                                       "next batch boundary", trainer.local_rank))
        state.requeue = int(signum)

    connector._sigterm_notifier_fn = on_sigterm
    connector._slurm_sigusr_handler_fn = on_requeue
    return state


def signal_flags(state: DeferredSignals | None, trainer) -> tuple[float, float]:
    """This rank's ``(terminate, requeue)`` flags, for a collective that every rank makes (the
    maximum or the sum over the ranks says whether any rank got the signal)."""
    mine = state or DeferredSignals()
    terminate = mine.terminate or bool(getattr(trainer, "received_sigterm", False))
    return float(terminate), float(mine.requeue is not None)


def act_on_signals(state: DeferredSignals | None, trainer, any_terminate: bool, any_requeue: bool) -> None:
    """What every rank does after a collective told it the signals of all ranks: run the requeue
    save if any rank got the requeue signal (once per run: SLURM signals every task, not all at the
    same moment), then stop if any rank got SIGTERM."""
    mine = state or DeferredSignals()
    if any_requeue:
        connector = trainer._signal_connector
        signum = mine.requeue if mine.requeue is not None else _requeue_signal(trainer)
        mine.requeue, mine.requeued = None, True
        type(connector)._slurm_sigusr_handler_fn(connector, signum, None)  # Lightning's: save, then requeue
    if any_terminate:
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        trainer._signal_connector.received_sigterm = True
        who = "this rank" if mine.terminate else "another rank"
        log.warning("dynmo: every rank stops at step %d: %s received SIGTERM (Lightning ends the run with exit "
                    "code 0, as under DDP)", trainer.global_step, who)
        with suppress(Exception):
            dist.barrier()  # Lightning's own: every rank stops together
        raise SIGTERMException()


def act_at_batch_boundary(state: DeferredSignals | None, trainer, agree) -> None:
    """Agree on the next training batch (``agree(name, flag)``, the strategy's ledger) carrying
    every rank's signals, then act on them (:func:`act_on_signals`)."""
    any_terminate, any_requeue = agree("next training batch", flag=signal_flags(state, trainer))
    act_on_signals(state, trainer, bool(any_terminate), bool(any_requeue))


def _requeue_signal(trainer) -> int:
    environment = getattr(trainer._accelerator_connector, "cluster_environment", None)
    return int(getattr(environment, "requeue_signal", None) or signal.SIGUSR1)
