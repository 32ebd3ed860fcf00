"""What a layer may ask of the pipeline runtime while it runs, without importing the runtime.

Models stay free of ``runtime/`` (a layer must also run in a plain single process); the few
run-time facts a layer needs come through here, and the runtime provides them:

* **recompute**: :func:`is_recomputing` is True while activation checkpointing re-runs a layer's
  forward during backward (``runtime/recompute.py`` enters :class:`Recomputing`), so per-step
  counters (MoD's routed tokens, the profiler's times) count a micro-batch once;
* **expert parallelism**: a sharded expert module (:class:`ShardsExperts`, holding its
  :class:`ExpertShard`) hands its tokens to :func:`expert_dispatch`, the process's
  :class:`DispatchesExperts` that ``runtime/expert_parallel.py`` installs with
  :func:`set_expert_dispatch` (all-to-all to the replicas that own the other experts);
* **loss scaling**: :func:`grad_scaler` is the enabled grad scaler of a precision plugin, the one
  the pipeline multiplies the main loss by (auxiliary losses follow it, ``models/_aux_loss.py``).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

__all__ = [
    "DispatchesExperts",
    "ExpertShard",
    "Recomputing",
    "ShardsExperts",
    "expert_dispatch",
    "grad_scaler",
    "is_recomputing",
    "set_expert_dispatch",
]

# ---------------------------------------------------------------- recompute
_recompute = threading.local()


def is_recomputing() -> bool:
    """True while a checkpointed layer's forward is being recomputed during backward (on the
    thread running that backward)."""
    return getattr(_recompute, "depth", 0) > 0


class Recomputing:
    """Marks a recompute (re-enterable: a zero-bubble schedule's weight pass may recompute a
    layer a second time with the same context)."""

    def __enter__(self) -> None:
        _recompute.depth = getattr(_recompute, "depth", 0) + 1

    def __exit__(self, *exc: object) -> None:
        _recompute.depth -= 1


# ---------------------------------------------------------------- expert parallelism
@dataclass(frozen=True)
class ExpertShard:
    """Shard ``rank`` of ``size``: the ``rank``-th of ``size`` equal slices of the experts (dim 0)."""

    rank: int
    size: int

    def take(self, full: Tensor) -> Tensor:
        """This shard's rows of a whole ``[num_experts, ...]`` tensor (a view)."""
        n = full.shape[0] // self.size
        return full.narrow(0, self.rank * n, n)


@runtime_checkable
class ShardsExperts(Protocol):
    """A module whose parameters stack ``num_experts`` experts along dim 0 and that can keep only
    a shard of them (:class:`~lightning_dynmo.models.moe.GroupedExperts`).

    ``shard_experts(shard)`` replaces each stacked parameter by its shard (new ``Parameter``
    objects) and returns ``[(name, old, new)]``; a module already holding ``shard`` returns ``[]``.
    While ``expert_shard`` is set, its forward takes tokens sorted by *global* expert with
    ``[num_experts]`` counts and dispatches them through :func:`expert_dispatch`."""

    num_experts: int
    expert_shard: ExpertShard | None

    def shard_experts(self, shard: ExpertShard) -> list[tuple[str, nn.Parameter, nn.Parameter]]: ...


class DispatchesExperts(Protocol):
    """The process's expert-parallel group, as a sharded expert layer sees it."""

    def dispatch(self, local: Callable[[Tensor, Tensor], Tensor], x: Tensor,
                 counts: Tensor) -> tuple[Tensor, Tensor]:
        """Run ``local(tokens, local_counts)`` on this rank's experts for tokens ``x`` sorted by
        global expert (``counts [E]`` rows each), exchanging them with the other shards' owners;
        returns ``x``'s rows' outputs in ``x``'s order and the rows each shard received."""


_EXPERT_DISPATCH: DispatchesExperts | None = None


def set_expert_dispatch(dispatcher: DispatchesExperts | None) -> None:
    """Install (or, with ``None``, remove) the process's expert-parallel dispatcher."""
    global _EXPERT_DISPATCH
    _EXPERT_DISPATCH = dispatcher


def expert_dispatch() -> DispatchesExperts:
    """The process's expert-parallel dispatcher (sharded expert layers need one to run)."""
    if _EXPERT_DISPATCH is None:
        raise RuntimeError(
            "an expert layer holds a shard of its experts, but this process has no expert-parallel group; "
            "sharded layers run only under DynMoStrategy(expert_parallel=...)"
        )
    return _EXPERT_DISPATCH


# ---------------------------------------------------------------- loss scaling
def grad_scaler(plugin: object) -> torch.amp.GradScaler | None:
    """The plugin's enabled grad scaler, if it has one."""
    scaler = getattr(plugin, "scaler", None)
    return scaler if scaler is not None and scaler.is_enabled() else None
