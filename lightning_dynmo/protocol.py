"""The small contract between a LightningModule and the pipeline.

A module trains with ``DynMoStrategy`` when it defines

* ``pipeline_layers() -> nn.ModuleList``: the registered ModuleList (same object every call) of
  its ordered layers, embedding first and head last; each layer maps one tensor to the next;
* ``pipeline_loss(output, target) -> Tensor``: a scalar mean loss on the last layer's output.

Batches are ``(inputs, targets)``. The strategy replaces the layers a rank does not own with
:class:`RemoteLayer` placeholders, so the module must not keep other references to its layers.
"""
from __future__ import annotations

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

    def forward(self, *args, **kwargs):  # pragma: no cover - a bug if reached
        raise RuntimeError(
            f"layer {self.index} lives on pipeline rank {self.owner}, not on this rank; "
            "run the model through the DynMoStrategy pipeline instead of calling it directly"
        )

    def extra_repr(self) -> str:
        return f"index={self.index}, owner={self.owner}"


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
    layers = module.pipeline_layers()
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
    if module.pipeline_layers() is not layers:
        raise PipelineProtocolError(f"{name}.pipeline_layers() must return the same ModuleList on every call")
    if len(layers) == 0:
        raise PipelineProtocolError(f"{name}.pipeline_layers() returned an empty ModuleList")
    return layers


def layers_attribute_name(module: nn.Module, layers: nn.ModuleList) -> str:
    for child_name, child in module.named_children():
        if child is layers:
            return child_name
    raise PipelineProtocolError("pipeline layers are not a direct child of the module")


def split_batch(batch) -> tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise PipelineProtocolError(
            f"the 'dynmo' pipeline expects batches of (inputs, targets), got {type(batch).__name__}"
            + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
        )
    return batch[0], batch[1]
