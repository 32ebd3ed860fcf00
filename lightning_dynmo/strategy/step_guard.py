"""What every training step checks before its pipeline runs, in one small all-reduce over the
pipeline group (MIN of ``[v, -v]``: each entry's minimum and maximum over the ranks):

* **the same batch on every pipeline rank.** Stage 0 trains on its rank's inputs and the last
  stage's loss uses its rank's targets; if the ranks loaded different batches the step is silently
  wrong. A loader that is seeded once can still drift: a dataset that draws from the global RNG
  (augmentation) gets other draws on each rank after the first step, because the ranks' global
  RNGs advance differently (dropout runs only where its layer lives). A position-weighted digest of
  inputs and targets (a permutation changes it) must agree on every rank, every step, or every rank
  stops before the step runs, naming the fix.
* **unchanged grad-ness.** Stages are built from a shape/grad table (``runtime/tensor_specs.py``); a
  user who freezes or unfreezes layers mid-run (``requires_grad_``, as Lightning's
  ``BaseFinetuning`` does) makes it stale, and a stage would wait for a gradient that never comes.
  Any rank that sees a layer whose grad-ness differs from the table makes every rank rebuild its
  stages (as ``LayerFreezing`` does through ``invalidate_pipeline``), so the step trains like one
  process.
* **stages rebuilt together.** ``invalidate_pipeline`` is local: a callback that changes only
  its own rank's layers (``GradualPruning`` compressing a layer's storage) drops only that rank's
  shape table, and rediscovering it alone sends shape objects where the neighbours send
  activations (gloo aborts: "Received data size doesn't match expected size"; seen at 8 stages).
  A rank without a table counts as stale, so every rank rebuilds in the same step.
* **one evaluation of the closure per optimizer step.** A training step is one pipeline schedule
  over the batch, with its collectives, profiling and rebalancing; an optimizer that calls the
  closure again (``LBFGS``'s line search, sharpness-aware minimisation) would start a second step
  in the middle of the first's bookkeeping and train on another rule than one process. ``LBFGS``
  is refused at setup; any other optimizer's second call raises on every rank (all run the same
  optimizer code, so all reach it together).
* **unchanged optimizer groups.** The strategy records every parameter's optimizer slot at setup
  (migration, checkpoints); a param group added later (``BaseFinetuning.unfreeze_and_add_param_group``)
  is refused on every rank, naming the fix.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..runtime.tensor_specs import first_stage_inputs, output_requires_grad
from .collectives import explain_timeout


class PipelineBatchMismatchError(RuntimeError):
    """The ranks of one pipeline loaded different batches for the same step."""


class OptimizerGroupsChangedError(RuntimeError):
    """An optimizer gained or lost param groups after setup."""


class ClosureReevaluatedError(RuntimeError):
    """An optimizer called the training closure more than once in one step."""


_ONE_EVALUATION = ("under DynMoStrategy the closure is one pipeline step over the batch (a schedule with collectives, "
                   "profiling and rebalancing) and runs once per optimizer step; use an optimizer that evaluates it "
                   "once (AdamW, SGD, Adafactor, Muon, ...)")


def check_closure_optimizers(optimizers, rank: int) -> None:
    """At setup: refuse the optimizers known to evaluate the closure several times per step."""
    for opt in optimizers:
        inner = getattr(opt, "_optimizer", opt)
        if isinstance(inner, torch.optim.LBFGS):
            raise ValueError(f"rank {rank}: torch.optim.LBFGS evaluates the training closure (a forward and backward "
                             f"of the whole batch) several times per step; {_ONE_EVALUATION}")


def evaluated_once(closure, optimizer, rank: int, step: int):
    """``closure`` for one optimizer step, raising :class:`ClosureReevaluatedError` if called again."""
    calls = 0

    def once(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls > 1:
            name = type(getattr(optimizer, "_optimizer", optimizer)).__name__
            raise ClosureReevaluatedError(f"rank {rank}: {name}.step called the training closure twice in step {step}; "
                                          f"{_ONE_EVALUATION}")
        return closure(*args, **kwargs)

    return once


def waiting_hint(rank: int, step: int) -> str:
    """What a timeout in a step's collectives most likely means (see ``explain_timeout``)."""
    return (f"rank {rank} waited for the other ranks in step {step}: a rank stopped, or is inside a call that every "
            "rank must make and only some made (trainer.save_checkpoint, strategy.pipeline.rebalance_to / repack_to / "
            "gather_layer_costs)")


def batch_digest(t: torch.Tensor) -> float:
    """Sum of the values weighted by position (so reordering samples changes it), in float64."""
    flat = t.detach().reshape(-1).double()
    weights = torch.arange(flat.numel(), dtype=torch.float64, device=flat.device).remainder_(9973).add_(1)
    return float((flat * weights).sum())


def stale_gradness(layers, local: list[int], specs, first_arity: int = 1) -> bool:
    """Whether a local layer's output grad-ness differs from the stage table ``specs`` (one spec
    per tensor a layer returns; the rule of ``discover_layer_specs``, ``output_requires_grad``).
    ``first_arity``: how many tensors enter the first layer (none of them needs a gradient)."""
    if specs is None:
        return False
    for i in local:
        in_rg = tuple(sp.requires_grad for sp in specs[i - 1]) if i > 0 else (False,) * first_arity
        expected = output_requires_grad(layers[i], in_rg, tuple(sp.dtype.is_floating_point for sp in specs[i]))
        if expected != tuple(sp.requires_grad for sp in specs[i]):
            return True
    return False


def _groups_changed(optimizers, layout) -> bool:
    if layout is None:
        return False
    return [len(getattr(o, "_optimizer", o).param_groups) for o in optimizers] != [len(g) for g in layout.group_indices]


def check_before_run(strategy, inputs: torch.Tensor, targets: torch.Tensor, step: int) -> None:
    """Collective over the pipeline group (only ranks in the pipeline call it). Raises on every
    rank, or rebuilds every rank's stages, as the module docstring says."""
    s = strategy
    inputs_fn = getattr(s.lightning_module, "pipeline_inputs", None)
    first = first_stage_inputs(inputs, targets, inputs_fn if callable(inputs_fn) else None)
    specs = s.engines.layer_specs()
    stale = specs is None or stale_gradness(s.layers, s.local_layer_indices(), specs, len(first))
    groups = _groups_changed(s.optimizers, s.optimizer_layout)
    v = torch.tensor([batch_digest(inputs), batch_digest(targets), float(inputs.numel()), float(stale), float(groups)],
                     dtype=torch.float64, device=s.root_device)
    if s.layout.pp_size > 1:
        both = torch.cat([v, -v])
        with explain_timeout(waiting_hint(s.global_rank, step)):
            dist.all_reduce(both, op=dist.ReduceOp.MIN, group=s.pipeline_group)
        lo, hi = both[:5], -both[5:]
    else:
        lo = hi = v
    if hi[4] > 0:
        raise OptimizerGroupsChangedError(
            f"rank {s.global_rank}: an optimizer's param groups changed after setup (e.g. "
            "BaseFinetuning.unfreeze_and_add_param_group); DynMoStrategy records every parameter's optimizer slot "
            "at setup. Put every parameter in configure_optimizers (frozen ones too: torch skips parameters "
            "without gradients) and unfreeze with requires_grad_(True) only"
        )
    if not torch.equal(lo[:3], hi[:3]):
        raise PipelineBatchMismatchError(
            f"rank {s.global_rank}: the ranks of one pipeline received different batches (step {step}). Every "
            "pipeline rank must load the same batch: use a sampler with a fixed seed (Lightning's DistributedSampler, "
            "which the Trainer injects by default, or `DataLoader(..., generator=torch.Generator().manual_seed(s))`); "
            "a dataset that draws random numbers from the global RNG (augmentation) gets other draws on each rank "
            "once dropout has run on some ranks only: give it its own generator, e.g. "
            "`torch.Generator().manual_seed(seed * len(self) + index)` per sample. An IterableDataset (a "
            "stream) must shard by data-parallel replica, not by global rank: every rank of one pipeline reads "
            "the same shard; `trainer.strategy.distributed_sampler_kwargs` gives `num_replicas` and `rank` (e.g. "
            "`split_dataset_by_node(ds, rank=kw['rank'], world_size=kw['num_replicas'])`)"
        )
    if hi[3] > 0:
        s.invalidate_pipeline()  # every rank: the next engine rediscovers the table (collective)
