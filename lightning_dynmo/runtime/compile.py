"""``torch.compile`` of pipeline layers, one layer at a time (``DynMoStrategy(compile=True)``).

Each layer this rank owns is compiled in place with :meth:`torch.nn.Module.compile`, as
torchtitan compiles each transformer block: the layer object, its parameters and its state-dict
keys stay what they were (no ``_orig_mod`` prefix), so checkpoints, the optimizer layout and
migrations see the same module. Stages are built from these layers, so a partition change needs
no new compilation of the layers that stay. A layer that arrives by migration is a fresh module
(``nn.Module`` drops its compiled entry point when copied or pickled), so it is compiled on its
new rank at the next step; layers that stayed keep theirs. Activation checkpointing wraps the
compiled layer (the recompute calls the same compiled code).
"""
from __future__ import annotations

from collections.abc import Iterable

from torch import nn


def is_compiled(layer: nn.Module) -> bool:
    return getattr(layer, "_compiled_call_impl", None) is not None


def compile_local_layers(layers: nn.ModuleList, indices: Iterable[int], **options) -> list[int]:
    """Compile every layer of ``indices`` not compiled yet (``options`` go to ``torch.compile``);
    returns the indices compiled now."""
    done = []
    for i in indices:
        layer = layers[i]
        if not is_compiled(layer):
            layer.compile(**options)
            done.append(i)
    return done
