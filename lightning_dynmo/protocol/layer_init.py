"""How one pipeline layer gets real values: the contract behind meta-device initialisation.

A model built on the meta device fills each pipeline layer on demand
(:class:`InitializesPipelineLayers`); :func:`materialize_layer` allocates one layer and checks that
the model wrote every tensor. Models use it for their own single-process build, and the runtime
for the layers a rank owns (``runtime/materialize.py``, which documents the whole procedure), so
it lives here, where both import it.
"""
from __future__ import annotations

from typing import Iterable, Protocol, runtime_checkable

import torch
from torch import nn

__all__ = ["InitializesPipelineLayers", "MaterializationError", "initialise_layer", "layer_seed", "layer_tensors",
           "materialize_layer"]


class MaterializationError(RuntimeError):
    """A module built on the meta device cannot be turned into real tensors."""


@runtime_checkable
class InitializesPipelineLayers(Protocol):
    """A LightningModule that can initialise one pipeline layer on its own (see module docstring)."""

    def init_pipeline_layer(self, index: int, layer: nn.Module) -> None:
        """Fill every parameter and buffer of pipeline layer ``index`` in place with the values
        a single-process construction gives it.

        A module whose ``initializes_shards`` is true also fills a layer whose parameters are
        ``Shard(0)`` DTensors (FSDP2 units, ``dp_sharding="fsdp"``) with its shards' rows of those
        values: the runtime then allocates only this rank's shards (:mod:`.row_draws` draws the
        rows of a seeded draw without the whole tensor)."""


def layer_seed(seed: int, index: int) -> int:
    """A 63-bit seed for pipeline layer ``index`` of a model seeded with ``seed``: a SplitMix64
    finaliser of both, so neighbouring seeds and layers get unrelated streams."""
    z = (int(seed) * 0x9E3779B97F4A7C15 + (int(index) + 1) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


def layer_tensors(module: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def materialize_layer(module: nn.Module, index: int, layer: nn.Module,
                      device: torch.device | str = "cpu") -> dict[nn.Parameter, nn.Parameter]:
    """Allocate pipeline layer ``index`` of ``module`` on ``device`` and let the module initialise
    it (``module.init_pipeline_layer(index, layer)``). Returns ``{old meta parameter: new
    parameter}`` for re-binding optimizers. Raises :class:`MaterializationError` when the module
    cannot initialise layers or leaves a tensor of the layer unwritten."""
    init = getattr(module, "init_pipeline_layer", None)
    if not callable(init):
        raise MaterializationError(
            f"{type(module).__name__} was built on the meta device but does not define "
            "init_pipeline_layer(index, layer), so DynMoStrategy cannot initialise the layers this rank owns. "
            "Implement it (fill every parameter and buffer of the layer with the values a single-process "
            "construction gives it; see lightning_dynmo.runtime.materialize), or build the model on a real "
            "device (without trainer.init_module(empty_init=True) / torch.device('meta'))"
        )
    mapping, fresh = _allocate_meta_tensors(layer, torch.device(device))
    initialise_layer(module, index, layer, fresh)
    return mapping


def _versions(t: torch.Tensor) -> tuple[int, int]:
    """Version counters that record writes to ``t``'s values: its own (a DTensor's bumps for
    DTensor ops) and its storage's (a DTensor's local shard, written directly)."""
    to_local = getattr(t, "to_local", None)
    return t._version, (to_local() if callable(to_local) else t)._version


def initialise_layer(module: nn.Module, index: int, layer: nn.Module, fresh: Iterable[torch.Tensor]) -> None:
    """Let ``module`` fill pipeline layer ``index`` (``init_pipeline_layer``), whose ``fresh``
    tensors were just allocated (uninitialised; a DTensor's local shard counts), then each
    sub-module with ``init_own_buffers()`` fill the buffers it derives itself (what a layer added
    by a callback on the meta device holds, e.g. a pruning mask), and check that every tensor with
    elements was written. Raises :class:`MaterializationError` naming those that were not."""
    init = getattr(module, "init_pipeline_layer")
    versions = {id(t): _versions(t) for t in fresh}
    with torch.no_grad():
        init(index, layer)
        for m in layer.modules():  # buffers a sub-module derives itself (a pruning mask starts all-kept)
            own = getattr(m, "init_own_buffers", None)
            if callable(own):
                own()
    missed = [name for name, t in layer_tensors(layer)
              if t.is_meta or (versions.get(id(t)) == _versions(t) and t.numel() > 0)]
    if missed:
        raise MaterializationError(
            f"{type(module).__name__}.init_pipeline_layer({index}, ...) left {len(missed)} tensor(s) of layer {index} "
            f"({type(layer).__name__}) uninitialised: {missed[:8]}. It must write every parameter and buffer of the "
            "layer in place (copy_, normal_, fill_, ...); until it does, build this model on a real device"
        )


def _allocate_meta_tensors(layer: nn.Module, device: torch.device) -> tuple[dict[nn.Parameter, nn.Parameter],
                                                                            list[torch.Tensor]]:
    """Replace every meta parameter and buffer of ``layer`` by uninitialised storage on ``device``
    (what ``Module.to_empty`` does, but tensors already real keep their values). A tensor used
    under several names is allocated once. Returns ``{old parameter: new}`` and the new tensors."""
    memo: dict[int, torch.Tensor] = {}
    mapping: dict[nn.Parameter, nn.Parameter] = {}
    for m in layer.modules():
        for name, p in list(m._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in memo:
                mapping[p] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                memo[id(p)] = mapping[p]
            m._parameters[name] = mapping[p]
        for name, b in list(m._buffers.items()):
            if b is None or not b.is_meta:
                continue
            if id(b) not in memo:
                memo[id(b)] = torch.empty_like(b, device=device)
            m._buffers[name] = memo[id(b)]
    return mapping, list(memo.values())
