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


def check_local_layers_present(layers: nn.ModuleList, local: list[int], rank: int) -> None:
    """A layer this rank owns must be real: a placeholder here means the module lost it (e.g. a module
    whose layers were dropped under another partition), and the pipeline would hang on it."""
    missing = [i for i in local if isinstance(layers[i], RemoteLayer)]
    if missing:
        raise RuntimeError(
            f"rank {rank}: layers {missing} belong to this rank under the current partition but the module holds "
            "only placeholders for them (they were dropped under another partition). Pass the module that trained "
            "with this strategy, or a freshly built one, to later trainer stages."
        )


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
