"""The one rule for what a layer holds on this rank through a training step: the bytes the
balancer's memory cap (``memory_capacity``, per stage), re-packing and
``activation_checkpointing="auto"`` all weigh, so that they agree on whether a stage fits.

* its parameters;
* a gradient for each trainable parameter, whether or not one exists at the moment of counting
  (``zero_grad`` frees them between steps, and the step holds them again);
* its optimizer state: what the optimizer holds, or, for a trainable parameter it has not stepped
  yet, the tensors its kind keeps per parameter (Adam's two moments; SGD's momentum buffer when
  it has momentum; :func:`state_tensors_per_param`), so the count does not change at the first
  step; 0-dim bookkeeping (Adam's step counter) is not counted. ``optimizers=None`` (not built
  yet) counts Adam's;
* its buffers (pruning masks, sparse structure, running statistics).

Under ``dp_sharding="fsdp"`` each DTensor counts its local shard, the bytes this rank holds.
Not counted: activations (``activation_checkpointing`` measures them per micro-batch shape) and
the transient all-gathered parameters of a sharded layer's forward and backward.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

#: state tensors per parameter of an optimizer whose kind is not known here: Adam's two moments
DEFAULT_STATE_TENSORS = 2


def local_nbytes(t: torch.Tensor) -> int:
    """Bytes of ``t`` on this rank (a DTensor: its local shard)."""
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


#: per-parameter state tensors of torch's optimizers with few or no options that change it
_STATE_TENSORS = {"Adagrad": 1, "Adadelta": 2, "Adamax": 2, "ASGD": 1, "NAdam": 2, "RAdam": 2, "Rprop": 2}


def state_tensors_per_param(optimizer: torch.optim.Optimizer, group: dict) -> int:
    """Parameter-sized state tensors ``optimizer`` keeps for each parameter of ``group`` once it
    has stepped (torch's optimizers; another kind counts as Adam)."""
    kind = type(optimizer).__name__
    if kind in ("Adam", "AdamW"):
        return 3 if group.get("amsgrad") else 2
    if kind == "SGD":
        return 1 if group.get("momentum", 0) else 0
    if kind == "RMSprop":
        return 1 + bool(group.get("momentum", 0)) + bool(group.get("centered"))
    return _STATE_TENSORS.get(kind, DEFAULT_STATE_TENSORS)


def layer_state_bytes(layer: nn.Module, optimizers: Iterable | None = None) -> int:
    """The bytes ``layer`` holds on this rank through a training step (see the module docstring).
    ``optimizers``: those that hold its parameters (``()``: none, e.g. evaluation; ``None``: not
    built yet, counted as Adam)."""
    params = list(layer.parameters())
    ids = {id(p) for p in params}
    state: dict[int, dict] = {}
    expected: dict[int, int] = {}
    for opt in optimizers if optimizers is not None else ():
        opt = getattr(opt, "_optimizer", opt)  # (Lightning's LightningOptimizer wraps it)
        for group in opt.param_groups:
            k = state_tensors_per_param(opt, group)
            expected.update((id(p), k) for p in group["params"] if id(p) in ids)
        state.update((id(p), st) for p, st in opt.state.items() if id(p) in ids)
    total = sum(local_nbytes(b) for b in layer.buffers())
    for p in params:
        nbytes = local_nbytes(p)
        held = state.get(id(p))
        total += nbytes
        if held:  # (a frozen parameter may still hold the state it trained with; not 0-dim step counters)
            total += sum(local_nbytes(v) for v in held.values() if torch.is_tensor(v) and v.dim() > 0)
        if not p.requires_grad:
            continue
        total += nbytes  # its gradient
        if not held:
            total += (DEFAULT_STATE_TENSORS if optimizers is None else expected.get(id(p), 0)) * nbytes
    return total
