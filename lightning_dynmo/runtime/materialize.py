"""Meta-device initialisation: each rank materialises only the pipeline layers it owns.

Without it every rank builds the whole model and then drops the layers other ranks own, so setup
needs the memory of the full model on every rank. With it the model is built on the ``meta``
device (shapes and dtypes, no storage) and each rank allocates and initialises only its own layers:
setup memory follows the rank's share of the model.

**Opting in.** A LightningModule opts in with two things:

1. it is built on the meta device, the Lightning way (the same idiom as ``ModelParallelStrategy``)::

       with trainer.init_module(empty_init=True):   # DynMoStrategy: a torch.device("meta") context
           model = GPT(config, seed=0)

   (or plain ``with torch.device("meta"):``, or layers created in ``configure_model`` under either);
2. it implements :class:`~lightning_dynmo.protocol.InitializesPipelineLayers`::

       def init_pipeline_layer(self, index: int, layer: nn.Module) -> None

   which fills *every* parameter and buffer of pipeline layer ``index`` (already allocated on the
   CPU, with uninitialised memory) with exactly the values the same module gets when it is built
   on a real device. Two ways to make that hold: draw the values from a generator seeded by
   ``(seed, index)`` alone (:func:`~lightning_dynmo.protocol.layer_seed`; :class:`~lightning_dynmo.models.GPT` does this
   for its normal construction too, so a single-process model and a pipeline agree bit for bit),
   or read them from a checkpoint (:class:`~lightning_dynmo.models.hf.HFCausalLM` reads only the
   tensors of the layer from the safetensors files). Writing must be in place (``copy_``,
   ``normal_``, ``fill_``...); :func:`~lightning_dynmo.protocol.materialize_layer` checks, through each tensor's version
   counter, that every parameter and buffer was written, and names those that were not.

**Order in** ``DynMoStrategy.setup`` (every step works on meta tensors until the last):

1. ``configure_optimizers`` runs on the full (meta) model, and :class:`OptimizerLayout` records
   every parameter's optimizer, group and single-process position, exactly as for a real model;
2. the initial partition is computed from parameter counts (``numel`` works on meta tensors);
3. layers of other ranks become :class:`~lightning_dynmo.protocol.RemoteLayer` (never allocated);
4. :func:`materialize_pipeline` allocates and initialises this rank's layers. Like
   ``Module.to_empty`` it creates new ``Parameter`` objects, so the optimizers' groups are re-bound
   to them (their state is still empty: nothing has stepped) and the recorded layout, which is by
   name, stays valid;
5. the module moves to the device; a ``ckpt_path`` restore then overwrites the values as usual.

Tensors outside the pipeline layers (e.g. torchmetrics states) must be created on a real device;
whatever is still on the meta device after step 4 is named in a :class:`MaterializationError`.
Every rank runs the same checks on the same module, so a model that cannot be materialised fails
on every rank with the same message.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch
from torch import nn

from ..protocol.layer_init import MaterializationError, layer_tensors, materialize_layer
from .memory import local_nbytes

__all__ = [
    "MaterializeStats",
    "has_meta_tensors",
    "materialize_pipeline",
    "meta_init_context",
    "rebind_optimizers",
]


@contextmanager
def meta_init_context() -> Iterator[None]:
    """Create tensors on the meta device (what ``trainer.init_module(empty_init=True)`` gives
    under DynMoStrategy)."""
    with torch.device("meta"):
        yield


def has_meta_tensors(module: nn.Module) -> bool:
    """True when any parameter or buffer of ``module`` lives on the meta device."""
    return any(t.is_meta for _, t in layer_tensors(module))


def _meta_leftovers(module: nn.Module) -> list[str]:
    """Names of meta tensors anywhere in ``module``: parameters, buffers and torchmetrics states
    (metric states are plain attributes, which ``named_buffers`` does not list)."""
    names = [n for n, t in layer_tensors(module) if t.is_meta]
    for mod_name, m in module.named_modules():
        defaults = getattr(m, "_defaults", None)  # torchmetrics.Metric
        if isinstance(defaults, dict):
            for state in defaults:
                value = getattr(m, state, None)
                values = value if isinstance(value, list) else [value]
                if any(torch.is_tensor(v) and v.is_meta for v in values):
                    names.append(f"{mod_name}.{state}" if mod_name else state)
    return names


def rebind_optimizers(optimizers: Iterable[torch.optim.Optimizer], mapping: dict[nn.Parameter, nn.Parameter]) -> None:
    """Replace parameters in every optimizer group (and state, if any) following ``mapping``
    (``{old: new}``, keyed by identity); hyper-parameters and group order are kept."""
    if not mapping:
        return
    for opt in optimizers:
        opt = getattr(opt, "_optimizer", opt)
        for group in opt.param_groups:
            group["params"] = [mapping.get(p, p) for p in group["params"]]
        for p in [p for p in list(opt.state) if p in mapping]:
            opt.state[mapping[p]] = opt.state.pop(p)


@dataclass(frozen=True)
class MaterializeStats:
    layers: tuple[int, ...]  # global indices materialised on this rank
    bytes: int  # bytes of parameters and buffers allocated
    seconds: float


def materialize_pipeline(module: nn.Module, layers: nn.ModuleList, indices: Iterable[int],
                         optimizers: Iterable[torch.optim.Optimizer] = (),
                         device: torch.device | str = "cpu",
                         after_layer: Callable[[int], None] | None = None,
                         in_shards: Callable[[int], bool] | None = None) -> MaterializeStats | None:
    """Materialise this rank's pipeline layers ``indices`` of a module built on the meta device
    (the others must already be :class:`~lightning_dynmo.protocol.RemoteLayer`), re-bind the
    optimizers to the new parameters and check that nothing is left on the meta device.
    ``after_layer(i)`` runs as soon as layer ``i`` is materialised and its optimizer slots are
    re-bound, before the next layer is allocated: ``dp_sharding="fsdp"`` shards it there, so a
    stage's layers are never whole at once (the setup peak is one whole layer plus the shards).
    ``in_shards(i)`` comes first: where it returns True it has allocated and initialised only this
    rank's shards of layer ``i`` (``dp_sharding="fsdp"`` and a module that
    ``initializes_shards``), so no layer is ever whole. Returns ``None`` (and does nothing) for a
    module without meta tensors."""
    if not has_meta_tensors(module) and not _meta_leftovers(module):
        return None
    t0 = time.perf_counter()
    indices = tuple(indices)
    owner: dict[int, int] = {}
    for i in indices:
        for p in layers[i].parameters():
            if p.is_meta and owner.setdefault(id(p), i) != i:
                raise MaterializationError(
                    f"a meta parameter is shared by pipeline layers {owner[id(p)]} and {i} (tied weights); "
                    "materialising layers one by one would untie it. Build this model on a real device, or untie "
                    "the weights before building it on the meta device"
                )
    nbytes = 0
    for i in indices:
        layer = layers[i]
        if not has_meta_tensors(layer):
            continue
        if in_shards is not None and in_shards(i):
            layer = layers[i]
            nbytes += sum(local_nbytes(t) for _, t in layer_tensors(layer))
            continue
        rebind_optimizers(optimizers, materialize_layer(module, i, layer, device))
        nbytes += sum(t.numel() * t.element_size() for _, t in layer_tensors(layer))
        if after_layer is not None:
            after_layer(i)
    leftovers = _meta_leftovers(module)
    if leftovers:
        raise MaterializationError(
            f"{type(module).__name__} still has tensors on the meta device after its pipeline layers were "
            f"materialised: {leftovers[:8]}. Only pipeline layers are materialised per rank; create everything "
            "else (metrics, buffers outside pipeline_layers()) on a real device, e.g. under "
            "`with torch.device('cpu'):`"
        )
    return MaterializeStats(indices, nbytes, time.perf_counter() - t0)
