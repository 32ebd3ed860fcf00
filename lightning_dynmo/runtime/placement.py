"""Which layers this rank holds: the others are swapped for :class:`RemoteLayer` placeholders."""
from __future__ import annotations

from torch import nn

from ..plan.layout import PipelineLayout
from ..protocol import RemoteLayer, ReportsLoad


def drop_remote_layers(layers: nn.ModuleList, layout: PipelineLayout) -> None:
    """Keep this rank's layers; replace the others with placeholders (their memory is freed)."""
    owner = layout.owners()
    for i in range(len(layers)):
        if owner[i] != layout.pp_rank and not isinstance(layers[i], RemoteLayer):
            layers[i] = RemoteLayer(i, owner=owner[i])


def collect_load_factors(layers: nn.ModuleList, indices: list[int]) -> dict[int, float]:
    """``{layer: load factor}`` of the local layers implementing ReportsLoad; starts a new window."""
    loads = {}
    for i in indices:
        layer = layers[i]
        if isinstance(layer, ReportsLoad):
            value = layer.load_factor()
            layer.reset_load()
            if value is not None:
                loads[i] = float(value)
    return loads
