"""Checkpoints in single-process format: any partition, rank count or schedule can load them.

Saving gathers replica 0's pipeline ranks onto global rank 0; loading lets every rank pick the
entries of the layers it holds (global layer indices in the keys, global parameter positions in
the optimizer state).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from lightning.fabric.utilities.optimizer import _optimizers_to_device

from ..runtime.optimizer_layout import OptimizerLayout

if TYPE_CHECKING:
    from .strategy import DynMoStrategy


def gather_to_zero(strategy: "DynMoStrategy", obj: Any) -> list[Any] | None:
    """Gather ``obj`` from replica 0's pipeline ranks onto global rank 0 (None elsewhere)."""
    if strategy.layout.dp_rank != 0 or strategy.layout.released:
        return None
    if strategy.layout.pp_size == 1:
        return [obj]
    out = [None] * strategy.layout.pp_size if strategy.global_rank == 0 else None
    dist.gather_object(obj, out, dst=0, group=strategy.replica_pipeline_groups[0])
    return out


def full_model_state_dict(strategy: "DynMoStrategy") -> dict[str, Any]:
    """The whole model's state dict on rank 0; empty elsewhere. Collective."""
    local = {k: v.detach().cpu() for k, v in strategy.lightning_module.state_dict().items()}
    parts = gather_to_zero(strategy, local)
    full: dict[str, Any] = {}
    for part in parts or []:
        full.update(part)
    return full


def full_optimizer_state(strategy: "DynMoStrategy", optimizer) -> dict[str, Any]:
    """``optimizer``'s state in single-process format on rank 0; empty elsewhere. Collective."""
    opt = getattr(optimizer, "_optimizer", optimizer)
    o = OptimizerLayout.index_of(strategy.optimizers, opt)
    layout = strategy.optimizer_layout
    states = layout.local_states(strategy.lightning_module, strategy.optimizers, o)
    parts = gather_to_zero(strategy, states)
    if not parts:
        return {}
    merged: dict[str, dict] = {}
    for part in parts:
        merged.update(part)
    return layout.global_state_dict(opt, o, merged)


def load_local_model_state(strategy: "DynMoStrategy", checkpoint: dict, strict: bool = True) -> None:
    """Load the entries of the layers this rank holds."""
    module = strategy.lightning_module
    own = module.state_dict()
    missing = [k for k in own if k not in checkpoint["state_dict"]]
    if missing and strict:
        raise KeyError(f"checkpoint lacks {len(missing)} entries this rank needs, e.g. {missing[:3]}")
    module.load_state_dict({k: v for k, v in checkpoint["state_dict"].items() if k in own}, strict=False)


def load_local_optimizer_state(strategy: "DynMoStrategy", checkpoint: dict) -> None:
    """Load the optimizer state of this rank's parameters from a single-process state dict."""
    states = checkpoint["optimizer_states"]
    optimizers = strategy.optimizers
    if len(states) != len(optimizers):
        raise ValueError(f"checkpoint has {len(states)} optimizers, the module configures {len(optimizers)}")
    for o, (opt, sd) in enumerate(zip(optimizers, states)):
        strategy.optimizer_layout.load_local(strategy.lightning_module, opt, o, sd)
    _optimizers_to_device(optimizers, strategy.root_device)
