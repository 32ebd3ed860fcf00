"""``Trainer(accumulate_grad_batches=k)`` through the pipeline.

Single-process Lightning, per window of k batches: ``training_step``, then (first batch only)
``zero_grad``, then ``backward`` of the loss divided by k, adding into ``.grad``; the window's
last batch runs inside ``optimizer_step``, which clips and steps once. The pipeline computes a
batch's gradients inside ``training_step`` (the schedule runs forward and backward), so:

* the schedule back-propagates each micro-batch's loss divided by k, as Lightning does (so
  auxiliary losses scaled by ``1 / k``, ``models/_aux_loss.py``, stay consistent); the loss the
  step reports is multiplied back;
* before a batch's schedule the window's running sum leaves ``.grad`` (at a window's first batch,
  ``batch_idx % k == 0`` as in Lightning's ``zero_grad`` rule, it is dropped), and in ``backward``
  this batch's gradients, their tied copies already summed over the ranks holding them (so every
  copy holds the same sum), are added to it;
* only at the window's last batch: the data-parallel average, the ``on_nonfinite`` verdict over the
  whole window (a non-finite loss anywhere in it skips its one update) and the rebalancer's step
  statistics (busy and wall seconds summed over the window's batches, load factors averaged).

Between batches the running sum lives in ``.grad``, so a layer that migrates inside a window
(``rebalance_to``/``repack_to`` called from a callback) carries its partial sum to its new rank
(``runtime/migration.py`` moves gradients). Decisions of the rebalancer itself are taken before
a window's first batch only: the rebalancer counts optimizer steps, like ``trainer.global_step``.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import replace

import torch
from torch import nn

from ..runtime.step_stats import StepStats


class AccumulationWindow:
    """Where the current batch sits in its accumulation window, and the window's running state."""

    def __init__(self) -> None:
        self.k = 1  # batches per optimizer step (the trainer's accumulate_grad_batches)
        self.first = True  # this batch opens a window
        self._stepping = False  # inside optimizer_step, whose closure runs the window's last batch
        self.apply = True  # no batch of the window had a non-finite loss (or on_nonfinite allows it)
        self._stash: list[tuple[nn.Parameter, torch.Tensor]] = []
        self._stats: list[StepStats] = []

    def begin_batch(self, batch_idx: int, k: int) -> bool:
        """Before a batch (``on_train_batch_start``); returns whether it opens a window."""
        self.k, self.first = int(k), batch_idx % int(k) == 0
        if self.first:
            self.apply, self._stats = True, []
        return self.first

    @property
    def last(self) -> bool:
        """This batch closes its window (with k = 1, every batch does)."""
        return self._stepping or self.k == 1

    @contextmanager
    def closing(self):
        """Around ``optimizer_step``: the closure it runs is the window's last batch."""
        self._stepping = True
        try:
            yield
        finally:
            self._stepping = False

    def scaled(self, loss_fn):
        """``loss_fn`` divided by the current k (read at each call: cached engines keep it)."""

        @functools.wraps(loss_fn)
        def fn(output, target):
            loss = loss_fn(output, target)  # (a loss that is not a float tensor is left for the engine to name)
            scales = self.k != 1 and isinstance(loss, torch.Tensor) and loss.is_floating_point()
            return loss / self.k if scales else loss

        return fn

    def batch_losses(self, losses: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
        """The schedule's micro-batch losses (of the divided loss) as the batch's own."""
        return [loss * self.k for loss in losses] if losses and self.k != 1 else losses

    def set_aside(self, params) -> None:
        """Before the batch's schedule: the window's running sum leaves ``.grad`` (dropped at a
        window's first batch), so the schedule computes this batch's gradients alone."""
        params = list(params)
        self._stash = [] if self.first else [(p, p.grad) for p in params if p.grad is not None]
        for p in params:
            p.grad = None

    def add_batch(self) -> None:
        """In ``backward``, once this batch's gradients are back in ``.grad``: add the running sum."""
        for p, g in self._stash:
            p.grad = g if p.grad is None else g.add_(p.grad)
        self._stash = []

    def note(self, stats: StepStats, apply: bool) -> StepStats | None:
        """A batch's shared statistics and ``on_nonfinite`` verdict; at the window's last batch,
        the window's statistics for the rebalancer (None before)."""
        self.apply = self.apply and apply
        self._stats.append(stats)
        return combine(self._stats) if self.last else None


def combine(stats: list[StepStats]) -> StepStats:
    """One optimizer step's statistics from its batches': seconds summed (over the batches that
    ran on the last one's pipeline ranks), load factors averaged, ``profiled`` if any was."""
    last = stats[-1]
    if len(stats) == 1:
        return last
    same = [s for s in stats if len(s.rank_busy) == len(last.rank_busy)]
    loads = []
    for values in zip(*(s.layer_load for s in stats)):
        known = [v for v in values if v is not None]
        loads.append(sum(known) / len(known) if known else None)
    return replace(last, profiled=any(s.profiled for s in stats), layer_load=loads,
                   rank_busy=[sum(v) for v in zip(*(s.rank_busy for s in same))],
                   rank_wall=[sum(v) for v in zip(*(s.rank_wall for s in same))])
