"""Per-layer activation recomputation ("activation checkpointing") for pipeline stages; not to be
confused with model checkpoints (``strategy/checkpoint.py``).

``DynMoStrategy(activation_checkpointing=...)``:

* ``False`` (default): every layer keeps the tensors its backward needs for each micro-batch in
  flight (1F1B: up to ``p - stage`` micro-batches, GPipe: all ``m``).
* ``True``: every layer of every stage runs under ``torch.utils.checkpoint`` (non-reentrant): its
  forward keeps only its input; backward recomputes the forward first. Compute grows by one
  forward per layer; activation memory in flight drops to the layers' inputs.
* ``"auto"``: each rank picks, per local stage, the layers to recompute so that the stage fits
  ``memory_capacity`` (:func:`lightning_dynmo.plan.cost_model.choose_recompute`: the layers that
  free the most activation bytes per second of extra forward first), and recomputes nothing in
  a stage that already fits. Needs ``memory_capacity``.

The wrapping happens when the engine builds a stage (:class:`CheckpointedLayer` around the
layer, in the stage's ``nn.Sequential`` only): the module, its parameter names, checkpoints and
migration never see it. Recomputation is exact: the recomputed forward replays the RNG state of
the original (dropout masks match), so losses and gradients equal those without checkpointing.

What a layer must satisfy: its forward is a function of its input, parameters and buffers
(torch's own requirement). A forward that *changes* a buffer (e.g. a step counter) would be
recomputed from a different state; :class:`CheckpointedLayer` checks the buffers' version
counters and raises a clear error instead of computing wrong gradients. Python-side counters
(load factors, routing statistics) see the recomputed forward unless the layer asks
:func:`~lightning_dynmo.protocol.is_recomputing` (the profiler does, so per-layer times stay per micro-batch: a layer's
recompute is part of its measured backward).

For ``"auto"`` the runtime measures, once per micro-batch shape and layer, the bytes autograd
keeps for that layer's backward (:func:`saved_activation_bytes`: a forward of one real
micro-batch in eval mode with saved-tensor hooks, RNG and buffers restored afterwards) and the
bytes of its parameters, gradients and optimizer state (the one memory rule,
:func:`~lightning_dynmo.runtime.memory.layer_state_bytes`).
"""
from __future__ import annotations

import contextlib
import math
import warnings
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..plan.cost_model import CostModel, LayerCosts, choose_recompute
from ..plan.partition import Partition
from ..protocol.activations import as_acts, buffers_kept, call_layer
from ..protocol.services import Recomputing

__all__ = [
    "ActivationCheckpointing",
    "CheckpointedLayer",
    "check_activation_checkpointing",
    "saved_activation_bytes",
]

def check_activation_checkpointing(mode, memory_capacity) -> bool | str:
    """Validate the option (``True``, ``False`` or ``"auto"``; ``"auto"`` needs a capacity)."""
    if isinstance(mode, str):  # from a config file or the command line
        mode = {"true": True, "false": False}.get(mode.lower(), mode.lower())
    if not (mode is True or mode is False or mode == "auto"):
        raise ValueError(f"activation_checkpointing must be True, False or 'auto', got {mode!r}")
    if mode == "auto" and memory_capacity is None:
        raise ValueError(
            "activation_checkpointing='auto' recomputes layers of stages that would exceed memory_capacity; "
            "set memory_capacity (bytes per stage), or use activation_checkpointing=True to recompute every layer"
        )
    return mode


def _contexts():
    return contextlib.nullcontext(), Recomputing()


class CheckpointedLayer(nn.Module):
    """Runs pipeline layer ``index`` under non-reentrant ``torch.utils.checkpoint`` when grad is
    enabled (and plainly otherwise)."""

    def __init__(self, layer: nn.Module, index: int) -> None:
        super().__init__()
        self.layer = layer
        self.index = index

    def forward(self, *xs: torch.Tensor):
        if not torch.is_grad_enabled():
            return self.layer(*xs)
        before = [b._version for b in self.layer.buffers()]
        out = checkpoint(self.layer, *xs, use_reentrant=False, context_fn=_contexts, preserve_rng_state=True)
        after = [b._version for b in self.layer.buffers()]
        if after != before:
            names = [n for (n, _), v0, v1 in zip(self.layer.named_buffers(), before, after) if v0 != v1]
            raise RuntimeError(
                f"activation checkpointing: pipeline layer {self.index} ({type(self.layer).__name__}) changes its "
                f"buffers {names} in forward, so recomputing it in backward would not reproduce that forward. "
                "Train this model with activation_checkpointing=False"
            )
        return out

    def extra_repr(self) -> str:
        return f"index={self.index}"


def saved_activation_bytes(layer: nn.Module, example) -> int:
    """Bytes autograd keeps for ``layer``'s backward after a forward on ``example`` (one
    micro-batch: a tensor or a tuple of tensors), not counting its parameters, buffers and the
    input itself (distinct storages). Runs in eval mode (no dropout masks, no load counters)
    with the RNG and buffers restored."""
    example = as_acts(example)
    exclude = {t.untyped_storage().data_ptr() for t in (*layer.parameters(), *layer.buffers(), *example)}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr and ptr not in exclude:
            seen[ptr] = storage.nbytes()
        return t

    was_training = layer.training
    devices = [example[0].device] if example[0].device.type == "cuda" else []
    try:
        layer.eval()
        with buffers_kept([layer]), torch.random.fork_rng(devices=devices), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = call_layer(layer, example)
        del out
    finally:
        layer.train(was_training)
    return sum(seen.values())


class ActivationCheckpointing:
    """Which local layers a stage recomputes (see the module docstring).

    ``state_bytes(i)``: bytes of layer ``i``'s parameters, gradients and optimizer state;
    ``forward_seconds()``: last profiled ``{layer: seconds per micro-batch}`` (the rebalancer's
    :class:`~lightning_dynmo.plan.measurements.KnownWork`; a layer without a profile counts its
    parameter count as its cost, which orders transformer layers alike).
    """

    def __init__(self, mode: bool | str, capacity: float | None, state_bytes: Callable[[int], float],
                 forward_seconds: Callable[[], dict[int, float]] = dict) -> None:
        self.mode = check_activation_checkpointing(mode, capacity)
        self.capacity = capacity
        self.state_bytes = state_bytes
        self.forward_seconds = forward_seconds
        self.saved_bytes: dict[tuple, dict[int, float]] = {}  # by micro-batch shape: layer -> bytes
        self.decisions: dict[int, frozenset[int]] = {}  # last decision per local stage
        self._warned: set[int] = set()

    @property
    def enabled(self) -> bool:
        return self.mode is not False

    def layers_to_recompute(self, layers: nn.ModuleList, partition: Partition, spec, pp_rank: int, pp_size: int,
                            layer_specs: list, microbatch_input, microbatches: int) -> frozenset[int]:
        """Global indices of this rank's layers to run under checkpointing."""
        stages = spec.stages_of_rank(pp_rank, pp_size, partition.num_stages // pp_size)
        local = [i for s in stages for i in partition.layers_of(s)]
        if self.mode is True:
            self.decisions = {s: frozenset(partition.layers_of(s)) for s in stages}
            return frozenset(local)
        if self.mode is False:
            return frozenset()
        first = as_acts(microbatch_input)
        key = tuple((tuple(t.shape), t.dtype) for t in first)
        measured = self.saved_bytes.setdefault(key, {})
        for s in stages:
            for i in partition.layers_of(s):
                if i not in measured:
                    example = self._example(i, first, layer_specs)
                    measured[i] = float(saved_activation_bytes(layers[i], example))
        known = self.forward_seconds() or {}
        n = len(layers)
        forward = [0.0] * n
        memory = [0.0] * n
        activation = [0.0] * n
        for i in local:
            t = known.get(i)
            forward[i] = float(t) if t is not None and math.isfinite(t) and t > 0 else \
                float(sum(p.numel() for p in layers[i].parameters()) or 1)
            memory[i] = self.state_bytes(i)
            activation[i] = measured[i]
        costs = LayerCosts(tuple(forward), tuple(2.0 * f for f in forward), tuple(0 for _ in range(n)),
                           tuple(memory), tuple(activation))
        model = CostModel(microbatches=microbatches, schedule=spec.cost_schedule, capacity=self.capacity,
                          virtual_stages=partition.num_stages // pp_size)
        chosen = choose_recompute(costs, model, partition, stages)
        self.decisions = {s: frozenset(i for i in partition.layers_of(s) if i in chosen) for s in stages}
        fitted = model.with_recompute(chosen)
        for s in stages:
            rng = partition.layers_of(s)
            need = fitted.segment_memory(costs, rng.start, rng.stop, s, partition.num_stages)
            if not fitted.fits(need) and s not in self._warned:
                self._warned.add(s)
                warnings.warn(
                    f"dynmo: stage {s} needs {need / 2**20:.1f} MiB even with every layer recomputed "
                    f"(memory_capacity {self.capacity / 2**20:.1f} MiB); it recomputes all its layers",
                    stacklevel=2,
                )
        return chosen

    @staticmethod
    def _example(i: int, first: tuple, layer_specs: list) -> tuple:
        if i == 0:
            return first
        device = first[0].device
        gen = torch.Generator().manual_seed(i)  # its own: measuring must not move the training's RNG

        def one(spec) -> torch.Tensor:
            if not spec.dtype.is_floating_point:
                return torch.zeros(spec.shape, dtype=spec.dtype, device=device)
            x = torch.randn(spec.shape, dtype=torch.float32, generator=gen)
            return x.to(device=device, dtype=spec.dtype).requires_grad_(spec.requires_grad)

        return tuple(one(sp) for sp in layer_specs[i - 1])
