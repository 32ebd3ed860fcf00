"""A batch that the configured micro-batch count does not divide: the last, partial batch of an
epoch (a loader without ``drop_last``).

Single-process Lightning trains on that batch with the mean loss over its samples. The pipeline
does the same exactly: the batch runs with fewer (equal) micro-batches, whose mean of means is
the batch mean. Only a batch smaller than the largest seen so far is treated so; a full batch that
``microbatches`` does not divide stays an error (a configuration mistake). Where no micro-batch
count suits the schedule (e.g. one sample left for a 1F1B pipeline, which needs at least one
micro-batch per rank), the job stops before the first step, naming ``drop_last=True``.
"""
from __future__ import annotations

from collections.abc import Sized

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import DataLoader

from ..plan.schedules import ScheduleSpec, choose_microbatches


class PartialBatchError(ValueError):
    """No micro-batch count suits the schedule for the epoch's last, partial batch."""


def _fallback(spec: ScheduleSpec, batch_size: int, pp: int, virtual: int, pinned: int | None) -> int | None:
    """The largest micro-batch count that divides ``batch_size``, suits the schedule and is at
    most ``pinned`` (or the smallest valid one above it); None when there is none."""
    valid = spec.valid_microbatches(batch_size, pp, virtual)
    if not valid:
        return None
    below = [m for m in valid if pinned is None or m <= pinned]
    return max(below) if below else min(valid)


def _no_count(spec: ScheduleSpec, size: int, full: int, pp: int) -> PartialBatchError:
    return PartialBatchError(
        f"the last batch of the epoch holds {size} samples ({full} in the others) and no micro-batch count "
        f"divides it and suits schedule {spec.name!r} on {pp} pipeline ranks; pass drop_last=True to the "
        f"DataLoader, or make the dataset length (per data-parallel replica) a multiple of the batch size"
    )


class BatchSizes:
    """Micro-batch counts per batch size for the strategy's ``options``, with the partial-batch
    rule of the module docstring."""

    def __init__(self, options) -> None:
        self.options = options
        self.largest = 0
        self._told: set[int] = set()

    def check_loader(self, loaders, pp: int) -> None:
        """Before the first step (see :func:`check_last_batch`)."""
        o = self.options
        check_last_batch(loaders, o.schedule, pp, o.virtual_stages, o.microbatches)

    def microbatches(self, batch_size: int, pp: int) -> tuple[int, bool]:
        """``(count, partial)``: ``partial`` when ``batch_size`` ran with the fallback count."""
        spec, virtual, pinned = self.options.schedule, self.options.virtual_stages, self.options.microbatches
        self.largest = max(self.largest, batch_size)
        try:
            return choose_microbatches(spec, batch_size, pp, virtual, pinned), False
        except ValueError as err:
            if batch_size >= self.largest:
                raise
            m = _fallback(spec, batch_size, pp, virtual, pinned)
            if m is None:
                raise _no_count(spec, batch_size, self.largest, pp) from err
        if batch_size not in self._told:
            self._told.add(batch_size)
            rank_zero_info(f"dynmo: a partial batch of {batch_size} samples runs as {m} micro-batches "
                           f"(the mean loss over its samples, as in one process)")
        return m, True


def last_batch_size(loader) -> tuple[int, int] | None:
    """``(full, last)`` batch sizes of a map-style ``DataLoader`` whose last batch is partial
    (``None`` when it has none or the loader does not say)."""
    if not isinstance(loader, DataLoader) or loader.drop_last or not loader.batch_size:
        return None
    sampler = loader.batch_sampler.sampler if loader.batch_sampler is not None else loader.sampler
    if not isinstance(sampler, Sized):
        return None
    try:
        n = len(sampler)
    except TypeError:
        return None
    last = n % loader.batch_size
    return (loader.batch_size, last) if last and n > loader.batch_size else None


def check_last_batch(loaders, spec: ScheduleSpec, pp: int, virtual: int, pinned: int | None) -> None:
    """Before the first step: refuse a training loader whose partial last batch could not run."""
    for loader in loaders if isinstance(loaders, (list, tuple)) else [loaders]:
        sizes = last_batch_size(loader)
        if sizes is None:
            continue
        full, last = sizes
        try:
            choose_microbatches(spec, full, pp, virtual, pinned)
        except ValueError:
            continue  # the full batches fail at the first step with their own message
        if _fallback(spec, last, pp, virtual, pinned) is None:
            raise _no_count(spec, last, full, pp)
