"""Model-side dynamism mechanisms (the callbacks in :mod:`lightning_dynmo.callbacks` decide when).

* :mod:`.pruning`: ``global_magnitude_threshold`` (exact k-th |w| over pipeline ranks without
  gathering weights), the Zhu & Gupta cubic schedule, ``PrunableLinear`` (mask buffer, optional
  sparse kernel).
* :mod:`.early_exit`: ``EarlyExitGPT`` whose blocks compute only on still-active tokens.
* :mod:`.freezing`: freezing a layer for real (no grad, optimizer state freed).
"""
from ..models.early_exit import EarlyExitGPT, ExitBlock, ExitEmbedding, ExitFinalNorm, active_mask_of
from .freezing import freeze_layer, is_frozen, layer_grad_norm
from .pruning import (
    PrunableLinear,
    cubic_sparsity,
    global_magnitude_threshold,
    make_prunable,
    prunable_modules,
    sparse_kernels_available,
)

__all__ = [
    "EarlyExitGPT",
    "ExitBlock",
    "ExitEmbedding",
    "ExitFinalNorm",
    "active_mask_of",
    "freeze_layer",
    "is_frozen",
    "layer_grad_norm",
    "PrunableLinear",
    "cubic_sparsity",
    "global_magnitude_threshold",
    "make_prunable",
    "prunable_modules",
    "sparse_kernels_available",
]
