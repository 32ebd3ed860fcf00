"""The small contract between a LightningModule and the pipeline.

A module trains with ``DynMoStrategy`` when it defines

* ``pipeline_layers() -> nn.ModuleList``: the registered ModuleList (same object every call) of
  its ordered layers, embedding first and head last; each layer maps a tensor, or a tuple of
  tensors of fixed arity, to the next (``protocol/activations.py``: called as ``layer(*tensors)``;
  tensors a layer's ``forward`` does not take pass through after its outputs);
* ``pipeline_loss(output, target) -> Tensor``: a scalar (0-dim) mean loss of one micro-batch on
  the last layer's output (checked at the first step: a non-scalar fails on every rank).

Batches are ``(inputs, targets)``. An optional ``pipeline_inputs(inputs, targets)`` returns what
enters the first layer (default: ``inputs``), e.g. ``(inputs, targets)`` for a head that computes
the loss inside the pipeline. An optional ``pipeline_loss_tokens(target)`` counts the terms
``pipeline_loss`` averages over (ours: the targets that are not -100); with it each micro-batch's
loss counts by its share of the batch's count, so batches with ignored targets (padding) train on
their token mean as in one process (``strategy/token_weights.py``). An optional ``checkpoint_merges()`` names parameters
the layers keep in pieces (``protocol/merges.py``) so checkpoints do not depend on the split. The strategy replaces the
layers a rank does not own with :class:`RemoteLayer` placeholders, so the module must not keep other references to
its layers. A parameter may be used by several layers (a tied embedding and LM head): every rank holding a
user keeps a copy and the owners sum its gradient each step (see ``runtime/tied.py``); a buffer
may not be shared.

Under the pipeline the module's ``training_step``/``validation_step``/``test_step`` are not called
(the strategy runs the schedule over ``pipeline_layers`` and ``pipeline_loss``). Two optional hooks
take their place for model-specific logging, both called on every rank with values that are the
same on every rank:

* ``on_pipeline_train_loss(loss, batch, batch_idx)`` after each training step (the step's loss);
* ``on_pipeline_eval_loss(stage, loss, tokens)`` for each validation (``"val"``) or test batch.

Metrics beyond the loss come from ``pipeline_eval_step(output, batch, batch_idx, stage)``, called
on the last stage's ranks with the last layer's output for the batch; its ``self.log`` calls and
torchmetrics reach every rank (``strategy/eval_metrics.py``).

Under ``trainer.predict`` the module's ``predict_step`` is not called either: a prediction is the
last layer's output, or what an optional ``pipeline_predict(output, batch, batch_idx)`` makes of
it on the last stage's rank (``strategy/predict.py``).

Two optional protocols connect the rest:

* :class:`ReportsLoad`: a pipeline layer whose work changes every step (MoE routing, MoD token
  choice, dynamic sparse attention, early exit) reports how much work its forwards did relative
  to full capacity. The strategy reads it every step at no profiling cost and scales the layer's
  profiled time by it (the paper's c_i = r_i t_i), so the balancer can decide every iteration.
* :class:`PipelineControl`: what callbacks may ask of a pipeline strategy: ``DynMoStrategy``'s
  ``trainer.strategy.pipeline``, or a strategy that implements it itself (checked with
  ``isinstance(..., PipelineControl)``; no duck-typing of private fields).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NoReturn, Protocol, runtime_checkable

import torch
from torch import nn


class PipelineProtocolError(TypeError):
    """The LightningModule does not expose what the pipeline needs."""


class RemoteLayer(nn.Module):
    """Stands in for a layer that lives on another pipeline rank; holds no tensors."""

    def __init__(self, index: int, owner: int | None = None) -> None:
        super().__init__()
        self.index = index
        self.owner = owner

    def forward(self, *args: Any, **kwargs: Any) -> NoReturn:  # pragma: no cover - a bug if reached
        raise RuntimeError(
            f"layer {self.index} lives on pipeline rank {self.owner}, not on this rank; "
            "run the model through the DynMoStrategy pipeline instead of calling it directly"
        )

    def extra_repr(self) -> str:
        return f"index={self.index}, owner={self.owner}"


@runtime_checkable
class ReportsLoad(Protocol):
    """A pipeline layer whose per-step work varies (see module docstring)."""

    def load_factor(self) -> float | None:
        """Mean relative work of the forwards since the last :meth:`reset_load` (1.0 = full
        capacity, e.g. every token through every expert slot; 0.5 = half the tokens), or
        ``None`` when the layer ran no forward since then."""

    def reset_load(self) -> None:
        """Start a new measurement window (the strategy calls it after every step)."""


@runtime_checkable
class PipelineControl(Protocol):
    """What dynamism callbacks may ask of a pipeline strategy."""

    pipeline_group: object  # process group of this rank's pipeline (None: the world)

    def local_layer_indices(self) -> list[int]:
        """Global indices of the layers this rank holds."""

    def request_rebalance(self, reason: str = "requested", reprofile: bool = True) -> None:
        """Rebalance soon (call on every rank): after profiling the next step, or, with
        ``reprofile=False`` (the layers' work changed but not what they compute), at the next
        step from the last profile scaled by the layers' load factors."""

    def request_repack(self, target: int | str = "auto") -> None:
        """Pack the pipeline onto fewer ranks after the next profiled step (call on every rank)."""

    def invalidate_pipeline(self) -> None:
        """Forget built stages and shape metadata (after layers change structure or grad-ness)."""


def pipeline_layers_of(module: nn.Module) -> nn.ModuleList:
    """Return the module's layer list, or raise a PipelineProtocolError saying what is missing."""
    name = type(module).__name__
    missing = [m for m in ("pipeline_layers", "pipeline_loss") if not callable(getattr(module, m, None))]
    if missing:
        raise PipelineProtocolError(
            f"{name} cannot run on the 'dynmo' pipeline: it does not define {' and '.join(missing)}(). "
            "Add `def pipeline_layers(self) -> nn.ModuleList` returning the ordered layers (embedding "
            "first, head last) and `def pipeline_loss(self, output, target) -> Tensor` (see "
            "lightning_dynmo.models.GPT for an example)."
        )
    layers: object = getattr(module, "pipeline_layers")()
    if not isinstance(layers, nn.ModuleList):
        raise PipelineProtocolError(
            f"{name}.pipeline_layers() must return an nn.ModuleList registered on the module, got "
            f"{type(layers).__name__}"
        )
    if not any(child is layers for child in module.children()):
        raise PipelineProtocolError(
            f"{name}.pipeline_layers() must return a ModuleList that is an attribute of the module "
            "(e.g. `self.layers`), so the strategy can place each layer on its pipeline rank"
        )
    again: object = getattr(module, "pipeline_layers")()
    if again is not layers:
        raise PipelineProtocolError(f"{name}.pipeline_layers() must return the same ModuleList on every call")
    if len(layers) == 0:
        raise PipelineProtocolError(f"{name}.pipeline_layers() returned an empty ModuleList")
    return layers


def layers_attribute_name(module: nn.Module, layers: nn.ModuleList) -> str:
    for child_name, child in module.named_children():
        if child is layers:
            return child_name
    raise PipelineProtocolError("pipeline layers are not a direct child of the module")


def split_batch(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        got = type(batch).__name__
        if isinstance(batch, (tuple, list)):
            got += f" of length {len(batch)}"
        elif isinstance(batch, Mapping):
            got += f" with keys {sorted(map(str, batch))}"
        raise PipelineProtocolError(
            f"the 'dynmo' pipeline expects batches of (inputs, targets), got {got}. Convert them in the "
            "LightningModule's (or DataModule's) on_before_batch_transfer, e.g. "
            "`return batch['input_ids'], batch['labels']`, or in the DataLoader's collate_fn")
    return batch[0], batch[1]


def state_dict_key(module: nn.Module, name: str) -> str:
    """The ``module.state_dict()`` key of the tensor ``named_parameters()`` calls ``name``: the
    module's optional ``state_dict_key(name)`` (a model whose state-dict hooks rename its layers,
    e.g. a GPT split into sublayers, which saves the block model's keys), else ``name``."""
    fn = getattr(module, "state_dict_key", None)
    return fn(name) if callable(fn) else name
