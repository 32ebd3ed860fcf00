"""Micro-batches weighted by the loss terms they hold, so that a batch whose targets are partly
ignored (padding, prompt tokens masked with -100) trains and evaluates on the mean over all its
counted targets, as one process does.

A pipeline splits each batch into ``m`` micro-batches (and the global batch over ``dp``
replicas); each micro-batch's loss is the mean over its own targets, and the step's loss and
gradients are the mean over micro-batches and replicas. Where every micro-batch counts the same
number of targets that is one process's mean over the batch. Where they differ it is another
weighting of the same terms: a micro-batch of short sequences counts as much as one of long
ones, and losses and gradients differ from single-process training (0.05-0.5 % per step on the
test GPT with a random padded tail per sample). Megatron calls the fix per-token loss.

A model that says how many terms a target holds (``pipeline_loss_tokens(target)``, the protocol's
optional method; ours count the targets that are not -100) gets each micro-batch's loss
multiplied by ``tokens * m * dp / tokens of the global batch``. The pipeline's mean over
micro-batches and replicas is then exactly the global batch's token mean, for the loss it reports
and for every gradient, whatever reduces them (the replicas' all-reduce, FSDP's reduce-scatter,
expert shards). The global count takes one integer all-reduce over the data-parallel group per
batch (none with one replica). Where all micro-batches count the same, the factor is exactly 1.
A micro-batch that counts no target at all (all padding) adds zero, where its own mean would be
NaN and stop the step under ``on_nonfinite="error"``.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist


class TokenWeights:
    """The current batch's token count over its replicas, read by the weighted loss at each call
    (cached engines keep the wrapped function)."""

    def __init__(self, count_tokens) -> None:
        self.count_tokens = count_tokens  # the module's pipeline_loss_tokens, or None
        self._numerator_scale = 0  # m * dp of the current batch
        self._total: torch.Tensor | None = None  # the global batch's token count (a tensor: no host sync)

    @classmethod
    def of(cls, module) -> "TokenWeights":
        fn = getattr(module, "pipeline_loss_tokens", None)
        return cls(fn if callable(fn) else None)

    @property
    def active(self) -> bool:
        return self.count_tokens is not None

    def begin(self, targets: torch.Tensor | None, microbatches: int, group, replicas: int) -> None:
        """Before a batch's schedule runs (every active rank of the batch's pipelines)."""
        self._total = None
        if not self.active or targets is None:
            return
        count = torch.as_tensor(self.count_tokens(targets), device=targets.device).detach()
        if count.numel() != 1 or count.is_complex():
            from ..protocol import PipelineProtocolError

            raise PipelineProtocolError(
                f"pipeline_loss_tokens(target) must return one number (how many terms pipeline_loss averages "
                f"over, e.g. `(target != -100).sum()`); it returned shape {list(count.shape)}")
        count = count.reshape(()).to(torch.int64)
        if replicas > 1:
            dist.all_reduce(count, group=group)
        self._total = count.to(torch.float64)
        self._numerator_scale = int(microbatches) * int(replicas)

    def weighted(self, loss_fn):
        """``loss_fn`` times this micro-batch's share of the global batch's tokens, times ``m * dp``
        (unchanged without a count, or where the global batch counts no token at all: NaN, as in
        one process)."""
        if not self.active:
            return loss_fn

        @functools.wraps(loss_fn)
        def fn(output, target):
            loss = loss_fn(output, target)
            total = self._total
            if total is None or not (isinstance(loss, torch.Tensor) and loss.is_floating_point()):
                return loss  # (a loss that is not a float tensor is left for the engine to name)
            total = total.to(loss.device)
            tokens = torch.as_tensor(self.count_tokens(target), device=loss.device).to(torch.float64)
            factor = tokens * self._numerator_scale / total.clamp_min(1)  # exactly 1.0 where all counts are equal
            # a micro-batch that counts no target (all padding) adds nothing, as in one process
            # (its own mean is 0/0 = NaN; its gradients are zeros either way)
            weighted = torch.where(tokens > 0, loss * factor.to(loss.dtype), torch.zeros_like(loss))
            return torch.where(total > 0, weighted, loss)

        return fn
