"""Sparse linear layers that make pruning pay: CSR SpMM/SDDMM kernels (cpp/) behind an
autograd module, and a measured dense-vs-sparse dispatch so pruning never slows a layer."""
from ._ops import cuda_kernels_available, extension_available, extension_error
from .dispatch import crossover_density, maybe_sparsify
from .linear import MaskedLinear, SparseLinear

__all__ = ["SparseLinear", "MaskedLinear", "maybe_sparsify", "crossover_density",
           "extension_available", "extension_error", "cuda_kernels_available"]
