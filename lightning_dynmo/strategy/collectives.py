"""What ``DynMoStrategy`` shares with any torch.distributed strategy, apart from its pipeline
logic: devices and ranks, and Lightning's collectives (barrier, broadcast, reduce) over the default
world group; and :func:`explain_timeout`, which makes a collective's timeout say which call every
rank must make."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from typing_extensions import override

from ..runtime.fault import (RankFailedError, explain_lost_peer, peer_missing, report_failure,
                             step_region)
from ..runtime.ledger import CollectiveLedger
from .signals import DeferredSignals, act_at_batch_boundary, defer_signal_handlers


class WorldStrategy(ParallelStrategy):
    """A Lightning ``ParallelStrategy`` with one process per device: its devices, ranks and
    collectives over the world."""

    _num_nodes = 1
    ledger: CollectiveLedger | None = None  # set once the process group is up (setup_environment)

    def agree(self, name: str, flag: float | tuple[float, ...] = 0.0) -> float | tuple[float, ...]:
        """Every rank names the collective it is about to make (``runtime/fault.py``); a rank that
        calls something else makes every rank raise at once instead of waiting out the timeout.
        Returns the largest ``flag`` over the ranks (element-wise for a tuple)."""
        if self.ledger is not None and dist.is_available() and dist.is_initialized():
            return self.ledger.agree(name, flag=flag)
        return flag

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Always (``self.log(..., sync_dist=True)`` reduces over the ranks). Samplers: with more
        than one data-parallel replica Lightning injects a DistributedSampler (our replica count and
        rank; it shuffles training data, seeded, the same on every rank of a pipeline); with one
        replica none is injected (see ``DynMoStrategy.setup``), so training sees the loader's own order."""
        return True

    @override
    def on_exception(self, exception: BaseException) -> None:
        """A rank whose run ends in an error outside a pipeline step (a callback or hook that raised
        on this rank alone) names itself to its peers, whose next collective then raises
        ``RankFailedError`` with this rank and the cause (``runtime/fault.py``)."""
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        if isinstance(exception, SIGTERMException):
            return super().on_exception(exception)  # every rank stops together (strategy/signals.py)
        trainer = getattr(self.lightning_module, "_trainer", None) if self.lightning_module is not None else None
        step = getattr(trainer, "global_step", None)
        what = "interrupted (Ctrl+C)" if isinstance(exception, KeyboardInterrupt) else \
            "outside the pipeline step (a hook or callback)"
        report_failure(f"step {step}, {what}" if step is not None else what, exception)
        super().on_exception(exception)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if dist.is_available() and dist.is_initialized():
            self.agree("barrier")
            if dist.get_backend() == "nccl":
                dist.barrier(device_ids=[self.root_device.index])
            else:
                dist.barrier()

    @override
    def broadcast(self, obj, src: int = 0):
        if not (dist.is_available() and dist.is_initialized()):
            return obj
        self.agree("broadcast")
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(self, tensor, group=None, reduce_op="mean"):
        from lightning.fabric.utilities.distributed import _sync_ddp_if_available

        if isinstance(tensor, torch.Tensor):
            self.agree("reduce")
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor


def set_world_ranks(strategy: WorldStrategy) -> None:
    """Global rank and world size from the node and local ranks (one process per device)."""
    if strategy.cluster_environment is not None:
        strategy.cluster_environment.set_global_rank(strategy.node_rank * strategy.num_processes + strategy.local_rank)
        strategy.cluster_environment.set_world_size(strategy.num_nodes * strategy.num_processes)
    rank_zero_only.rank = utils_rank_zero_only.rank = strategy.global_rank


@contextmanager
def explain_timeout(hint: str, where: str = "a collective call"):
    """A collective inside the block that timed out, or lost a peer (a rank stopped, or skipped a
    call every rank must make), raises :class:`~lightning_dynmo.runtime.fault.RankFailedError`
    naming the rank that failed when the job's failure board knows it, else ``RuntimeError`` with
    torch's message followed by ``hint``, after dumping this rank's Python stacks."""
    try:
        yield
    except RuntimeError as err:
        if not peer_missing(err) or isinstance(err, RankFailedError):
            raise
        raise explain_lost_peer(err, where, hint) from err


class BatchBoundary:
    """The cluster signals this rank received (``strategy/signals.py``), and where a training
    batch's first agreement, which carries them, runs: in Lightning's epoch loop when
    :func:`agree_before_each_batch` could take its place there, else in ``on_train_batch_start``."""

    def __init__(self) -> None:
        self.signals: DeferredSignals | None = None
        self.in_epoch_loop = False

    def install(self, strategy: WorldStrategy, trainer, fitting: bool) -> None:
        """At setup, before Lightning registers its signal handlers."""
        self.signals = defer_signal_handlers(trainer)  # acted on at a batch boundary
        if fitting:
            self.in_epoch_loop = agree_before_each_batch(strategy, trainer, self.signals)

    def at_batch_start(self, trainer, agree) -> None:
        if not self.in_epoch_loop:
            act_at_batch_boundary(self.signals, trainer, agree)


def agree_before_each_batch(strategy: WorldStrategy, trainer, signals: DeferredSignals | None) -> bool:
    """Make the first collective of every training batch the ledger's agreement: Lightning's epoch
    loop broadcasts a SIGTERM flag with a plain ``dist.broadcast`` before the batch's hooks run,
    so a rank still in the previous batch's hooks (a ``save_checkpoint`` on rank 0 only) would
    meet it there and both would wait out the timeout. The agreement carries the signals every
    rank received instead (``strategy/signals.py``: any rank's SIGTERM stops every rank, as
    Lightning's broadcast of rank 0's does, and SLURM's requeue signal saves on every rank), so
    the check costs no extra collective. Returns False where this Lightning has no such broadcast
    (``on_train_batch_start`` agrees then)."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    if getattr(type(loop), "_broadcast_sigterm_tensor", None) is None:
        return False

    def agree_and_act_on_signals() -> None:
        with step_region(f"step {trainer.global_step} (before the batch)"):
            act_at_batch_boundary(signals, trainer, strategy.agree)

    loop._broadcast_sigterm_tensor = agree_and_act_on_signals
    return True
