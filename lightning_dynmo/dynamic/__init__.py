"""Dynamism mechanisms that transform an existing model's layers (the callbacks in
:mod:`lightning_dynmo.callbacks` decide when; mechanisms that are architectures -- MoE, MoD,
early exit -- live in :mod:`lightning_dynmo.models`, see "Where dynamism lives" in docs/architecture.md).

* :mod:`.pruning` (with :mod:`.pruning_threshold`): ``global_magnitude_threshold`` (exact k-th
  |w| over pipeline ranks without gathering weights), the Zhu & Gupta cubic schedule,
  ``PrunableLinear`` (dense storage with a mask buffer, or CSR storage whose master weight is the
  kept values; optional CSR kernel or 2:4 semi-structured route), ``ParamSwap`` (a storage change for the optimizer
  re-map).
* :mod:`.nm_sparsity`: the N:M (2:4) mask rule (``nm_keep``), its transposable 2:4 variant.
* ``EarlyExitGPT`` and its layers are re-exported here from :mod:`lightning_dynmo.models.early_exit`
  for existing imports.
* :mod:`.freezing`: freezing a layer for real (no grad, optimizer state freed); Egeria's reference
  copy (``snapshot_layer``) and ``plasticity``.
"""
from ..models.early_exit import EarlyExitGPT, ExitBlock, ExitEmbedding, ExitFinalNorm, active_mask_of
from .nm_sparsity import nm_keep, parse_nm, satisfies_nm, transposable_2to4_keep
from .freezing import freeze_layer, is_frozen, layer_grad_norm, plasticity, snapshot_layer
from .pruning import (
    ParamSwap,
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
    "plasticity",
    "snapshot_layer",
    "ParamSwap",
    "PrunableLinear",
    "cubic_sparsity",
    "global_magnitude_threshold",
    "make_prunable",
    "prunable_modules",
    "sparse_kernels_available",
    "nm_keep",
    "parse_nm",
    "satisfies_nm",
    "transposable_2to4_keep",
]
